"""The engine's bounds on what a client sends: stop token ids counted like stop strings, requests
waiting for an adapter fetch counted in the queue limit, adapter references with ASCII versions in
range, and request bytes that do not parse answered INVALID_ARGUMENT (not UNKNOWN)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine.config import EngineConfig
from engine.sampling import MAX_STOP_TOKEN_IDS
from engine.server import start_engine
from loramux.engine_client import generate_request
from loramux.v1 import engine_pb2 as pb
from loramux.v1 import engine_pb2_grpc as pb_grpc
from loramux.v1 import registry_pb2 as rpb
from tests.engine.test_engine_grpc import collect
from tests.engine.test_registry_link import hold_fetches
from tests.registry.harness import running_registry

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
async def engine(tiny_llama_dir):
    server = await start_engine(EngineConfig(model_dir=str(tiny_llama_dir), port=0))
    channel = grpc.aio.insecure_channel(server.address)
    try:
        yield server, pb_grpc.EngineStub(channel), channel
    finally:
        await channel.close()
        await server.stop(grace=0.5)


async def test_stop_token_ids_are_bounded_like_stop_strings(engine):
    _, stub, _ = engine
    too_many = generate_request("Hi", max_new_tokens=2, stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, too_many)
    assert info.value.code() == INVALID and "stop_token_ids" in info.value.details()
    ok = generate_request("Hi", max_new_tokens=2, stop_token_ids=[1] * MAX_STOP_TOKEN_IDS)
    assert (await collect(stub, ok))[2].usage.completion_tokens <= 2


@pytest.mark.parametrize("ref", ["ad1@99999999999", "ad1@\u0661", "ad1@0"])
async def test_adapter_references_are_invalid_argument(engine, ref):
    _, stub, _ = engine
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, generate_request("Hi", adapter=ref, max_new_tokens=2))
    assert info.value.code() == INVALID and "version" in info.value.details()
    assert "Traceback" not in info.value.details()


async def test_request_bytes_that_do_not_parse_are_invalid_argument(engine):
    _, _, channel = engine
    for method, call in (
        ("/loramux.v1.Engine/Generate", channel.unary_stream),
        ("/loramux.v1.Engine/ListAdapters", channel.unary_unary),
    ):
        raw = call(method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            result = raw(b"\xff\xff\xff\xff")
            if hasattr(result, "__aiter__"):
                async for _ in result:
                    pass
            else:
                await result
        assert info.value.code() == INVALID, (method, info.value.details())
        assert "not a valid protobuf message" in info.value.details()


async def test_malformed_registry_requests_are_invalid_argument(tmp_path):
    async with running_registry(tmp_path / "registry") as registry:
        raw = registry.channel.unary_unary("/loramux.v1.Registry/GetAdapter", request_serializer=None)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw(b"\xff\xff\xff\xff")
        assert info.value.code() == INVALID

        async def stream():
            yield rpb.RegisterAdapterRequest(spec=rpb.AdapterSpec(name="x")).SerializeToString()
            yield b"\xff\xff\xff\xff"

        upload = registry.channel.stream_unary("/loramux.v1.Registry/RegisterAdapter", request_serializer=None)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await upload(stream())
        assert info.value.code() == INVALID and "not a valid protobuf message" in info.value.details()


async def test_requests_waiting_for_an_adapter_fetch_count_in_the_queue_limit(tmp_path, tiny_llama_dir, make_adapter):
    async with running_registry(tmp_path / "registry") as registry:
        config = EngineConfig(
            model_dir=str(tiny_llama_dir), port=0, registry=registry.server.address, base_model_name="tiny",
            max_queued_requests=3,
        )
        server = await start_engine(config)
        channel = grpc.aio.insecure_channel(server.address)
        try:
            await registry.register("slow", make_adapter("bounds-slow", r=4, lora_alpha=8, seed=71))
            release = hold_fetches(server.core.link)
            stub = pb_grpc.EngineStub(channel)
            calls = [asyncio.ensure_future(collect(stub, generate_request("Hi", adapter="slow", max_new_tokens=2)))
                     for _ in range(8)]
            while server.admission.num_fetching + sum(c.done() for c in calls) < 8:
                await asyncio.sleep(0.02)
            refused = [c for c in calls if c.done()]
            assert len(refused) == 5 and server.admission.num_fetching == 3
            for call in refused:
                assert call.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            release.set()
            for call in calls:
                if call not in refused:
                    assert (await call)[2].adapter == "slow@1"
        finally:
            await channel.close()
            await server.stop(grace=0.5)


async def test_a_cpu_engine_has_nothing_on_a_gpu(tiny_llama_dir, make_adapter):
    adapter = make_adapter("bounds-cpu", r=4, lora_alpha=8, seed=72)
    server = await start_engine(EngineConfig(model_dir=str(tiny_llama_dir), port=0, adapters=(("local", str(adapter)),)))
    channel = grpc.aio.insecure_channel(server.address)
    try:
        stub = pb_grpc.EngineStub(channel)
        await collect(stub, generate_request("Hi", adapter="local", max_new_tokens=2))
        states = (await stub.ListAdapters(pb.ListLoadedRequest())).adapters
        assert states and all(s.in_slot and not s.on_gpu for s in states)
    finally:
        await channel.close()
        await server.stop(grace=0.5)
