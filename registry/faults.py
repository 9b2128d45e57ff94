"""Infrastructure faults as status errors: what a client may retry, and what says the disk is full.

A handler that meets an exception which is not a `StatusError` asks `as_status_error`: a full disk is
RESOURCE_EXHAUSTED; an unreachable or failing database or object store is UNAVAILABLE (retryable);
anything else stays a bug (INTERNAL, logged). Reasons are one short line; the full error goes to the
registry's log.
"""

from __future__ import annotations

import errno
import sqlite3

import sqlalchemy.exc
from botocore.exceptions import BotoCoreError, ClientError
from urllib3.exceptions import HTTPError as Urllib3Error

from registry.errors import Code, RegistryError, ResourceExhausted

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_REASON_CHARS = 160


def as_status_error(exc: BaseException) -> RegistryError | None:
    """The status error an infrastructure fault maps to, or None when `exc` is not one."""
    if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
        return ResourceExhausted(f"the registry's disk is full ({exc.strerror}); try again later")
    if isinstance(exc, sqlalchemy.exc.DBAPIError):
        return _database_fault(exc)
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if status >= 500 or status in (408, 429):
            return _unavailable("the object store", exc)
        return None
    if isinstance(exc, BotoCoreError | Urllib3Error | ConnectionError | TimeoutError):
        return _unavailable("the object store", exc)
    return None


def _database_fault(exc: sqlalchemy.exc.DBAPIError) -> RegistryError | None:
    orig = exc.orig
    if isinstance(orig, sqlite3.OperationalError) and "full" in str(orig):
        return ResourceExhausted("the registry's database disk is full; try again later")
    if isinstance(exc, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError) or exc.connection_invalidated:
        return _unavailable("the database", exc.orig or exc)
    return None


def _unavailable(what: str, exc: BaseException) -> RegistryError:
    return RegistryError(f"{what} is unavailable ({short_reason(exc)}); try again later", Code.UNAVAILABLE)


def short_reason(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return text if len(text) <= _REASON_CHARS else text[:_REASON_CHARS] + "..."
