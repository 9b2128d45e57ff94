"""Object stores for content-addressed, write-once blobs.

A blob is named by the sha256 hex digest of its bytes and lives at `blobs/sha256/<digest[:2]>/<digest>`
under a local root or an S3 prefix. Blobs are write-once: a put of a digest that exists changes nothing,
so readers never see a blob change under them. The stores never hash: the caller names the digest and
hashes bytes itself (moto and some S3-compatible stores do not verify client checksums).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

import boto3
import botocore.config
from botocore.exceptions import BotoCoreError, ClientError

from registry.errors import Code, InvalidArgument, NotFound, RegistryError

MiB = 1 << 20
DEFAULT_CHUNK_SIZE = MiB
DEFAULT_PART_SIZE = 8 * MiB
MIN_PART_SIZE = 5 * MiB  # S3 refuses smaller parts, except the last one
BLOB_DIR = "blobs/sha256"
TEMP_PREFIX = ".tmp-"

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

    def put_file(self, digest: str, path: Path, take: bool = False) -> bool:
        """take: the caller hands `path` over (it neither changes nor reuses the file after the call),
        so a store on its filesystem may make that file the blob itself rather than a copy."""
        ...

    def exists(self, digest: str) -> bool: ...

    def size(self, digest: str) -> int: ...

    def iter_chunks(
        self, digest: str, chunk_size: int = DEFAULT_CHUNK_SIZE, offset: int = 0
    ) -> Iterator[bytes]: ...

    def delete(self, digest: str) -> None: ...

    def list_blobs(self) -> Iterator[BlobInfo]: ...

    def remove_leftovers(self, older_than: float) -> tuple[int, int]:
        """Remove partial writes (of crashed puts) begun before `older_than`; (count, bytes)."""
        ...


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

    def put_file(self, digest: str, path: Path, take: bool = False) -> bool:
        final = self.path(digest)
        if final.exists():
            os.utime(final)  # refreshed: gc's grace period now protects the row about to be committed
            return False
        final.parent.mkdir(parents=True, exist_ok=True)
        if take and path.stat().st_dev == final.parent.stat().st_dev:
            # the file itself becomes the blob (a registration's compiled artifact in the spool, on the
            # store's filesystem): made durable and read-only, then linked; no second copy is written
            _seal(path)
            os.utime(path)  # the blob's age counts from now, as a copy's would
            source = path
        else:
            source = _write_temp_copy(path, final.parent)
        try:
            os.link(source, final)
        except FileExistsError:
            os.utime(final)
            return False
        finally:
            if source is not path:
                source.unlink()
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


    def remove_leftovers(self, older_than: float) -> tuple[int, int]:
        """Hidden temp files of puts that never finished (a crash between write and link)."""
        count = num_bytes = 0
        for path in (self.root / BLOB_DIR).glob(f"*/{TEMP_PREFIX}*"):
            with contextlib.suppress(FileNotFoundError):
                st = path.stat()
                if st.st_mtime < older_than:
                    path.unlink()
                    count += 1
                    num_bytes += st.st_size
        return count, num_bytes


def _write_temp_copy(src: Path, directory: Path) -> Path:
    """Copy `src` to a durable, read-only hidden temp file in `directory` (same filesystem as the blob)."""
    fd, name = tempfile.mkstemp(dir=directory, prefix=TEMP_PREFIX)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as dst, src.open("rb") as f:
            shutil.copyfileobj(f, dst, DEFAULT_CHUNK_SIZE)
            dst.flush()
            _durable_read_only(dst.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _seal(path: Path) -> None:
    """Make a file's bytes durable and the file read-only (as `_write_temp_copy` leaves its copy)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _durable_read_only(fd)
    finally:
        os.close(fd)


def _durable_read_only(fd: int) -> None:
    os.fsync(fd)
    os.fchmod(fd, 0o444)  # write-once: nobody should modify a blob in place


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


def s3_error_code(err: ClientError) -> str:
    return str(err.response.get("Error", {}).get("Code", ""))


def is_s3_missing(err: ClientError) -> bool:
    # head_object has no body, so a missing key shows only as the bare status "404".
    return s3_error_code(err) in ("404", "NoSuchKey", "NotFound")


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

    def put_file(self, digest: str, path: Path, take: bool = False) -> bool:
        key = self.key(digest)
        if self.exists(digest):
            self._touch(key)
            return False
        num_bytes = path.stat().st_size
        try:
            if num_bytes >= self.multipart_threshold:
                self._put_multipart(key, path)
            else:
                with path.open("rb") as f:
                    self._client.put_object(Bucket=self.bucket, Key=key, Body=f, IfNoneMatch="*")
        except ClientError as err:
            if s3_error_code(err) == "PreconditionFailed":
                return False
            raise
        self._check_stored_size(key, num_bytes)
        return True

    def _touch(self, key: str) -> None:
        """Refresh LastModified (a copy onto itself), so gc's grace period protects a re-registration."""
        source = {"Bucket": self.bucket, "Key": key}
        self._client.copy_object(Bucket=self.bucket, Key=key, CopySource=source, MetadataDirective="REPLACE")

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
            if is_s3_missing(err):
                return False
            raise
        return True

    def size(self, digest: str) -> int:
        try:
            return self._client.head_object(Bucket=self.bucket, Key=self.key(digest))["ContentLength"]
        except ClientError as err:
            if is_s3_missing(err):
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
            if is_s3_missing(err):
                raise NotFound(f"blob {digest} not found") from None
            raise
        with contextlib.closing(body):
            yield from body.iter_chunks(chunk_size)

    def delete(self, digest: str) -> None:
        self._client.delete_object(Bucket=self.bucket, Key=self.key(digest))

    def remove_leftovers(self, older_than: float) -> tuple[int, int]:
        """Abort multipart uploads of crashed puts (their parts cost storage until aborted)."""
        count = 0
        pages = self._client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=self._blob_root()
        )
        for page in pages:
            for upload in page.get("Uploads", []):
                if upload["Initiated"].timestamp() < older_than:
                    self._client.abort_multipart_upload(
                        Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
                    count += 1
        return count, 0

    def _blob_root(self) -> str:
        return f"{self.prefix}/{BLOB_DIR}/" if self.prefix else f"{BLOB_DIR}/"

    def list_blobs(self) -> Iterator[BlobInfo]:
        root = self._blob_root()
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
        root = file_url_path(url, parts)
    elif url and not parts.scheme:
        root = Path(url).expanduser()
    else:
        raise InvalidArgument(
            f"object store {url!r} is invalid: use file:///abs/dir, a path, or s3://bucket[/prefix]?endpoint_url=URL&region=NAME"
        )
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    return LocalDirStore(root)


def bucket_of(url: str, parts: SplitResult) -> str:
    """The bucket of an `s3://bucket/...` URL, checked; errors name the whole URL."""
    try:
        return check_bucket(parts.netloc)
    except InvalidArgument as err:
        raise InvalidArgument(f"{url!r}: {err}") from None


def file_url_path(url: str, parts: SplitResult) -> Path:
    """The path of a `file:///absolute/path` URL (or `file://localhost/...`)."""
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
        bucket_of(url, parts),
        prefix=unquote(parts.path),
        endpoint_url=params.get("endpoint_url") or None,
        region=params.get("region") or None,
    )
