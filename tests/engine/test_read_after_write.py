"""Read-after-write (DESIGN section 12): a Generate that starts after RegisterAdapter, DeleteAdapter or
SetPinned returned sees the change, through another registry replica on the same PostgreSQL database,
with no waiting for watch events. Name lookups are coalesced: concurrent requests share one."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import grpc
import pytest

from engine.config import EngineConfig
from engine.server import start_engine
from loramux.v1 import engine_pb2_grpc as epb_grpc
from loramux.v1 import registry_pb2 as rpb
from tests.engine.test_registry_link import generate
from tests.registry.backends import fresh_postgres_database
from tests.registry.harness import running_registry

ROUNDS = 4


@pytest.fixture
async def two_replicas_and_an_engine(tmp_path, tiny_llama_dir):
    """(replica A, replica B, engine linked to B, engine stub); both replicas on one database and store."""
    with fresh_postgres_database() as db_url:
        objects = str(tmp_path / "objects")
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(running_registry(tmp_path / "a", db_url, objects))
            b = await stack.enter_async_context(running_registry(tmp_path / "b", db_url, objects))
            config = EngineConfig(
                model_dir=str(tiny_llama_dir), port=0, registry=b.server.address, max_loras_per_batch=2,
                base_model_name="tiny",
            )
            engine = await start_engine(config)
            stack.push_async_callback(engine.stop, 0.5)
            channel = grpc.aio.insecure_channel(engine.address)
            stack.push_async_callback(channel.close)
            yield a, b, engine, epb_grpc.EngineStub(channel)


async def test_changes_through_one_replica_reach_the_next_generate_through_the_other(
    two_replicas_and_an_engine, make_adapter
):
    a, _b, engine, stub = two_replicas_and_an_engine
    weights = [make_adapter(f"raw-{i}", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=90 + i) for i in range(3)]
    for round_ in range(ROUNDS):
        name = f"bot-{round_}"
        first = await a.register(name, weights[0])
        assert (await generate(stub, name))[2].adapter == f"{name}@1"
        second = await a.register(name, weights[1 + round_ % 2])  # re-registered with new weights
        assert second.version == 2 and second.digest != first.digest
        assert (await generate(stub, name))[2].adapter == f"{name}@2"
        await a.stub.DeleteAdapter(rpb.DeleteAdapterRequest(name=name, version=2))
        assert (await generate(stub, name))[2].adapter == f"{name}@1"  # "latest" is @1 again
        await _expect_not_found(stub, f"{name}@2")  # the deleted version is never served
        await a.stub.SetPinned(rpb.SetPinnedRequest(name=name, pinned=True))
        await generate(stub, name)
        assert _is_pinned(engine, first.digest)  # applied before that request was admitted
        await a.stub.SetPinned(rpb.SetPinnedRequest(name=name, pinned=False))
        await generate(stub, name)
        assert not _is_pinned(engine, first.digest)
        await a.stub.DeleteAdapter(rpb.DeleteAdapterRequest(name=name))
        await _expect_not_found(stub, name)


async def _expect_not_found(stub, adapter: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(stub, adapter)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()


def _is_pinned(engine, digest: str) -> bool:
    slots = engine.core.lora.slots
    slot = slots.slot_of(digest)
    return slot is not None and slots.slots[slot].is_pinned


async def test_concurrent_requests_for_one_name_share_one_lookup(two_replicas_and_an_engine, make_adapter):
    a, _b, engine, _stub = two_replicas_and_an_engine
    await a.register("shared", make_adapter("raw-shared", r=4, lora_alpha=8, seed=95))
    link = engine.core.link
    before = link.num_lookups
    records = await asyncio.gather(*(link.resolve("shared") for _ in range(20)))
    assert {r.ref for r in records} == {"shared@1"}
    assert link.num_lookups - before == 1
