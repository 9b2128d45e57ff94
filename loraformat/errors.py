"""Errors of the adapter format, independent of gRPC.

`StatusError` is the one error base both services map to gRPC: each error carries a `Code` whose name
is the gRPC status it becomes at a servicer. The message always names the offending field, file or
tensor. The registry adds its own kinds (`registry.errors`), the engine its own (`engine.errors`).
"""

from __future__ import annotations

import enum

# gRPC carries the message in a trailer (8 KiB by default); a message built from a huge input must
# neither break that nor flood a terminal, so every message is capped and inputs are quoted short.
MAX_MESSAGE_CHARS = 600
QUOTE_CHARS = 80


class Code(enum.StrEnum):  # a str: a kind compares equal to its name
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    # Past a deadline (a running request, or a registration's client) / a failed engine step.
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    INTERNAL = "INTERNAL"


class StatusError(Exception):
    """An error with a status code; `str(err)` is the message the client sees."""

    code: Code = Code.INVALID_ARGUMENT

    def __init__(self, message: str, code: Code | None = None):
        super().__init__(cap_message(message))
        if code is not None:
            self.code = code


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """repr() of at most `limit` characters of an input, saying how much was left out."""
    text = str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def cap_message(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[:MAX_MESSAGE_CHARS] + f"... ({len(message) - MAX_MESSAGE_CHARS} more characters)"


class InvalidArgument(StatusError):
    """Malformed input: names, JSON, safetensors structure, dtypes, non-finite values."""

    code = Code.INVALID_ARGUMENT


class FailedPrecondition(StatusError):
    """The input parses but cannot be served: unsupported architecture, feature or module, rank, shapes."""

    code = Code.FAILED_PRECONDITION


class ResourceExhausted(StatusError):
    code = Code.RESOURCE_EXHAUSTED
