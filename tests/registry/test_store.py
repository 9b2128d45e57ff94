"""Object store contract (local dir and S3 on loopback) and store URLs."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from registry import store as store_module
from registry.errors import InvalidArgument, NotFound
from registry.store import (
    LocalDirStore,
    MiB,
    ObjectStore,
    S3Store,
    make_s3_client,
    open_store,
)

PART_SIZE = 5 * MiB  # the smallest S3 allows, so the multipart path runs on small blobs


def write_blob(directory: Path, data: bytes) -> tuple[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(data).hexdigest()
    path = directory / f"src-{digest[:12]}"
    path.write_bytes(data)
    return digest, path


def read_blob(store: ObjectStore, digest: str, **kwargs) -> bytes:
    return b"".join(store.iter_chunks(digest, **kwargs))


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return LocalDirStore(tmp_path / "store")
    return S3Store(
        request.getfixturevalue("s3_bucket"),
        prefix="pre/fix",
        endpoint_url=request.getfixturevalue("s3_endpoint"),
        multipart_threshold=PART_SIZE,
        part_size=PART_SIZE,
    )


# -- store contract ----------------------------------------------------------------------------------


def test_put_then_read_back_exact_bytes(store: ObjectStore, tmp_path: Path):
    data = os.urandom(300_000)
    digest, path = write_blob(tmp_path / "src", data)
    assert not store.exists(digest)

    assert store.put_file(digest, path) is True

    assert store.exists(digest)
    assert store.size(digest) == len(data)
    assert read_blob(store, digest) == data


def test_a_file_handed_over_becomes_the_blob_on_the_stores_filesystem(tmp_path: Path, monkeypatch):
    """put_file(take=True) on a local store of the same filesystem links the caller's file as the blob
    (read-only, no copy written), which outlives the caller removing its own name; elsewhere, or
    without take, the blob is a copy."""
    store = LocalDirStore(tmp_path / "store")
    data = os.urandom(200_000)
    digest, path = write_blob(tmp_path / "spool", data)
    copies = []
    real_copy = store_module._write_temp_copy
    monkeypatch.setattr(store_module, "_write_temp_copy", lambda *a: copies.append(a) or real_copy(*a))

    assert store.put_file(digest, path, take=True) is True
    assert copies == [] and os.path.samefile(path, store.path(digest))
    assert not os.stat(store.path(digest)).st_mode & 0o222  # read-only, as a copied blob is
    path.unlink()  # the registration's temp dir goes
    assert read_blob(store, digest) == data and [b.digest for b in store.list_blobs()] == [digest]
    assert store.put_file(digest, write_blob(tmp_path / "again", data)[1], take=True) is False  # write-once

    other_digest, other = write_blob(tmp_path / "spool", b"another upload")
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: _other_device(real_stat(p, *a, **k), p, other))
    assert store.put_file(other_digest, other, take=True) is True  # another filesystem: copied
    assert len(copies) == 1 and not os.path.samefile(other, store.path(other_digest))
    monkeypatch.undo()
    third_digest, third = write_blob(tmp_path / "spool", b"a third")
    assert store.put_file(third_digest, third) is True and not os.path.samefile(third, store.path(third_digest))
    assert read_blob(store, other_digest) == b"another upload" and read_blob(store, third_digest) == b"a third"


real_stat = os.stat


def _other_device(result: os.stat_result, path, moved: Path) -> os.stat_result:
    """`moved`'s stat as if it lay on another device than everything else."""
    if Path(path) != moved:
        return result
    fields = list(result)
    fields[2] += 1  # st_dev
    return os.stat_result(fields)


def test_put_is_write_once(store: ObjectStore, tmp_path: Path):
    data = b"first"
    digest, path = write_blob(tmp_path / "src", data)
    other = tmp_path / "other"
    other.write_bytes(b"different bytes under the same digest")
    store.put_file(digest, path)

    assert store.put_file(digest, other) is False

    assert read_blob(store, digest) == data


def test_putting_an_existing_blob_refreshes_its_age(store: ObjectStore, tmp_path: Path):
    """gc removes orphans older than a grace period: a re-registration of the same content must make
    the blob young again, or gc could delete it just before the new row commits."""
    digest, path = write_blob(tmp_path / "src", b"shared content")
    store.put_file(digest, path)
    (before,) = [b.modified_at for b in store.list_blobs() if b.digest == digest]
    time.sleep(1.1)  # S3 LastModified has a resolution of one second
    assert store.put_file(digest, path) is False
    (after,) = [b.modified_at for b in store.list_blobs() if b.digest == digest]
    assert after >= before + 1
    assert read_blob(store, digest) == b"shared content"


def test_multipart_upload_round_trip(store: ObjectStore, tmp_path: Path):
    data = os.urandom(11 * MiB)  # parts of 5 + 5 + 1 MiB
    digest, path = write_blob(tmp_path / "src", data)

    assert store.put_file(digest, path) is True

    assert store.size(digest) == len(data)
    assert hashlib.sha256(read_blob(store, digest)).hexdigest() == digest
    if isinstance(store, S3Store):
        head = make_s3_client(store.endpoint_url).head_object(Bucket=store.bucket, Key=store.key(digest))
        assert head["ETag"].strip('"').endswith("-3")  # S3 marks multipart objects with the part count


@pytest.mark.parametrize("chunk_size", [4096, 256 * 1024, MiB])
@pytest.mark.parametrize("offset", [0, 1, MiB + 3])
def test_iter_chunks_offset_and_chunk_size(store: ObjectStore, tmp_path: Path, offset: int, chunk_size: int):
    data = os.urandom(2 * MiB + 17)
    digest, path = write_blob(tmp_path / "src", data)
    store.put_file(digest, path)

    chunks = list(store.iter_chunks(digest, chunk_size=chunk_size, offset=offset))

    assert b"".join(chunks) == data[offset:]
    assert all(0 < len(chunk) <= chunk_size for chunk in chunks)


def test_iter_chunks_offset_at_and_past_end(store: ObjectStore, tmp_path: Path):
    digest, path = write_blob(tmp_path / "src", b"0123456789")
    store.put_file(digest, path)

    assert list(store.iter_chunks(digest, offset=10)) == []
    with pytest.raises(InvalidArgument, match="offset 11"):
        store.iter_chunks(digest, offset=11)
    with pytest.raises(InvalidArgument, match="offset -1"):
        store.iter_chunks(digest, offset=-1)


def test_missing_blob(store: ObjectStore):
    digest = hashlib.sha256(b"never stored").hexdigest()

    assert not store.exists(digest)
    with pytest.raises(NotFound, match=digest):
        store.size(digest)
    with pytest.raises(NotFound, match=digest):
        store.iter_chunks(digest)  # raised before the first chunk is asked for
    store.delete(digest)  # deleting what is absent is not an error


def test_list_blobs_and_delete(store: ObjectStore, tmp_path: Path):
    blobs = {}
    for i in range(3):
        digest, path = write_blob(tmp_path / "src", os.urandom(1000 + i))
        store.put_file(digest, path)
        blobs[digest] = 1000 + i
    gone = next(iter(blobs))

    listed = {info.digest: info for info in store.list_blobs()}
    store.delete(gone)

    assert {d: info.size for d, info in listed.items()} == blobs
    assert all(abs(info.modified_at - time.time()) < 300 for info in listed.values())
    assert not store.exists(gone)
    assert {info.digest for info in store.list_blobs()} == set(blobs) - {gone}


@pytest.mark.parametrize(
    "digest",
    ["../x", "A" * 64, "a" * 63, "a" * 65, "a" * 64 + "\n", "../" + "a" * 61, "g" * 64, ""],
)
def test_invalid_digests_are_refused(store: ObjectStore, tmp_path: Path, digest: str):
    _, path = write_blob(tmp_path / "src", b"x")

    for call in (
        lambda: store.put_file(digest, path),
        lambda: store.exists(digest),
        lambda: store.size(digest),
        lambda: store.iter_chunks(digest),
        lambda: store.delete(digest),
    ):
        with pytest.raises(InvalidArgument, match="sha256"):
            call()
    assert list(store.list_blobs()) == []


@pytest.mark.parametrize("num_bytes", [4096, 6 * MiB])
def test_concurrent_puts_of_one_digest_leave_one_correct_blob(
    store: ObjectStore, tmp_path: Path, num_bytes: int
):
    data = os.urandom(num_bytes)
    digest, path = write_blob(tmp_path / "src", data)
    barrier = threading.Barrier(4)

    def put() -> bool:
        barrier.wait()
        return store.put_file(digest, path)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: put(), range(4)))

    # The local store's link is atomic, so exactly one put wins; S3's conditional write is checked by
    # the server, and a store that ignores it rewrites identical bytes, so at least one wins there.
    assert sum(results) == 1 if isinstance(store, LocalDirStore) else sum(results) >= 1
    assert [info.digest for info in store.list_blobs()] == [digest]
    assert read_blob(store, digest) == data
    if isinstance(store, S3Store):
        uploads = make_s3_client(store.endpoint_url).list_multipart_uploads(Bucket=store.bucket)
        assert uploads.get("Uploads", []) == []  # losers aborted theirs


def test_local_put_writes_read_only_blob_and_hides_temp_files(tmp_path: Path):
    store = LocalDirStore(tmp_path / "store")
    digest, path = write_blob(tmp_path / "src", b"payload")
    store.put_file(digest, path)
    (store.path(digest).parent / ".tmp-crashed").write_bytes(b"partial")

    assert store.path(digest).stat().st_mode & 0o777 == 0o444
    assert [info.digest for info in store.list_blobs()] == [digest]


def test_local_failed_put_leaves_nothing(tmp_path: Path):
    store = LocalDirStore(tmp_path / "store")
    digest = hashlib.sha256(b"missing").hexdigest()

    with pytest.raises(FileNotFoundError):
        store.put_file(digest, tmp_path / "does-not-exist")

    assert not store.exists(digest)
    assert list(store.path(digest).parent.iterdir()) == []


def test_s3_failed_multipart_upload_is_aborted(
    s3_endpoint: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    store = S3Store(s3_bucket, endpoint_url=s3_endpoint, multipart_threshold=PART_SIZE, part_size=PART_SIZE)
    digest, path = write_blob(tmp_path / "src", os.urandom(11 * MiB))
    real_upload_part = store._client.upload_part

    def fail_second_part(**kwargs):
        if kwargs["PartNumber"] == 2:
            raise ConnectionError("link dropped")
        return real_upload_part(**kwargs)

    monkeypatch.setattr(store._client, "upload_part", fail_second_part)

    with pytest.raises(ConnectionError):
        store.put_file(digest, path)

    assert not store.exists(digest)
    uploads = make_s3_client(s3_endpoint).list_multipart_uploads(Bucket=s3_bucket)
    assert uploads.get("Uploads", []) == []


# -- store URLs --------------------------------------------------------------------------------------


def test_open_store_local_forms_create_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    for url, root in [
        (f"file://{tmp_path}/a%20b", tmp_path / "a b"),
        (str(tmp_path / "plain"), tmp_path / "plain"),
        ("relative/dir", tmp_path / "relative/dir"),
    ]:
        store = open_store(url)
        assert isinstance(store, LocalDirStore)
        assert store.root == root.resolve()
        assert root.is_dir()


def test_open_store_s3(s3_endpoint: str, s3_bucket: str, tmp_path: Path):
    store = open_store(f"s3://{s3_bucket}/team/a/?endpoint_url={s3_endpoint}&region=eu-west-1")
    digest, path = write_blob(tmp_path / "src", b"hello")

    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.endpoint_url, store.region) == (
        s3_bucket,
        "team/a",
        s3_endpoint,
        "eu-west-1",
    )
    assert store.put_file(digest, path)
    assert store.key(digest) == f"team/a/blobs/sha256/{digest[:2]}/{digest}"
    assert read_blob(store, digest) == b"hello"


@pytest.mark.parametrize(
    "url",
    [
        "",
        "http://example.com/x",
        "s3://",
        "s3://ab",
        "s3://Bucket",
        "s3://bucket?foo=1",
        "s3://bucket?endpoint_url",
        "file://otherhost/x",
        "file:relative",
    ],
)
def test_open_store_refuses_bad_urls(url: str):
    with pytest.raises(InvalidArgument) as err:
        open_store(url)
    assert repr(url) in str(err.value)


def test_s3_put_racing_past_the_existence_check_still_writes_once(
    s3_endpoint: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    store = S3Store(s3_bucket, endpoint_url=s3_endpoint, multipart_threshold=PART_SIZE, part_size=PART_SIZE)
    small, small_path = write_blob(tmp_path / "src", b"small")
    large, large_path = write_blob(tmp_path / "src", os.urandom(6 * MiB))
    store.put_file(small, small_path)
    store.put_file(large, large_path)
    monkeypatch.setattr(
        store, "exists", lambda digest: False
    )  # as if another put landed just after the check

    assert store.put_file(small, small_path) is False
    assert store.put_file(large, large_path) is False
    uploads = make_s3_client(s3_endpoint).list_multipart_uploads(Bucket=s3_bucket)
    assert uploads.get("Uploads", []) == []
