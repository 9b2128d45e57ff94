"""The sources of server-side imports: the two files of a PEFT adapter, copied into a spool directory.

`fetch_source` reads `s3://bucket/prefix` with the registry's own S3 endpoint and credentials, or a local
directory inside an allow list, and stops at a byte limit whatever the listing declared.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import BinaryIO
from urllib.parse import SplitResult, unquote, urlsplit

from botocore.exceptions import ClientError

from loraformat.peft_files import ADAPTER_FILES, PICKLE_WEIGHTS_FILES, WEIGHTS_FILE, pickle_refusal
from registry.errors import InvalidArgument, NotFound, ResourceExhausted
from registry.store import (
    MiB,
    S3Client,
    bucket_of,
    file_url_path,
    is_s3_missing,
    make_s3_client,
    s3_error_code,
)

_COPY_CHUNK = MiB
# Pickle weights are looked for only to refuse them with a hint, rather than as a missing file.
_LISTED_FILES = (*ADAPTER_FILES, *PICKLE_WEIGHTS_FILES)


@dataclass(frozen=True)
class _SourceFile:
    size: int  # as listed; the copy enforces the limit on the bytes actually read
    open: Callable[[], BinaryIO]


def fetch_source(
    uri: str,
    dest_dir: Path,
    *,
    allowed_dirs: Sequence[Path],
    max_bytes: int,
    s3_client_factory: Callable[[], S3Client] = make_s3_client,
    allowed_s3: Sequence[str] | None = None,
) -> dict[str, Path]:
    """Copy `adapter_config.json` and `adapter_model.safetensors` from `uri` into `dest_dir`.

    `uri` is `s3://bucket[/prefix]` (read with `s3_client_factory()`, whose endpoint and credentials come
    from the registry's configuration, never from the uri) or a local directory, `file:///dir` or an
    absolute path, that must resolve inside one of `allowed_dirs`, as must each file (no escape through
    `..` or symlinks). An s3:// uri must lie under one of `allowed_s3` (`s3://bucket[/prefix]`; None
    allows every bucket the registry's credentials reach, for a registry without authentication). A
    source that is not allowed and one that does not exist get the same answer, so the refusal tells
    nothing about what exists. At most `max_bytes + 1` bytes are read over both files. On failure no file is left
    in `dest_dir`. Returns filename -> copied path.
    """
    files = _list_source(uri, allowed_dirs, s3_client_factory, allowed_s3)
    _check_source_files(uri, files)
    declared = sum(files[name].size for name in ADAPTER_FILES)
    if declared > max_bytes:
        raise _over_limit(uri, max_bytes)
    return _copy_source(uri, files, dest_dir, max_bytes)


def _list_source(
    uri: str,
    allowed_dirs: Sequence[Path],
    s3_client_factory: Callable[[], S3Client],
    allowed_s3: Sequence[str] | None,
) -> dict[str, _SourceFile]:
    parts = urlsplit(uri)
    if parts.scheme == "s3":
        if allowed_s3 is not None and not _is_allowed_s3(uri, allowed_s3):
            raise _unavailable_source(uri)
        return _list_s3_source(uri, parts, s3_client_factory)
    if parts.scheme == "file":
        return _list_local_source(uri, file_url_path(uri, parts), allowed_dirs)
    if not parts.scheme and uri.startswith("/"):
        return _list_local_source(uri, Path(uri), allowed_dirs)
    raise InvalidArgument(
        f"source_uri {uri!r} is invalid: use s3://bucket/prefix, file:///abs/dir or an absolute path"
    )


def _list_local_source(uri: str, directory: Path, allowed_dirs: Sequence[Path]) -> dict[str, _SourceFile]:
    directory = _resolve_allowed(uri, directory, allowed_dirs)
    if not directory.is_dir():
        raise _unavailable_source(uri)
    files = {}
    for name in _LISTED_FILES:
        if not (directory / name).exists():
            continue
        path = _resolve_allowed(f"{uri}/{name}", directory / name, allowed_dirs)
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device would block or never end
            raise InvalidArgument(f"source_uri {uri!r}: {name} is not a regular file")
        files[name] = _SourceFile(st.st_size, partial(path.open, "rb"))
    return files


def _resolve_allowed(uri: str, path: Path, allowed_dirs: Sequence[Path]) -> Path:
    """Resolve symlinks and `..` first, then compare, so no spelling of a path can leave the allow list."""
    resolved = Path(os.path.realpath(path))
    if not any(resolved.is_relative_to(os.path.realpath(allowed)) for allowed in allowed_dirs):
        raise _unavailable_source(uri)
    return resolved


def _is_allowed_s3(uri: str, allowed_s3: Sequence[str]) -> bool:
    """Compared by path segments, so s3://b/team does not allow s3://b/team-evil; no `..` games."""
    parts = urlsplit(uri)
    segments = [p for p in unquote(parts.path).split("/") if p]
    if any(p in (".", "..") for p in segments):
        return False
    for allowed in allowed_s3:
        a = urlsplit(allowed)
        prefix = [p for p in unquote(a.path).split("/") if p]
        if a.netloc == parts.netloc and segments[: len(prefix)] == prefix:
            return True
    return False


def _unavailable_source(uri: str) -> NotFound:
    return NotFound(f"source_uri {uri!r} does not exist or is not an allowed import source")


def _list_s3_source(
    uri: str, parts: SplitResult, s3_client_factory: Callable[[], S3Client]
) -> dict[str, _SourceFile]:
    if parts.query or parts.fragment:
        raise InvalidArgument(
            f"source_uri {uri!r}: use s3://bucket/prefix without parameters; the endpoint is the registry's setting"
        )
    bucket = bucket_of(uri, parts)
    prefix = unquote(parts.path).strip("/")
    key_prefix = f"{prefix}/" if prefix else ""
    client = s3_client_factory()
    files = {}
    try:
        # Delimiter="/" lists only this level, so a prefix holding many other adapters stays cheap.
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=key_prefix, Delimiter="/"
        )
        for page in pages:
            for obj in page.get("Contents", []):
                name = obj["Key"][len(key_prefix) :]
                if name in _LISTED_FILES:
                    files[name] = _SourceFile(
                        obj["Size"], partial(_open_s3_object, client, bucket, obj["Key"])
                    )
    except ClientError as err:
        if s3_error_code(err) in ("NoSuchBucket", "AccessDenied"):
            raise _unavailable_source(uri) from None
        raise
    return files


def _open_s3_object(client: S3Client, bucket: str, key: str) -> BinaryIO:
    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"]
    except ClientError as err:
        if is_s3_missing(err):
            raise NotFound(f"source file s3://{bucket}/{key} not found") from None
        raise


def _check_source_files(uri: str, files: dict[str, _SourceFile]) -> None:
    if WEIGHTS_FILE not in files:
        for name in PICKLE_WEIGHTS_FILES:
            if name in files:
                raise InvalidArgument(f"source_uri {uri!r}: {pickle_refusal(name)}")
    for name in ADAPTER_FILES:
        if name not in files:
            raise NotFound(f"source_uri {uri!r}: {name} not found")


def _copy_source(uri: str, files: dict[str, _SourceFile], dest_dir: Path, max_bytes: int) -> dict[str, Path]:
    dest_dir.mkdir(parents=True, exist_ok=True)
    copied: dict[str, Path] = {}
    remaining = max_bytes
    try:
        for name in ADAPTER_FILES:
            copied[name] = dest_dir / name
            with contextlib.closing(files[name].open()) as src:
                num_bytes = _copy_limited(src, copied[name], remaining)
            if num_bytes > remaining:
                raise _over_limit(uri, max_bytes)
            remaining -= num_bytes
    except BaseException:
        for path in copied.values():
            path.unlink(missing_ok=True)
        raise
    return copied


def _copy_limited(src: BinaryIO, dest: Path, limit: int) -> int:
    """Copy up to `limit` bytes; reads at most `limit + 1` and returns `limit + 1` if `src` is longer.

    The sizes a listing declares can change before the read, so this, not the listing, is the guard.
    """
    num_bytes = 0
    with dest.open("wb") as dst:
        while chunk := src.read(min(_COPY_CHUNK, limit + 1 - num_bytes)):
            num_bytes += len(chunk)
            if num_bytes > limit:
                break
            dst.write(chunk)
    return num_bytes


def _over_limit(uri: str, max_bytes: int) -> ResourceExhausted:
    return ResourceExhausted(f"source_uri {uri!r} is over the import size limit of {max_bytes} bytes")
