"""The engine's errors, independent of gRPC and HTTP.

An `EngineError` is a `StatusError` (loraformat.errors), so a front catches the engine's own refusals and
the adapter format's (a local adapter that does not compile) in one clause. Its `code` is a kind from the
shared `Code` vocabulary; each front maps kinds to its own statuses in one place (the gRPC servicer to
grpc.StatusCode, the HTTP front to HTTP statuses). The loop and scheduler end requests with the same
kinds (`request.Failed.code`), never with status names of a protocol.
"""

from __future__ import annotations

from loraformat.errors import Code, StatusError

__all__ = [
    "Code",
    "EngineError",
    "FailedPrecondition",
    "InvalidArgument",
    "NotFound",
    "ResourceExhausted",
    "Unavailable",
]


class EngineError(StatusError):
    """A condition of the engine; `str(err)` is the message the client sees."""


class NotFound(EngineError):
    """An adapter the engine does not know (not local, not registered)."""

    code = Code.NOT_FOUND


class InvalidArgument(EngineError):
    code = Code.INVALID_ARGUMENT


class FailedPrecondition(EngineError):
    """The request is well-formed but this engine cannot serve it (rank over --max-lora-rank, ...)."""

    code = Code.FAILED_PRECONDITION


class ResourceExhausted(EngineError):
    code = Code.RESOURCE_EXHAUSTED


class Unavailable(EngineError):
    """Retry later: the registry is unreachable, an adapter is busy, the engine is stopping."""

    code = Code.UNAVAILABLE
