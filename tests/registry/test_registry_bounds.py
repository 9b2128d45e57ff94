"""DESIGN section 6's bounds on every field that arrives: text without control characters and within
its length, integers range-checked before SQL, JSON without deep nesting, and error messages that
quote only a short prefix of what was sent. Each case checks the status and that nothing was stored."""

from __future__ import annotations

import base64
import json

import grpc
import pytest

from loraformat.errors import MAX_MESSAGE_CHARS
from loramux.v1 import registry_pb2 as pb
from registry.errors import InvalidArgument, quote
from registry.types import parse_ref
from tests.registry.harness import BACKENDS, registry_on_backend
from tests.registry.test_registry_bad_input import assert_nothing_stored

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(params=BACKENDS)
async def registry(request, tmp_path, tiny_llama_dir):
    async with registry_on_backend(request, tmp_path / "data", tiny_llama_dir) as h:
        yield h


@pytest.fixture(scope="module")
def adapter_dir(make_adapter):
    return make_adapter("bounds", r=4, lora_alpha=8, target_modules=["q_proj"])


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"description": "a\x00b"}, "description"),  # PostgreSQL refuses NUL in text
        ({"description": "bell\x07"}, "U+0007"),
        ({"description": "x" * 5000}, "description"),
        ({"labels": {"team": "a\x00"}}, "labels"),
        ({"labels": {"k\x1b[31m": "v"}}, "labels key"),
        ({"labels": {"k": "v" * 300}}, "labels"),
        ({"source_uri": "s3://bucket/\x00"}, "source_uri"),
    ],
)
async def test_bad_text_fields_are_refused_before_anything_is_written(registry, adapter_dir, fields, needle):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await registry.register("victim", adapter_dir, **fields)
    assert info.value.code() == INVALID, info.value.details()
    assert needle in info.value.details()
    await assert_nothing_stored(registry)


async def test_newline_and_tab_are_allowed_in_a_description(registry, adapter_dir):
    adapter = await registry.register("ok", adapter_dir, description="line one\n\tline two")
    assert adapter.description == "line one\n\tline two"


@pytest.mark.parametrize("version", [(1 << 31), (1 << 32) - 1])
async def test_versions_past_sql_integer_are_invalid_argument(registry, version):
    for call in (
        registry.stub.GetAdapter(pb.GetAdapterRequest(name="x", version=version)),
        registry.stub.DeleteAdapter(pb.DeleteAdapterRequest(name="x", version=version)),
        registry.stub.SetPinned(pb.SetPinnedRequest(name="x", version=version, pinned=True)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == INVALID and "version" in info.value.details()


async def test_after_event_id_past_bigint_is_invalid_argument(registry):
    stream = registry.stub.WatchAdapters(pb.WatchAdaptersRequest(after_event_id=(1 << 64) - 1))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stream.read()
    assert info.value.code() == INVALID and "after_event_id" in info.value.details()


def _token(payload: bytes) -> str:
    return base64.urlsafe_b64encode(payload).decode()


@pytest.mark.parametrize(
    "token",
    [
        _token(b"[" * 100_000 + b"]" * 100_000),  # RecursionError in json.loads
        _token(json.dumps(["x", 1 << 64]).encode()),  # past SQLite's integers
        _token(json.dumps(["x", {"a": [1]}]).encode()),
        "A" * 5000,
    ],
)
async def test_forged_page_tokens_are_invalid_argument(registry, token):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await registry.stub.ListAdapters(pb.ListAdaptersRequest(page_token=token))
    assert info.value.code() == INVALID and "page_token" in info.value.details()
    assert len(info.value.details()) < 200


async def test_errors_quote_only_a_prefix_of_a_huge_input(registry):
    huge = "z" * 200_000
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await registry.register_files("victim", {huge: b"x"})
    assert info.value.code() == INVALID
    assert "200000 characters" in info.value.details() and len(info.value.details()) < 300
    await assert_nothing_stored(registry)


def test_every_registry_error_message_is_capped():
    assert len(str(InvalidArgument("tensor " + "n" * 100_000))) <= MAX_MESSAGE_CHARS + 40
    assert quote("abc") == "'abc'" and quote("a" * 500).endswith("(500 characters)")


@pytest.mark.parametrize("ref", ["ad1@\u0661", "ad1@99999999999", "ad1@0", "ad1@+1", "ad1@ 1", "ad1@"])
def test_adapter_references_take_ascii_versions_in_range(ref):
    with pytest.raises(InvalidArgument) as info:
        parse_ref(ref)
    assert "version" in str(info.value)


def test_adapter_references_parse():
    assert parse_ref("ad1") == ("ad1", 0)
    assert parse_ref("ad1@2147483647") == ("ad1", 2147483647)
