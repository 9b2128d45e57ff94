"""Errors of the registry's pure code, independent of gRPC.

Each error carries a `Code`; the servicer maps it to the gRPC status of the same name. The message
always names the offending field, file or tensor.
"""

from __future__ import annotations

import enum


class Code(enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"


class RegistryError(Exception):
    """An error with a status code; `str(err)` is the message the client sees."""

    code: Code = Code.INVALID_ARGUMENT

    def __init__(self, message: str, code: Code | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgument(RegistryError):
    """Malformed input: names, JSON, safetensors structure, dtypes, non-finite values."""

    code = Code.INVALID_ARGUMENT


class FailedPrecondition(RegistryError):
    """The adapter parses but cannot be served: unsupported feature or module, rank, shapes."""

    code = Code.FAILED_PRECONDITION


class NotFound(RegistryError):
    code = Code.NOT_FOUND


class AlreadyExists(RegistryError):
    code = Code.ALREADY_EXISTS


class ResourceExhausted(RegistryError):
    code = Code.RESOURCE_EXHAUSTED
