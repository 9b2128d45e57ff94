"""DESIGN section 6's bounds on every field that arrives: text without control characters and within
its length, integers range-checked before SQL, JSON without deep nesting, and error messages that
quote only a short prefix of what was sent. Each case checks the status and that nothing was stored."""

from __future__ import annotations

import asyncio
import base64
import json

import grpc
import pytest

from loraformat.errors import MAX_MESSAGE_CHARS
from loraformat.names import parse_ref
from loramux.v1 import registry_pb2 as pb
from registry.errors import InvalidArgument, quote
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


# ---- JSON depth (adapter_config.json, safetensors header, config_json) ------------------------


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


async def test_deeply_nested_adapter_config_is_invalid_argument(registry, adapter_dir):
    weights = (adapter_dir / "adapter_model.safetensors").read_bytes()
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    raw = json.dumps(config)[:-1] + ', "extra": ' + _deep(100_000) + "}"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await registry.register_files("victim", {"adapter_config.json": raw.encode(), "adapter_model.safetensors": weights})
    assert info.value.code() == INVALID and "nested" in info.value.details()
    await assert_nothing_stored(registry)


async def test_deeply_nested_safetensors_header_is_invalid_argument(registry, adapter_dir):
    header = ('{"__metadata__": {"x": ' + _deep(100_000) + "}}").encode()
    weights = len(header).to_bytes(8, "little") + header
    config = (adapter_dir / "adapter_config.json").read_bytes()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await registry.register_files("victim", {"adapter_config.json": config, "adapter_model.safetensors": weights})
    assert info.value.code() == INVALID and "nested" in info.value.details()
    await assert_nothing_stored(registry)


async def test_deeply_nested_base_model_config_is_invalid_argument(registry, tiny_llama_dir):
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    raw = json.dumps(cfg)[:-1] + ', "extra": ' + _deep(100_000) + "}"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await registry.stub.RegisterBaseModel(pb.BaseModel(name="deep", config_json=raw))
    assert info.value.code() == INVALID and "nested" in info.value.details()


def test_json_depth_ignores_brackets_inside_strings():
    from loraformat.bounded_json import json_depth, loads

    assert json_depth('{"a": "[[[[[[", "b": [1, {"c": "]]\\"[["}]}') == 3
    assert loads('{"a": [1]}', "x") == {"a": [1]}
    with pytest.raises(InvalidArgument, match="nested 65 levels"):
        loads(_deep(65), "x")


# ---- base-model plausibility -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_hidden_layers", 200_000), ("hidden_size", 1 << 30), ("intermediate_size", 1 << 30),
     ("num_attention_heads", 1 << 20), ("vocab_size", 1 << 40), ("head_dim", 1 << 20)],
)
async def test_implausible_base_models_are_refused(registry, tiny_llama_dir, field, value):
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    cfg[field] = value
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await registry.stub.RegisterBaseModel(pb.BaseModel(name="huge", config_json=json.dumps(cfg)))
    assert info.value.code() == INVALID and field in info.value.details()
    listed = await registry.stub.ListBaseModels(pb.ListBaseModelsRequest())
    assert [m.name for m in listed.base_models] == ["tiny"]


def test_the_largest_real_configs_stay_within_the_bounds():
    from loraformat.model_shapes import ModelShape

    llama_405b = {  # Llama 3.1 405B
        "model_type": "llama", "num_hidden_layers": 126, "hidden_size": 16384, "intermediate_size": 53248,
        "num_attention_heads": 128, "num_key_value_heads": 8, "vocab_size": 128256,
    }
    assert ModelShape.from_config(llama_405b).num_layers == 126


# ---- PEFT regex keys: RE2, nothing slow -------------------------------------------------------

# Each +1 on the bound doubles a backtracking engine's work: 2**40 steps never finish.
EXPONENTIAL = "(?:.|.){0,40}Z"


@pytest.mark.parametrize(
    "field", ["rank_pattern", "alpha_pattern", "target_modules", "exclude_modules", "layers_pattern"]
)
async def test_exponential_peft_patterns_are_matched_in_linear_time(registry, adapter_dir, field):
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    value = {
        "rank_pattern": {EXPONENTIAL: 4},
        "alpha_pattern": {EXPONENTIAL: 8.0},
        "target_modules": r"model\.layers\.\d+\.self_attn\.q_proj|" + EXPONENTIAL,
        "exclude_modules": EXPONENTIAL,
        "layers_pattern": ["layers|" + EXPONENTIAL],
    }[field]
    config[field] = value
    if field == "layers_pattern":
        config["layers_to_transform"] = list(range(16))  # every layer: the pattern is still evaluated
    files = {
        "adapter_config.json": json.dumps(config).encode(),
        "adapter_model.safetensors": (adapter_dir / "adapter_model.safetensors").read_bytes(),
    }
    try:
        adapter = await registry.register_files("patterned", files)
    except grpc.aio.AioRpcError as err:  # refused is fine too, as long as it is quick and names the field
        assert err.code() in (INVALID, grpc.StatusCode.FAILED_PRECONDITION) and field in err.details()
    else:
        assert adapter.rank == 4


@pytest.mark.parametrize("pattern", [r"(q)_proj\1", r"q_proj(?=x)", r"(?<!k)q_proj"])
async def test_patterns_that_need_backtracking_are_refused(registry, adapter_dir, pattern):
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    config["rank_pattern"] = {pattern: 4}
    files = {
        "adapter_config.json": json.dumps(config).encode(),
        "adapter_model.safetensors": (adapter_dir / "adapter_model.safetensors").read_bytes(),
    }
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await registry.register_files("victim", files)
    assert info.value.code() == INVALID and "rank_pattern" in info.value.details()
    await assert_nothing_stored(registry)


async def test_reads_and_health_answer_while_a_registration_is_in_progress(registry, adapter_dir, monkeypatch):
    """The event loop stays free while a registration compiles: held mid-compile, other RPCs answer."""
    import threading

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    import registry.service as service_module

    entered, release = threading.Event(), threading.Event()
    real_compile = service_module.compile_adapter

    def held_compile(*args, **kwargs):
        entered.set()
        release.wait(60)
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(service_module, "compile_adapter", held_compile)
    registering = asyncio.ensure_future(registry.register("held", adapter_dir))
    try:
        assert await asyncio.to_thread(entered.wait, 30)
        listed = await registry.stub.ListAdapters(pb.ListAdaptersRequest())
        health = health_pb2_grpc.HealthStub(registry.channel)
        status = await health.Check(health_pb2.HealthCheckRequest(service="loramux.v1.Registry"))
        assert list(listed.adapters) == [] and status.status == health_pb2.HealthCheckResponse.SERVING
        assert not registering.done()
    finally:
        release.set()
    assert (await registering).version == 1


async def test_a_huge_tensor_name_is_quoted_short(registry, adapter_dir):
    """A 200k-character tensor name became a 'metadata size exceeds hard limit' error in gRPC."""
    name = "t" * 200_000
    header = json.dumps({name: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    weights = len(header).to_bytes(8, "little") + header + bytes(4)
    config = (adapter_dir / "adapter_config.json").read_bytes()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await registry.register_files("victim", {"adapter_config.json": config, "adapter_model.safetensors": weights})
    assert info.value.code() == INVALID, info.value.details()
    assert "200000 characters" in info.value.details() and len(info.value.details()) < 300
    await assert_nothing_stored(registry)
