"""Every bad input of DESIGN section 6 over gRPC: the status code, a message naming the offender,
and nothing stored (no row, no blob, no spool file left behind)."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Callable

import grpc
import pytest
import torch
from safetensors.torch import load_file, save

from loramux.v1 import registry_pb2 as pb
from tests.registry.harness import BACKENDS, registry_on_backend

CFG = "adapter_config.json"
WTS = "adapter_model.safetensors"
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
PREFIX = "base_model.model.model.layers"


@pytest.fixture(params=BACKENDS)
async def registry(request, tmp_path, tiny_llama_dir):
    async with registry_on_backend(
        request, tmp_path / "data", tiny_llama_dir, max_lora_rank=16, max_upload_bytes=8 << 20
    ) as h:
        yield h


@pytest.fixture(scope="module")
def good(make_adapter) -> tuple[dict, dict[str, torch.Tensor]]:
    adapter_dir = make_adapter(
        "bad-input-base", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]
    )
    config = json.loads((adapter_dir / CFG).read_text())
    return config, load_file(str(adapter_dir / WTS))


def files(
    config: dict | bytes, weights: dict[str, torch.Tensor] | bytes, weights_name: str = WTS
) -> dict[str, bytes]:
    raw_config = config if isinstance(config, bytes) else json.dumps(config).encode()
    raw_weights = weights if isinstance(weights, bytes) else save(weights)
    return {CFG: raw_config, weights_name: raw_weights}


def with_config(**changes) -> Callable:
    return lambda config, weights: files({**config, **changes}, weights)


def with_tensors(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable:
    def make(config, weights):
        weights = dict(weights)
        edit(weights)
        return files(config, weights)

    return make


def first_key(weights, part: str) -> str:
    return sorted(k for k in weights if part in k)[0]


def poison(value: float) -> Callable:
    def edit(weights):
        key = first_key(weights, "lora_B")
        weights[key] = weights[key].clone()
        weights[key][0, 0] = value

    return edit


def header_claims_more(config, weights):
    raw = bytearray(save(weights))
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    name = sorted(k for k in header if k != "__metadata__")[-1]
    header[name]["data_offsets"][1] += 4096
    new_header = json.dumps(header).encode()
    return files(config, struct.pack("<Q", len(new_header)) + new_header + raw[8 + header_len :])


def many_tiny_tensors(config, weights):
    tiny = {f"t{i}": torch.zeros(1) for i in range(100_000)}  # short names: the header stays under the upload limit
    return files(config, tiny)


CASES = {
    "pickle weights": (
        lambda c, w: files(c, b"\x80\x04\x95pickle", "adapter_model.bin"),
        INVALID,
        "adapter_model.bin",
    ),
    "truncated safetensors": (lambda c, w: files(c, save(w)[:-100]), INVALID, WTS),
    "corrupt safetensors": (
        lambda c, w: files(c, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all"),
        INVALID,
        WTS,
    ),
    "header claims more bytes": (header_claims_more, INVALID, WTS),
    "100k tiny tensors": (many_tiny_tensors, INVALID, "tensors"),
    "unmappable tensor name": (
        with_tensors(lambda w: w.update({"base_model.model.foo.lora_A.weight": torch.ones(8, 64)})),
        INVALID,
        "foo",
    ),
    "lora_A without lora_B": (
        with_tensors(lambda w: w.pop(first_key(w, "q_proj.lora_B"))),
        INVALID,
        "q_proj",
    ),
    "shape disagrees with base": (
        with_tensors(lambda w: w.update({first_key(w, "q_proj.lora_A"): torch.ones(8, 65)})),
        PRECONDITION,
        "q_proj",
    ),
    "shape disagrees with rank": (
        with_tensors(lambda w: w.update({first_key(w, "v_proj.lora_B"): torch.ones(32, 4)})),
        PRECONDITION,
        "v_proj",
    ),
    "layer past the model": (
        with_tensors(
            lambda w: w.update(
                {
                    f"{PREFIX}.7.self_attn.q_proj.lora_A.weight": torch.ones(8, 64),
                    f"{PREFIX}.7.self_attn.q_proj.lora_B.weight": torch.ones(64, 8),
                }
            )
        ),
        PRECONDITION,
        "7",
    ),
    "NaN": (with_tensors(poison(float("nan"))), INVALID, "lora_B"),
    "Inf": (with_tensors(poison(float("inf"))), INVALID, "lora_B"),
    "int8 weights": (
        with_tensors(lambda w: w.update({k: v.to(torch.int8) for k, v in w.items()})),
        INVALID,
        "I8",
    ),
    "use_dora": (with_config(use_dora=True), PRECONDITION, "use_dora"),
    "bias all": (with_config(bias="all"), PRECONDITION, "bias"),
    "modules_to_save": (with_config(modules_to_save=["lm_head"]), PRECONDITION, "modules_to_save"),
    "init pissa": (with_config(init_lora_weights="pissa"), PRECONDITION, "init_lora_weights"),
    "unsupported target": (with_config(target_modules=["q_proj", "lm_head"]), PRECONDITION, "lm_head"),
    "rank over max": (with_config(r=32, lora_alpha=64), PRECONDITION, "rank"),
    "config not JSON": (lambda c, w: files(b"{'r': 8,", w), INVALID, CFG),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_bad_adapter_is_refused_and_nothing_is_stored(registry, good, case):
    make, code, needle = CASES[case]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await registry.register_files("victim", make(*good))
    assert info.value.code() == code, info.value.details()
    assert needle in info.value.details(), info.value.details()
    await assert_nothing_stored(registry)


async def test_rank_over_max_from_real_peft_adapter(registry, make_adapter):
    too_big = make_adapter("rank-32", r=32, lora_alpha=32)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await registry.register("big", too_big)
    assert info.value.code() == PRECONDITION and "16" in info.value.details()
    await assert_nothing_stored(registry)


@pytest.mark.parametrize("name", ["../x", "A B", "a" * 200, "", "-lead", "Upper"])
async def test_bad_names_are_refused(registry, good, name):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await registry.register_files(name, files(*good))
    assert info.value.code() == INVALID and "name" in info.value.details()
    await assert_nothing_stored(registry)


async def test_unknown_base_model(registry, good):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await registry.register_files("x", files(*good), base_model="llama-9000")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "llama-9000" in info.value.details()
    await assert_nothing_stored(registry)


async def test_upload_over_the_limit_stops_reading(registry, good):
    pulled = 0

    async def requests():
        nonlocal pulled
        yield pb.RegisterAdapterRequest(spec=pb.AdapterSpec(name="huge"))
        yield pb.RegisterAdapterRequest(
            chunk=pb.FileChunk(filename=CFG, offset=0, data=json.dumps(good[0]).encode())
        )
        for i in range(64):  # 64 MiB offered against an 8 MiB limit
            pulled += 1
            chunk = pb.FileChunk(filename=WTS, offset=i << 20, data=bytes(1 << 20))
            yield pb.RegisterAdapterRequest(chunk=chunk)

    def refused() -> float:
        labels = {"method": "RegisterAdapter", "code": "RESOURCE_EXHAUSTED"}
        return registry.server.metrics.registry.get_sample_value("loramux_registry_rpcs_total", labels) or 0.0

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await registry.stub.RegisterAdapter(requests())
    for _ in range(100):  # the registry's own count of its answer (the RPC ends there before it counts)
        if refused():
            break
        await asyncio.sleep(0.05)
    assert refused() == 1
    error = info.value
    # The client sees that answer, except when its own send of a further chunk fails first: grpc's aio
    # client then ends the call with INTERNAL "Failed execute_batch" (seen once, on a loaded 2-core VM).
    client_race = error.code() == grpc.StatusCode.INTERNAL and "execute_batch" in error.debug_error_string()
    assert client_race or (error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit" in error.details())
    assert pulled < 40, f"the client was allowed to send {pulled} MiB"
    await assert_nothing_stored(registry)


@pytest.mark.parametrize(
    ("requests", "needle"),
    [
        ([pb.RegisterAdapterRequest(chunk=pb.FileChunk(filename=CFG, data=b"{}"))], "first"),
        (
            [
                pb.RegisterAdapterRequest(spec=pb.AdapterSpec(name="x")),
                pb.RegisterAdapterRequest(chunk=pb.FileChunk(filename=CFG, offset=5, data=b"{}")),
            ],
            "offset",
        ),
        (
            [
                pb.RegisterAdapterRequest(spec=pb.AdapterSpec(name="x")),
                pb.RegisterAdapterRequest(chunk=pb.FileChunk(filename="evil.sh", data=b"x")),
            ],
            "evil.sh",
        ),
        (
            [
                pb.RegisterAdapterRequest(spec=pb.AdapterSpec(name="x")),
                pb.RegisterAdapterRequest(chunk=pb.FileChunk(filename=CFG, data=b"{}")),
            ],
            WTS,
        ),
    ],
)
async def test_malformed_upload_streams(registry, requests, needle):
    async def stream():
        for r in requests:
            yield r

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await registry.stub.RegisterAdapter(stream())
    assert info.value.code() == INVALID and needle in info.value.details(), info.value.details()
    await assert_nothing_stored(registry)


async def assert_nothing_stored(registry) -> None:
    assert await registry.list_all() == []
    assert registry.stored_blobs() == []
    assert registry.service.spool.entries() == []
