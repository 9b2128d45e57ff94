"""Watch fan-out: one reader of the event log per process, and events of one replica reaching the
watchers of another replica on the same PostgreSQL database through LISTEN/NOTIFY."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import grpc
import pytest

from loramux.v1 import registry_pb2 as pb
from loramux.v1 import registry_pb2_grpc as pb_grpc
from tests.registry.backends import fresh_postgres_database
from tests.registry.harness import BACKENDS, registry_on_backend, running_registry

NUM_WATCHERS = 60


async def _open_watches(channel: grpc.aio.Channel, count: int) -> list:
    stub = pb_grpc.RegistryStub(channel)
    streams = [stub.WatchAdapters(pb.WatchAdaptersRequest(base_model="tiny")) for _ in range(count)]
    await asyncio.gather(*(s.initial_metadata() for s in streams))  # every watch is in place
    return streams


@pytest.mark.parametrize("backend", BACKENDS, indirect=False)
async def test_idle_watchers_share_one_reader(backend, tmp_path, tiny_llama_dir, make_adapter, request):
    request.param = backend  # registry_on_backend reads the backend from request.param
    # a poll far longer than the test: only this process's own commits wake the reader
    async with registry_on_backend(request, tmp_path / "d", tiny_llama_dir, watch_poll_s=3600) as registry:
        queries = _count_event_reads(registry.service.catalog)
        streams = await _open_watches(registry.channel, NUM_WATCHERS)
        await registry.register("fan", make_adapter("feed-fan", r=4, lora_alpha=8, seed=81))
        events = await asyncio.gather(*(asyncio.wait_for(anext(aiter(s)), 10) for s in streams))
        assert {(e.adapter.name, pb.AdapterEvent.Kind.Name(e.kind)) for e in events} == {("fan", "REGISTERED")}
        # 60 watchers opened and got the event from memory: the one reader read the table a few
        # times (the watches' wake-up, this process's commit, PostgreSQL's NOTIFY), not once per watcher
        assert 1 <= queries["events_after"] <= 6
        for s in streams:
            s.cancel()


def _count_event_reads(catalog) -> dict[str, int]:
    counts = {"events_after": 0}
    real = catalog.events_after

    def counted(*args, **kwargs):
        counts["events_after"] += 1
        return real(*args, **kwargs)

    catalog.events_after = counted
    return counts


async def test_a_replica_sees_events_of_another_through_notify(tmp_path, tiny_llama_dir, make_adapter):
    with fresh_postgres_database() as db_url:
        objects = str(tmp_path / "objects")
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(running_registry(tmp_path / "a", db_url, objects))
            # B never polls during the test: an event can reach its watchers only through NOTIFY
            b = await stack.enter_async_context(running_registry(tmp_path / "b", db_url, objects, watch_poll_s=3600))
            await a.register_base("tiny", tiny_llama_dir)
            streams = await _open_watches(b.channel, 5)
            first = await a.register("across", make_adapter("feed-across", r=4, lora_alpha=8, seed=82))
            await a.stub.SetPinned(pb.SetPinnedRequest(name="across", pinned=True))
            for stream in streams:
                got = [await asyncio.wait_for(anext(aiter(stream)), 10) for _ in range(2)]
                assert [pb.AdapterEvent.Kind.Name(e.kind) for e in got] == ["REGISTERED", "PINNED"]
                assert got[0].adapter.digest == first.digest
                stream.cancel()
            # and B serves what A committed, at once
            assert (await b.stub.GetAdapter(pb.GetAdapterRequest(name="across"))).pinned
