"""Server-side import sources: allow-listed local directories and S3 on loopback, under a byte limit."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from loraformat.peft_files import CONFIG_FILE, WEIGHTS_FILE
from registry.errors import InvalidArgument, NotFound, ResourceExhausted
from registry.sources import fetch_source
from registry.store import MiB, make_s3_client

CONFIG_BYTES = b'{"r": 8, "lora_alpha": 16, "peft_type": "LORA"}'


def make_adapter_dir(directory: Path, weights: bytes = b"W" * 5000, weights_name: str = WEIGHTS_FILE) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_bytes(CONFIG_BYTES)
    (directory / weights_name).write_bytes(weights)
    return directory


def put_s3_adapter(endpoint: str, bucket: str, prefix: str, weights: bytes, weights_name: str = WEIGHTS_FILE):
    client = make_s3_client(endpoint)
    client.put_object(Bucket=bucket, Key=f"{prefix}/{CONFIG_FILE}", Body=CONFIG_BYTES)
    client.put_object(Bucket=bucket, Key=f"{prefix}/{weights_name}", Body=weights)


def fetch_from_s3(uri: str, dest: Path, client, max_bytes: int) -> dict[str, Path]:
    """fetch_source of an s3:// uri, read with `client`; no directory is allow-listed."""
    return fetch_source(uri, dest, allowed_dirs=[], max_bytes=max_bytes, s3_client_factory=lambda: client)


def assert_nothing_copied(dest: Path) -> None:
    assert not dest.exists() or list(dest.iterdir()) == []


@pytest.fixture
def allowed(tmp_path: Path) -> Path:
    return (tmp_path / "allowed").resolve()


def test_fetch_from_allow_listed_dir(allowed: Path, tmp_path: Path):
    source = make_adapter_dir(allowed / "team" / "a1")

    for uri in (str(source), f"file://{source}"):
        dest = tmp_path / "dest" / uri[:4]
        files = fetch_source(uri, dest, allowed_dirs=[allowed], max_bytes=MiB)

        assert files == {CONFIG_FILE: dest / CONFIG_FILE, WEIGHTS_FILE: dest / WEIGHTS_FILE}
        assert files[CONFIG_FILE].read_bytes() == CONFIG_BYTES
        assert files[WEIGHTS_FILE].read_bytes() == b"W" * 5000


def test_fetch_from_s3(s3_endpoint: str, s3_bucket: str, tmp_path: Path):
    weights = os.urandom(3 * MiB)
    put_s3_adapter(s3_endpoint, s3_bucket, "adapters/a1", weights)
    put_s3_adapter(s3_endpoint, s3_bucket, "adapters/a1-other", b"not these")

    files = fetch_from_s3(f"s3://{s3_bucket}/adapters/a1/", tmp_path / "dest", make_s3_client(s3_endpoint), 4 * MiB)

    assert files[CONFIG_FILE].read_bytes() == CONFIG_BYTES
    assert files[WEIGHTS_FILE].read_bytes() == weights


def escape_routes(allowed: Path, outside: Path) -> list[str]:
    """Spellings of a directory outside `allowed` that start inside it or look like it."""
    (allowed / "link").symlink_to(outside, target_is_directory=True)
    sneaky = make_adapter_dir(allowed / "sneaky")
    (sneaky / WEIGHTS_FILE).unlink()
    (sneaky / WEIGHTS_FILE).symlink_to(outside / WEIGHTS_FILE)
    sibling = make_adapter_dir(allowed.parent / (allowed.name + "-evil"))
    return [
        str(outside),
        f"{allowed}/../outside",
        f"file://{allowed}/../outside",
        str(allowed / "link"),
        str(sneaky),
        str(sibling),
    ]


def test_fetch_refuses_dirs_outside_the_allow_list(allowed: Path, tmp_path: Path):
    allowed.mkdir()
    outside = make_adapter_dir(tmp_path / "outside")
    dest = tmp_path / "dest"

    for uri in escape_routes(allowed, outside):
        with pytest.raises(NotFound, match="does not exist or is not an allowed import source") as err:
            fetch_source(uri, dest, allowed_dirs=[allowed], max_bytes=MiB)
        assert uri in str(err.value)
    assert_nothing_copied(dest)


@pytest.mark.parametrize("weights_name", ["adapter_model.bin", "adapter_model.pt"])
def test_fetch_refuses_pickle_weights_with_a_hint(allowed: Path, tmp_path: Path, weights_name: str):
    source = make_adapter_dir(allowed / "a1", weights_name=weights_name)

    with pytest.raises(InvalidArgument, match=rf"{weights_name}.*convert it to adapter_model\.safetensors"):
        fetch_source(str(source), tmp_path / "dest", allowed_dirs=[allowed], max_bytes=MiB)


def test_fetch_refuses_pickle_weights_from_s3(s3_endpoint: str, s3_bucket: str, tmp_path: Path):
    put_s3_adapter(s3_endpoint, s3_bucket, "a1", b"pickle", weights_name="adapter_model.bin")

    with pytest.raises(InvalidArgument, match="safetensors"):
        fetch_from_s3(f"s3://{s3_bucket}/a1", tmp_path / "dest", make_s3_client(s3_endpoint), MiB)


def test_fetch_missing_files_and_dirs(allowed: Path, tmp_path: Path):
    source = make_adapter_dir(allowed / "a1")
    (source / CONFIG_FILE).unlink()

    with pytest.raises(NotFound, match=CONFIG_FILE):
        fetch_source(str(source), tmp_path / "dest", allowed_dirs=[allowed], max_bytes=MiB)
    with pytest.raises(NotFound) as absent:
        fetch_source(str(allowed / "nope"), tmp_path / "dest", allowed_dirs=[allowed], max_bytes=MiB)
    outside = make_adapter_dir(tmp_path / "outside" / "nope")
    with pytest.raises(NotFound) as not_allowed:
        fetch_source(str(outside), tmp_path / "dest", allowed_dirs=[allowed], max_bytes=MiB)
    # one answer for "absent" and "not allowed": a refusal tells nothing about what exists
    assert str(absent.value).replace(str(allowed), "X") == str(not_allowed.value).replace(str(outside.parent), "X")


def test_s3_imports_only_under_allow_listed_prefixes(s3_endpoint: str, s3_bucket: str, tmp_path: Path):
    put_s3_adapter(s3_endpoint, s3_bucket, "team/a1", b"weights")
    put_s3_adapter(s3_endpoint, s3_bucket, "team-evil/a1", b"weights")
    client = make_s3_client(s3_endpoint)
    allowed_s3 = [f"s3://{s3_bucket}/team"]

    def fetch(uri: str, factory=lambda: client):
        return fetch_source(uri, tmp_path / "dest", allowed_dirs=[], max_bytes=MiB, s3_client_factory=factory, allowed_s3=allowed_s3)

    assert set(fetch(f"s3://{s3_bucket}/team/a1")) == {CONFIG_FILE, WEIGHTS_FILE}

    def never():
        raise AssertionError("a source outside the allow list must be refused before S3 is asked")

    texts = set()
    for uri in (f"s3://{s3_bucket}/team-evil/a1", f"s3://{s3_bucket}/team/../team-evil/a1", f"s3://other-{s3_bucket}/team/a1"):
        with pytest.raises(NotFound) as err:
            fetch(uri, never)
        texts.add(str(err.value).replace(uri, "URI"))
    allowed_s3.append("s3://no-such-bucket-here")
    with pytest.raises(NotFound) as err:  # allowed but absent: the same words
        fetch("s3://no-such-bucket-here/a1")
    texts.add(str(err.value).replace("s3://no-such-bucket-here/a1", "URI"))
    assert len(texts) == 1


@pytest.mark.parametrize(
    "uri",
    ["http://example.com/a", "relative/dir", "s3://bucket/a?endpoint_url=http://127.0.0.1:1", "s3://x/a"],
)
def test_fetch_refuses_bad_uris(uri: str, allowed: Path, tmp_path: Path):
    with pytest.raises(InvalidArgument) as err:
        fetch_source(uri, tmp_path / "dest", allowed_dirs=[allowed], max_bytes=MiB)
    assert repr(uri) in str(err.value)


def test_fetch_at_the_limit_passes_and_one_byte_over_fails(allowed: Path, tmp_path: Path):
    source = make_adapter_dir(allowed / "a1")
    total = len(CONFIG_BYTES) + 5000

    ok = tmp_path / "ok"
    files = fetch_source(str(source), ok, allowed_dirs=[allowed], max_bytes=total)
    assert files == {CONFIG_FILE: ok / CONFIG_FILE, WEIGHTS_FILE: ok / WEIGHTS_FILE}
    assert files[CONFIG_FILE].read_bytes() == CONFIG_BYTES and files[WEIGHTS_FILE].read_bytes() == b"W" * 5000
    with pytest.raises(ResourceExhausted, match=f"limit of {total - 1} bytes"):
        fetch_source(str(source), tmp_path / "over", allowed_dirs=[allowed], max_bytes=total - 1)
    assert_nothing_copied(tmp_path / "over")


def test_fetch_refuses_a_huge_file_without_reading_it(allowed: Path, tmp_path: Path):
    source = make_adapter_dir(allowed / "a1")
    with (source / WEIGHTS_FILE).open("r+b") as f:
        f.truncate(1 << 40)  # sparse: a terabyte that takes no disk and would take hours to read

    start = time.monotonic()
    with pytest.raises(ResourceExhausted, match=f"limit of {MiB} bytes"):
        fetch_source(str(source), tmp_path / "dest", allowed_dirs=[allowed], max_bytes=MiB)
    assert time.monotonic() - start < 5


class CountingBody:
    def __init__(self, body, counter: list[int]):
        self.body = body
        self.counter = counter

    def read(self, amt: int | None = None) -> bytes:
        data = self.body.read(amt)
        self.counter[0] += len(data)
        return data

    def close(self) -> None:
        self.body.close()


class GrowingSourceClient:
    """An S3 client whose weights object grows between the listing and the read."""

    def __init__(self, endpoint: str, big: bytes):
        self.client = make_s3_client(endpoint)
        self.big = big
        self.num_read = [0]

    def get_paginator(self, name: str):
        return self.client.get_paginator(name)

    def get_object(self, **kwargs):
        if kwargs["Key"].endswith(WEIGHTS_FILE):
            self.client.put_object(Bucket=kwargs["Bucket"], Key=kwargs["Key"], Body=self.big)
        return {"Body": CountingBody(self.client.get_object(**kwargs)["Body"], self.num_read)}


def test_fetch_stops_reading_at_the_limit_when_the_source_grows(
    s3_endpoint: str, s3_bucket: str, tmp_path: Path
):
    put_s3_adapter(s3_endpoint, s3_bucket, "a1", b"small")
    client = GrowingSourceClient(s3_endpoint, os.urandom(8 * MiB))
    max_bytes = 2 * MiB

    with pytest.raises(ResourceExhausted, match=f"limit of {max_bytes} bytes"):
        fetch_from_s3(f"s3://{s3_bucket}/a1", tmp_path / "dest", client, max_bytes)

    assert client.num_read[0] == max_bytes + 1
    assert_nothing_copied(tmp_path / "dest")
