"""Object stores for content-addressed, write-once blobs, and the sources of server-side imports.

A blob is named by the sha256 hex digest of its bytes and lives at `blobs/sha256/<digest[:2]>/<digest>`
under a local root or an S3 prefix. Blobs are write-once: a put of a digest that exists changes nothing,
so readers never see a blob change under them. The stores never hash: the caller names the digest and
hashes bytes itself (moto and some S3-compatible stores do not verify client checksums).

`fetch_source` copies the two files of a PEFT adapter from `s3://bucket/prefix` or an allow-listed local
directory into a spool directory, stopping at a byte limit.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

import boto3
import botocore.config
from botocore.exceptions import BotoCoreError, ClientError

from registry.errors import Code, InvalidArgument, NotFound, RegistryError, ResourceExhausted

MiB = 1 << 20
DEFAULT_CHUNK_SIZE = MiB
DEFAULT_PART_SIZE = 8 * MiB
MIN_PART_SIZE = 5 * MiB  # S3 refuses smaller parts, except the last one
BLOB_DIR = "blobs/sha256"

_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
# S3 bucket naming rules (3-63 characters); also keeps a URL's host part from smuggling in odd values.
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")

S3Client = Any  # boto3 builds its client classes at run time; there is no importable type


@dataclass(frozen=True)
class BlobInfo:
    digest: str
    size: int
    modified_at: float  # UTC POSIX seconds


class ObjectStore(Protocol):
    """A content-addressed, write-once blob store.

    Invariants: a blob is visible under its final name only once complete; `put_file` of a digest that
    exists changes nothing and returns False; every method refuses a digest that is not 64 lowercase hex
    characters with InvalidArgument, before touching storage.
    """

    def put_file(self, digest: str, path: Path) -> bool: ...

    def exists(self, digest: str) -> bool: ...

    def size(self, digest: str) -> int: ...

    def iter_chunks(
        self, digest: str, chunk_size: int = DEFAULT_CHUNK_SIZE, offset: int = 0
    ) -> Iterator[bytes]: ...

    def delete(self, digest: str) -> None: ...

    def list_blobs(self) -> Iterator[BlobInfo]: ...


def check_digest(digest: str) -> str:
    """Return `digest` if it is a sha256 hex digest; anything else could name a path outside the store."""
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise InvalidArgument(
            f"digest {str(digest)[:80]!r} is not a sha256 digest (64 lowercase hex characters)"
        )
    return digest


def blob_key(digest: str) -> str:
    return f"{BLOB_DIR}/{digest[:2]}/{digest}"


def _check_read_args(digest: str, chunk_size: int, offset: int, size: int) -> None:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if not 0 <= offset <= size:
        raise InvalidArgument(f"offset {offset} is outside blob {digest} of {size} bytes")


# -- local directory ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalDirStore:
    """Blobs as read-only files under `root`.

    A put writes a hidden temp file in the blob's own directory, fsyncs it, then hard-links it to the
    final name: `link` is atomic and fails if the name exists, so concurrent puts of one digest leave
    exactly one complete blob and a crash leaves at most a hidden temp file, never a partial blob.
    """

    root: Path

    def path(self, digest: str) -> Path:
        return self.root / blob_key(check_digest(digest))

    def put_file(self, digest: str, path: Path) -> bool:
        final = self.path(digest)
        if final.exists():
            return False
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = _write_temp_copy(path, final.parent)
        try:
            os.link(tmp, final)
        except FileExistsError:
            return False
        finally:
            tmp.unlink()
        _fsync_dir(final.parent)
        return True

    def exists(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def size(self, digest: str) -> int:
        try:
            return self.path(digest).stat().st_size
        except FileNotFoundError:
            raise NotFound(f"blob {digest} not found") from None

    def iter_chunks(
        self, digest: str, chunk_size: int = DEFAULT_CHUNK_SIZE, offset: int = 0
    ) -> Iterator[bytes]:
        """Check eagerly (NotFound, bad offset) so callers fail before they send anything; read lazily."""
        _check_read_args(digest, chunk_size, offset, self.size(digest))
        return self._read_chunks(digest, chunk_size, offset)

    def _read_chunks(self, digest: str, chunk_size: int, offset: int) -> Iterator[bytes]:
        try:
            with self.path(digest).open("rb") as f:
                f.seek(offset)
                while chunk := f.read(chunk_size):
                    yield chunk
        except FileNotFoundError:
            raise NotFound(f"blob {digest} not found") from None

    def delete(self, digest: str) -> None:
        self.path(digest).unlink(missing_ok=True)

    def list_blobs(self) -> Iterator[BlobInfo]:
        """Complete blobs only: temp files of puts in flight (or of a crash) do not match a digest."""
        for path in sorted((self.root / BLOB_DIR).glob("*/*")):
            if _DIGEST_RE.fullmatch(path.name) and path.parent.name == path.name[:2]:
                with contextlib.suppress(FileNotFoundError):  # deleted while listing
                    st = path.stat()
                    yield BlobInfo(path.name, st.st_size, st.st_mtime)


def _write_temp_copy(src: Path, directory: Path) -> Path:
    """Copy `src` to a durable, read-only hidden temp file in `directory` (same filesystem as the blob)."""
    fd, name = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as dst, src.open("rb") as f:
            shutil.copyfileobj(f, dst, DEFAULT_CHUNK_SIZE)
            dst.flush()
            os.fsync(dst.fileno())
            os.fchmod(dst.fileno(), 0o444)  # write-once: nobody should modify a blob in place
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _fsync_dir(directory: Path) -> None:
    """Make the new directory entry durable, not only the file's data."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- S3 ----------------------------------------------------------------------------------------------


def make_s3_client(endpoint_url: str | None = None, region: str | None = None) -> S3Client:
    """An S3 client that also works against non-AWS endpoints (MinIO, moto).

    Path-style addressing because bucket-named hosts do not resolve on loopback; checksums only when an
    API requires them because several S3-compatible stores reject or ignore the newer checksum headers.
    Credentials come from boto3's usual chain (environment, config files, instance roles).
    """
    config = botocore.config.Config(
        s3={"addressing_style": "path"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        retries={"max_attempts": 5, "mode": "standard"},
    )
    return boto3.client("s3", endpoint_url=endpoint_url, region_name=region or "us-east-1", config=config)


def check_bucket(bucket: str) -> str:
    if not _BUCKET_RE.fullmatch(bucket):
        raise InvalidArgument(
            f"bucket {bucket[:80]!r} is invalid: use 3-63 characters of a-z, 0-9, '.', '-', starting and ending with a letter or digit"
        )
    return bucket


def _error_code(err: ClientError) -> str:
    return str(err.response.get("Error", {}).get("Code", ""))


def _is_missing(err: ClientError) -> bool:
    # head_object has no body, so a missing key shows only as the bare status "404".
    return _error_code(err) in ("404", "NoSuchKey", "NotFound")


class S3Store:
    """Blobs as objects `<prefix>/blobs/sha256/<xx>/<digest>` in one bucket.

    Write-once through a conditional write (`If-None-Match: *`): the loser of a race gets 412 and
    returns False. Stores that ignore the condition overwrite a blob with identical bytes, which is
    still safe for content-addressed data. Blobs of `multipart_threshold` bytes or more stream up in
    `part_size` parts, reading one part at a time; a failed multipart upload is aborted.
    """

    def __init__(
        self,
        bucket: str,
        *,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        multipart_threshold: int = DEFAULT_PART_SIZE,
        part_size: int = DEFAULT_PART_SIZE,
    ):
        if part_size < MIN_PART_SIZE:
            raise ValueError(
                f"part_size must be at least {MIN_PART_SIZE} bytes (an S3 limit), got {part_size}"
            )
        self.bucket = check_bucket(bucket)
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.region = region
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self._client = make_s3_client(endpoint_url, region)

    def key(self, digest: str) -> str:
        key = blob_key(check_digest(digest))
        return f"{self.prefix}/{key}" if self.prefix else key

    def put_file(self, digest: str, path: Path) -> bool:
        key = self.key(digest)
        if self.exists(digest):
            return False
        num_bytes = path.stat().st_size
        try:
            if num_bytes >= self.multipart_threshold:
                self._put_multipart(key, path)
            else:
                with path.open("rb") as f:
                    self._client.put_object(Bucket=self.bucket, Key=key, Body=f, IfNoneMatch="*")
        except ClientError as err:
            if _error_code(err) == "PreconditionFailed":
                return False
            raise
        self._check_stored_size(key, num_bytes)
        return True

    def _put_multipart(self, key: str, path: Path) -> None:
        upload_id = self._client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        try:
            parts = self._upload_parts(key, upload_id, path)
            self._client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                IfNoneMatch="*",
            )
        except BaseException:
            # An abandoned upload keeps its parts (and their cost) until a lifecycle rule removes them.
            # If the abort fails too, the original error is the one worth reporting.
            with contextlib.suppress(ClientError, BotoCoreError):
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise

    def _upload_parts(self, key: str, upload_id: str, path: Path) -> list[dict[str, Any]]:
        parts = []
        with path.open("rb") as f:
            while data := f.read(self.part_size):
                number = len(parts) + 1
                resp = self._client.upload_part(
                    Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data
                )
                parts.append({"PartNumber": number, "ETag": resp["ETag"]})
        return parts

    def _check_stored_size(self, key: str, num_bytes: int) -> None:
        """The endpoint may not verify checksums, so at least catch a truncated object, and remove it."""
        stored = self._client.head_object(Bucket=self.bucket, Key=key)["ContentLength"]
        if stored != num_bytes:
            self._client.delete_object(Bucket=self.bucket, Key=key)
            raise RegistryError(
                f"object store kept {stored} of {num_bytes} bytes of s3://{self.bucket}/{key}; removed it",
                Code.UNAVAILABLE,
            )

    def exists(self, digest: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self.key(digest))
        except ClientError as err:
            if _is_missing(err):
                return False
            raise
        return True

    def size(self, digest: str) -> int:
        try:
            return self._client.head_object(Bucket=self.bucket, Key=self.key(digest))["ContentLength"]
        except ClientError as err:
            if _is_missing(err):
                raise NotFound(f"blob {digest} not found") from None
            raise

    def iter_chunks(
        self, digest: str, chunk_size: int = DEFAULT_CHUNK_SIZE, offset: int = 0
    ) -> Iterator[bytes]:
        """Check eagerly (NotFound, bad offset) so callers fail before they send anything; read lazily."""
        size = self.size(digest)
        _check_read_args(digest, chunk_size, offset, size)
        if offset == size:
            return iter(())  # S3 answers an empty range with 416, not with zero bytes
        return self._read_chunks(digest, chunk_size, offset)

    def _read_chunks(self, digest: str, chunk_size: int, offset: int) -> Iterator[bytes]:
        args = {"Bucket": self.bucket, "Key": self.key(digest)}
        if offset:
            args["Range"] = f"bytes={offset}-"
        try:
            body = self._client.get_object(**args)["Body"]
        except ClientError as err:
            if _is_missing(err):
                raise NotFound(f"blob {digest} not found") from None
            raise
        with contextlib.closing(body):
            yield from body.iter_chunks(chunk_size)

    def delete(self, digest: str) -> None:
        self._client.delete_object(Bucket=self.bucket, Key=self.key(digest))

    def list_blobs(self) -> Iterator[BlobInfo]:
        root = f"{self.prefix}/{BLOB_DIR}/" if self.prefix else f"{BLOB_DIR}/"
        for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=root):
            for obj in page.get("Contents", []):
                shard, _, name = obj["Key"][len(root) :].partition("/")
                if _DIGEST_RE.fullmatch(name) and shard == name[:2]:
                    yield BlobInfo(name, obj["Size"], obj["LastModified"].timestamp())


# -- store URLs --------------------------------------------------------------------------------------


def open_store(url: str) -> ObjectStore:
    """`file:///abs/dir`, a plain path, or `s3://bucket[/prefix]?endpoint_url=...&region=...`.

    A local directory is created if missing.
    """
    parts = urlsplit(url)
    if parts.scheme == "s3":
        return _open_s3_store(url, parts)
    if parts.scheme == "file":
        root = _local_path(url, parts)
    elif url and not parts.scheme:
        root = Path(url).expanduser()
    else:
        raise InvalidArgument(
            f"object store {url!r} is invalid: use file:///abs/dir, a path, or s3://bucket[/prefix]?endpoint_url=URL&region=NAME"
        )
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    return LocalDirStore(root)


def _bucket_of(url: str, parts: SplitResult) -> str:
    try:
        return check_bucket(parts.netloc)
    except InvalidArgument as err:
        raise InvalidArgument(f"{url!r}: {err}") from None


def _local_path(url: str, parts: SplitResult) -> Path:
    if (
        parts.netloc not in ("", "localhost")
        or parts.query
        or parts.fragment
        or not parts.path.startswith("/")
    ):
        raise InvalidArgument(f"{url!r} is invalid: a file URL must be file:///absolute/path")
    return Path(unquote(parts.path))


def _open_s3_store(url: str, parts: SplitResult) -> S3Store:
    if not parts.netloc or parts.fragment:
        raise InvalidArgument(
            f"object store {url!r} is invalid: use s3://bucket[/prefix]?endpoint_url=URL&region=NAME"
        )
    try:
        params = dict(parse_qsl(parts.query, strict_parsing=True)) if parts.query else {}
    except ValueError:
        raise InvalidArgument(f"object store {url!r}: the query is malformed") from None
    unknown = sorted(set(params) - {"endpoint_url", "region"})
    if unknown:
        raise InvalidArgument(
            f"object store {url!r}: unknown parameter {unknown[0]!r} (known: endpoint_url, region)"
        )
    return S3Store(
        _bucket_of(url, parts),
        prefix=unquote(parts.path),
        endpoint_url=params.get("endpoint_url") or None,
        region=params.get("region") or None,
    )


# -- server-side import sources ----------------------------------------------------------------------

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
SOURCE_FILES = (CONFIG_FILE, WEIGHTS_FILE)
PICKLE_WEIGHTS_FILES = ("adapter_model.bin", "adapter_model.pt")
_COPY_CHUNK = MiB


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
) -> dict[str, Path]:
    """Copy `adapter_config.json` and `adapter_model.safetensors` from `uri` into `dest_dir`.

    `uri` is `s3://bucket[/prefix]` (read with `s3_client_factory()`, whose endpoint and credentials come
    from the registry's configuration, never from the uri) or a local directory, `file:///dir` or an
    absolute path, that must resolve inside one of `allowed_dirs`, as must each file (no escape through
    `..` or symlinks). At most `max_bytes + 1` bytes are read over both files. On failure no file is left
    in `dest_dir`. Returns filename -> copied path.
    """
    files = _list_source(uri, allowed_dirs, s3_client_factory)
    _check_source_files(uri, files)
    declared = sum(files[name].size for name in SOURCE_FILES)
    if declared > max_bytes:
        raise _over_limit(uri, max_bytes)
    return _copy_source(uri, files, dest_dir, max_bytes)


def _list_source(
    uri: str, allowed_dirs: Sequence[Path], s3_client_factory: Callable[[], S3Client]
) -> dict[str, _SourceFile]:
    parts = urlsplit(uri)
    if parts.scheme == "s3":
        return _list_s3_source(uri, parts, s3_client_factory)
    if parts.scheme == "file":
        return _list_local_source(uri, _local_path(uri, parts), allowed_dirs)
    if not parts.scheme and uri.startswith("/"):
        return _list_local_source(uri, Path(uri), allowed_dirs)
    raise InvalidArgument(
        f"source_uri {uri!r} is invalid: use s3://bucket/prefix, file:///abs/dir or an absolute path"
    )


def _list_local_source(uri: str, directory: Path, allowed_dirs: Sequence[Path]) -> dict[str, _SourceFile]:
    directory = _resolve_allowed(uri, directory, allowed_dirs)
    if not directory.is_dir():
        raise NotFound(f"source_uri {uri!r}: no such directory")
    files = {}
    for name in (*SOURCE_FILES, *PICKLE_WEIGHTS_FILES):
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
        raise InvalidArgument(f"source_uri {uri!r} is not under an allow-listed import directory")
    return resolved


def _list_s3_source(
    uri: str, parts: SplitResult, s3_client_factory: Callable[[], S3Client]
) -> dict[str, _SourceFile]:
    if parts.query or parts.fragment:
        raise InvalidArgument(
            f"source_uri {uri!r}: use s3://bucket/prefix without parameters; the endpoint is the registry's setting"
        )
    bucket = _bucket_of(uri, parts)
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
                if name in SOURCE_FILES or name in PICKLE_WEIGHTS_FILES:
                    files[name] = _SourceFile(
                        obj["Size"], partial(_open_s3_object, client, bucket, obj["Key"])
                    )
    except ClientError as err:
        if _error_code(err) == "NoSuchBucket":
            raise NotFound(f"source_uri {uri!r}: no such bucket {bucket!r}") from None
        raise
    return files


def _open_s3_object(client: S3Client, bucket: str, key: str) -> BinaryIO:
    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"]
    except ClientError as err:
        if _is_missing(err):
            raise NotFound(f"source file s3://{bucket}/{key} not found") from None
        raise


def _check_source_files(uri: str, files: dict[str, _SourceFile]) -> None:
    if WEIGHTS_FILE not in files:
        for name in PICKLE_WEIGHTS_FILES:
            if name in files:
                raise InvalidArgument(
                    f"source_uri {uri!r} holds {name}, pickle weights the registry refuses to load: convert it to "
                    f"{WEIGHTS_FILE} (e.g. `model.save_pretrained(dir, safe_serialization=True)` in PEFT, or "
                    "`safetensors.torch.save_file(torch.load(path), 'adapter_model.safetensors')`)"
                )
    for name in SOURCE_FILES:
        if name not in files:
            raise NotFound(f"source_uri {uri!r}: {name} not found")


def _copy_source(uri: str, files: dict[str, _SourceFile], dest_dir: Path, max_bytes: int) -> dict[str, Path]:
    dest_dir.mkdir(parents=True, exist_ok=True)
    copied: dict[str, Path] = {}
    remaining = max_bytes
    try:
        for name in SOURCE_FILES:
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
