"""The registry's errors: the adapter format's status errors plus the registry's own kinds.

Each error carries a `Code`; the servicer maps it to the gRPC status of the same name. The message
always names the offending field, file or tensor.
"""

from __future__ import annotations

from loraformat.errors import (
    Code,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    StatusError,
    quote,
)

# The registry raises and catches the shared base under its own name: an adapter-format error met while
# registering is a registry error like any other.
RegistryError = StatusError

__all__ = [
    "AlreadyExists",
    "Code",
    "FailedPrecondition",
    "InvalidArgument",
    "NotFound",
    "RegistryError",
    "ResourceExhausted",
    "quote",
]


class NotFound(StatusError):
    code = Code.NOT_FOUND


class AlreadyExists(StatusError):
    code = Code.ALREADY_EXISTS
