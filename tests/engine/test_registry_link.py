"""The engine against a live registry (both in process): names resolve through the registry, artifacts
are fetched and sha256-checked, and registry events (new versions, deletes, pins) reach the engine."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
import threading
import time

import grpc
import pytest

from engine.artifact_stream import chunk_data
from engine.config import EngineConfig
from engine.errors import Unavailable
from engine.server import start_engine
from loramux.engine_client import generate_request
from loramux.v1 import engine_pb2 as epb
from loramux.v1 import engine_pb2_grpc as epb_grpc
from loramux.v1 import registry_pb2 as rpb
from registry.servicer import encode_data_chunk
from tests.engine.test_engine_grpc import collect
from tests.registry.harness import running_registry

PROMPT = "The registry feeds the engine"


@contextlib.asynccontextmanager
async def registry_and_engine(tmp_path, model_dir, **config):
    """(registry harness, engine server, engine stub); the base model is registered by the engine."""
    async with running_registry(tmp_path / "registry") as registry:
        engine = await start_engine(EngineConfig(
            model_dir=str(model_dir), port=0, registry=registry.server.address, max_loras_per_batch=2,
            base_model_name="tiny", **config,
        ))  # fmt: skip
        channel = grpc.aio.insecure_channel(engine.address)
        try:
            yield registry, engine, epb_grpc.EngineStub(channel)
        finally:
            await channel.close()
            await engine.stop(grace=0.5)


@pytest.fixture
async def stack(tmp_path, tiny_llama_dir):
    """An engine fetching through its fetch process (on Linux)."""
    async with registry_and_engine(tmp_path, tiny_llama_dir) as parts:
        assert (parts[1].core.link.process is not None) == sys.platform.startswith("linux")
        yield parts


@pytest.fixture
async def loop_stack(tmp_path, tiny_llama_dir):
    """An engine fetching on its event loop: the tests that change the messages it receives."""
    async with registry_and_engine(tmp_path, tiny_llama_dir, disable_fetch_process=True) as parts:
        assert parts[1].core.link.process is None
        yield parts


async def generate(stub, adapter: str = "", max_new_tokens: int = 8, **kwargs):
    request = generate_request(PROMPT, adapter=adapter, max_new_tokens=max_new_tokens, ignore_eos=True, **kwargs)
    return await collect(stub, request)


HANG_S = 120.0  # turns a hang into a failure; no assertion here is about speed


async def wait_for(predicate, timeout: float = HANG_S):
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_adapter_by_name_through_the_registry(stack, make_adapter, tmp_path, tiny_llama_dir):
    registry, engine, stub = stack
    models = await registry.stub.ListBaseModels(rpb.ListBaseModelsRequest())
    assert [m.name for m in models.base_models] == ["tiny"]  # registered by the engine at start
    qv = make_adapter("link-qv", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=51)
    await registry.register("bot", qv)
    ids, _, done = await generate(stub, "bot")
    assert done.adapter == "bot@1"
    # the same adapter served from a local dir gives the same tokens
    local = await start_engine(EngineConfig(model_dir=str(tiny_llama_dir), port=0, adapters=(("bot", str(qv)),), work_dir=str(tmp_path / "w")))
    try:
        async with grpc.aio.insecure_channel(local.address) as channel:
            local_ids, _, _ = await generate(epb_grpc.EngineStub(channel), "bot")
    finally:
        await local.stop(grace=0.5)
    assert ids == local_ids
    base_ids, _, _ = await generate(stub)
    assert ids != base_ids
    assert engine.core.link.num_fetches == 1
    await asyncio.gather(*(generate(stub, "bot") for _ in range(5)))
    assert engine.core.link.num_fetches == 1  # cached on the host
    (timing,) = engine.core.link.fetch_timings  # the one fetch, timed: asked, given a turn, checked
    assert timing.asked <= timing.started < timing.done and timing.size > 0


async def test_adapters_in_slots_are_not_fetched_again_past_the_host_cache_bound(tmp_path, tiny_llama_dir, make_adapter):
    """Two slots, a host cache of one: both adapters stay in their slots, so alternating between them
    fetches each once (a host copy is kept for every slot's adapter), not on every switch."""
    async with running_registry(tmp_path / "registry") as registry:
        config = EngineConfig(
            model_dir=str(tiny_llama_dir), port=0, registry=registry.server.address, max_loras_per_batch=2,
            max_host_adapters=1, base_model_name="tiny",
        )
        engine = await start_engine(config)  # registers the base model
        try:
            for name, seed in (("one", 56), ("two", 57)):
                await registry.register(name, make_adapter(f"link-{name}", r=4, lora_alpha=8, seed=seed))
            async with grpc.aio.insecure_channel(engine.address) as channel:
                stub = epb_grpc.EngineStub(channel)
                for name in ("one", "two", "one", "two", "one"):
                    await generate(stub, name)
            assert engine.core.link.num_fetches == 2
            cache = engine.core.lora.host_cache
            assert (cache.num_misses, cache.num_hits) == (2, 3)
        finally:
            await engine.stop(grace=0.5)


def hold_fetches(link) -> asyncio.Event:
    """Hold every registry fetch of `link` until the returned event is set."""
    release, real_fetch = asyncio.Event(), link._fetch_once

    async def held(record):
        await release.wait()
        return await real_fetch(record)

    link._fetch_once = held
    return release


async def test_many_requests_for_one_uncached_adapter_fetch_once(stack, make_adapter):
    """Eight requests look the adapter up while its one fetch is held in flight: the host cache counts one
    miss (the fetch) and seven joined lookups, in its counters and on /metrics; a later request hits."""
    registry, engine, stub = stack
    await registry.register("popular", make_adapter("link-pop", r=4, lora_alpha=8, seed=52))
    link = engine.core.link
    release = hold_fetches(link)
    calls = [asyncio.ensure_future(generate(stub, "popular")) for _ in range(8)]
    while engine.admission.num_fetching < 8:
        await asyncio.sleep(0.02)
    release.set()
    results = await asyncio.gather(*calls)
    assert len({tuple(ids) for ids, _, _ in results}) == 1
    assert engine.core.link.num_fetches == 1
    await generate(stub, "popular")
    cache = engine.core.lora.host_cache
    assert (cache.num_misses, cache.num_joined, cache.num_hits) == (1, 7, 1)
    sample = engine.metrics.registry.get_sample_value
    counted = [sample(f"loramux_engine_host_cache_{kind}_total") for kind in ("misses", "joined", "hits")]
    assert counted == [1, 7, 1]


async def test_new_version_is_used_and_never_the_old_kv_or_slot(stack, make_adapter):
    registry, engine, stub = stack
    v1 = await registry.register("bot", make_adapter("link-v1", r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj"], seed=53))
    ids1, _, done1 = await generate(stub, "bot")
    v2 = await registry.register("bot", make_adapter("link-v2", r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj"], seed=54))
    assert v2.version == 2 and v2.digest != v1.digest
    await wait_for(lambda: _resolves_to(engine, "bot", 2))
    ids2, _, done2 = await generate(stub, "bot")
    assert (done1.adapter, done2.adapter) == ("bot@1", "bot@2")
    assert done2.usage.cached_prompt_tokens == 0  # v1's prefix cache is not v2's
    assert ids2 != ids1
    old_ids, _, old = await generate(stub, "bot@1")
    assert old.adapter == "bot@1" and old_ids == ids1


async def _resolves_to(engine, name: str, version: int) -> bool:
    return (await engine.core.link.resolve(name)).version == version


async def test_delete_refuses_new_requests_and_frees_the_adapter(stack, make_adapter):
    registry, engine, stub = stack
    gone = await registry.register("gone", make_adapter("link-gone", r=4, lora_alpha=8, seed=55))
    running = asyncio.create_task(collect(stub, generate_request(PROMPT, adapter="gone", max_new_tokens=120, ignore_eos=True)))
    await wait_for(lambda: _has_running(engine))
    await registry.stub.DeleteAdapter(rpb.DeleteAdapterRequest(name="gone"))
    _ids, _, done = await running  # the running stream finishes
    assert done.usage.completion_tokens == 120
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(stub, "gone")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    await wait_for(lambda: _gone(stub))  # freed once its running request ended
    assert engine.core.lora.slots.slot_of(gone.digest) is None and gone.digest not in engine.core.lora.host_cache


async def _has_running(engine) -> bool:
    return bool(engine.core.loop.scheduler.running)


async def _gone(stub) -> bool:
    listed = await stub.ListAdapters(epb.ListLoadedRequest())
    return all(a.adapter != "gone@1" for a in listed.adapters)


async def test_pin_and_unpin_in_the_registry_reach_the_engine(stack, make_adapter):
    registry, _engine, stub = stack
    await registry.register("vip", make_adapter("link-vip", r=4, lora_alpha=8, seed=56))
    await registry.stub.SetPinned(rpb.SetPinnedRequest(name="vip", pinned=True))
    await wait_for(lambda: _pinned(stub, "vip@1", True))
    await registry.stub.SetPinned(rpb.SetPinnedRequest(name="vip", pinned=False))
    await wait_for(lambda: _pinned(stub, "vip@1", False))


async def _pinned(stub, ref: str, pinned: bool, by_digest: bool = False) -> bool:
    listed = await stub.ListAdapters(epb.ListLoadedRequest())
    return any(
        # pinned implies a held slot (in_slot; on_gpu only on a CUDA engine)
        (a.digest if by_digest else a.adapter) == ref and a.pinned == pinned and (a.in_slot or not pinned)
        for a in listed.adapters
    )


async def test_load_and_unload_rpcs(stack, make_adapter):
    registry, engine, stub = stack
    await registry.register("warm", make_adapter("link-warm", r=4, lora_alpha=8, seed=57))
    state = await stub.LoadAdapter(epb.LoadAdapterRequest(adapter="warm", pin=True))
    assert (state.adapter, state.in_host_cache, state.in_slot, state.pinned) == ("warm@1", True, True, True)
    assert engine.core.lora.slots.slot_of(state.digest) is not None
    state = await stub.UnloadAdapter(epb.UnloadAdapterRequest(adapter="warm"))
    assert (state.in_slot, state.in_host_cache, state.pinned) == (False, False, False)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.LoadAdapter(epb.LoadAdapterRequest(adapter="missing"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_digest_mismatch_is_refused_and_retried(loop_stack, make_adapter):
    registry, engine, stub = loop_stack
    await registry.register("tamper", make_adapter("link-tamper", r=4, lora_alpha=8, seed=58))
    link = engine.core.link
    real_messages = link._artifact_messages
    corrupt = {"left": 1}

    async def flaky(record):  # one bit of the last chunk's last byte (its message's last) flipped in transit
        messages = [raw async for raw in real_messages(record)]
        if corrupt["left"]:
            corrupt["left"] -= 1
            messages[-1] = messages[-1][:-1] + bytes([messages[-1][-1] ^ 1])
        for raw in messages:
            yield raw

    link._artifact_messages = flaky
    _, _, done = await generate(stub, "tamper")
    assert done.adapter == "tamper@1" and link.num_digest_mismatches == 1
    corrupt["left"] = 10
    await registry.register("tamper2", make_adapter("link-tamper2", r=4, lora_alpha=8, seed=59))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(stub, "tamper2")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "digest" in info.value.details()


async def test_a_stream_that_overruns_or_omits_its_declared_size(loop_stack, make_adapter):
    """The leading Adapter message sizes the artifact's memory: a registry sending more bytes than it
    declared is refused as malformed (nothing written past the end), one sending fewer fails the digest
    check, and a stream that declares no size (no Adapter message) still gives the exact bytes."""
    registry, engine, _ = loop_stack
    adapter = await registry.register("sized", make_adapter("link-sized", r=4, lora_alpha=8, seed=60))
    link = engine.core.link
    record = await link.resolve("sized")
    real_messages = link._artifact_messages
    expected = bytes(await link.fetch(record))
    assert len(expected) == adapter.size_bytes

    def serving(change):
        async def messages(record):
            for raw in change([raw async for raw in real_messages(record)]):
                yield raw

        link._artifact_messages = messages

    serving(lambda messages: [*messages, encode_data_chunk(adapter.size_bytes, b"x")])
    with pytest.raises(Unavailable, match=r"malformed chunk .*bytes of an artifact of"):
        await link._fetch_once(record)
    serving(lambda messages: messages[:-1])
    fetched = await link._fetch_once(record)
    data, digest = fetched.data, fetched.sha256
    assert digest != record.digest and bytes(data) == expected[: len(data)] and len(data) < len(expected)
    serving(lambda messages: messages[1:])  # no Adapter message: the bytes grow as they come
    fetched = await link._fetch_once(record)
    data, digest = fetched.data, fetched.sha256
    assert digest == record.digest and bytes(data) == expected
    assert not data.readonly  # the safetensors reader's views want a writable buffer
    # an Adapter message that does not decode, or declares more than the host can allocate
    serving(lambda messages: [b"\x0a\x02\x0a\xff", *messages[1:]])  # field 1 framed, its inside not
    with pytest.raises(Unavailable, match=r"malformed chunk \(an Adapter message that does not decode"):
        await link._fetch_once(record)
    huge = rpb.AdapterChunk(adapter=rpb.Adapter(size_bytes=2**62)).SerializeToString()
    serving(lambda messages: [huge, *messages[1:]])
    with pytest.raises(Unavailable, match=r"malformed chunk \(a declared size of 4611686018427387904 bytes"):
        await link._fetch_once(record)


async def test_a_failed_copy_of_the_last_chunk_fails_the_fetch(loop_stack, make_adapter, monkeypatch):
    """The worker thread's copy of each chunk, the last one too, is awaited: a copy that fails is the
    fetch's failure, not an artifact with an unwritten tail that hashed as whole."""
    registry, engine, _ = loop_stack
    await registry.register("tail", make_adapter("link-tail", r=4, lora_alpha=8, seed=61))
    link = engine.core.link
    record = await link.resolve("tail")
    num_chunks = sum(chunk_data(raw) is not None for raw in [raw async for raw in link._artifact_messages(record)])
    from engine.artifact_stream import Artifact

    real_take, taken = Artifact.take, []

    def take(self, offset, data):
        taken.append(offset)
        if len(taken) == num_chunks:
            self.sha.update(data)  # hashed, as a copy failing after the hash would leave it
            raise OSError("copy failed")
        real_take(self, offset, data)

    monkeypatch.setattr(Artifact, "take", take)
    with pytest.raises(OSError, match="copy failed"):
        await link._fetch_once(record)
    assert len(taken) == num_chunks


@pytest.mark.parametrize("offset, size", [(0, 0), (0, 5), (1 << 20, 1 << 20), (2**40, 300)])
def test_chunk_data_reads_what_the_registry_writes_without_a_copy(offset, size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    raw = encode_data_chunk(offset, data)
    view = chunk_data(raw)
    assert bytes(view) == data == rpb.AdapterChunk.FromString(raw).data.data
    assert size == 0 or view.obj is raw  # a view into the message, not a copy


def test_chunk_data_agrees_with_protobuf_on_what_a_serializer_may_write():
    """Fields in another order, unknown fields of the four wire types a serializer writes (field 1 with
    a varint among them), a repeated field (the last wins), the oneof's other item (None), and malformed
    messages (ValueError, where protobuf fails too)."""
    inner = b"\x12\x03abc" + b"\x08\x07" + b"\x18\x01" + b"\x21" + bytes(8) + b"\x2d" + bytes(4) + b"\x3a\x02zz"
    raw = b"\x12" + bytes([len(inner)]) + inner + b"\x50\x01" + b"\x08\x01"
    assert bytes(chunk_data(raw)) == rpb.AdapterChunk.FromString(raw).data.data == b"abc"
    twice = encode_data_chunk(0, b"first") + encode_data_chunk(3, b"second")
    assert bytes(chunk_data(twice)) == rpb.AdapterChunk.FromString(twice).data.data == b"second"
    adapter = rpb.AdapterChunk(adapter=rpb.Adapter(name="x")).SerializeToString()
    assert chunk_data(adapter) is None and chunk_data(encode_data_chunk(0, b"a") + adapter) is None
    assert bytes(chunk_data(rpb.AdapterChunk(data=rpb.DataChunk(offset=9)).SerializeToString())) == b""
    for bad in (encode_data_chunk(0, b"abcdef")[:-1], b"\x12\x80", b"\x13\x00", b"\x12" + b"\xff" * 11, b"\x02\x00"):
        with pytest.raises(ValueError):
            chunk_data(bad)
        with pytest.raises(Exception):  # noqa: B017 (protobuf's DecodeError)
            rpb.AdapterChunk.FromString(bad)


async def test_registry_down_then_back(tmp_path, tiny_llama_dir, make_adapter):
    data = tmp_path / "registry"
    async with running_registry(data) as registry:
        port = registry.server.port
        config = EngineConfig(model_dir=str(tiny_llama_dir), port=0, registry=f"127.0.0.1:{port}", base_model_name="tiny")
        engine = await start_engine(config)
        await registry.register("cached", make_adapter("link-cached", r=4, lora_alpha=8, seed=60))
        await registry.register("uncached", make_adapter("link-uncached", r=4, lora_alpha=8, seed=61))
    channel = grpc.aio.insecure_channel(engine.address)
    stub = epb_grpc.EngineStub(channel)
    try:
        # registry gone: the engine never saw "cached", so it cannot resolve either name now
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(stub, "uncached")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "registry" in info.value.details()
        async with running_registry(data, port=port) as registry:  # the same registry comes back
            # The link's state, not a time bound: reconnection backs off by design (RECONNECT_S).
            await wait_for(lambda: _connected(engine), timeout=HANG_S)
            ids, _, done = await generate(stub, "cached")
            assert done.adapter == "cached@1"
            await registry.register("after", make_adapter("link-after", r=4, lora_alpha=8, seed=62))
            _, _, after = await generate(stub, "after")
            assert after.adapter == "after@1"
        # down again: the adapter the engine has resolved and cached keeps working
        again, _, still = await generate(stub, "cached")
        assert again == ids and still.adapter == "cached@1"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(stub, "uncached")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await channel.close()
        await engine.stop(grace=0.5)


async def _connected(engine) -> bool:
    return engine.core.link.is_connected


@contextlib.asynccontextmanager
async def engine_with_adapters(tmp_path, model_dir, make_adapter, prefix: str, count: int, seed: int, **config):
    """A registry, an engine on it (EngineConfig fields in `config`) and then `count` rank-4 adapters
    registered as {prefix}0.. (seeds from `seed` on); yields (engine, its stub, the adapter names)."""
    async with running_registry(tmp_path / "registry") as registry:
        engine = await start_engine(EngineConfig(
            model_dir=str(model_dir), port=0, registry=registry.server.address, base_model_name="tiny", **config
        ))  # fmt: skip
        channel = grpc.aio.insecure_channel(engine.address)
        try:
            names = [f"{prefix}{i}" for i in range(count)]
            for i, name in enumerate(names):
                await registry.register(name, make_adapter(f"link-{prefix}{i}", r=4, lora_alpha=8, seed=seed + i))
            yield engine, epb_grpc.EngineStub(channel), names
        finally:
            await channel.close()
            await engine.stop(grace=0.5)


async def test_fetches_beyond_the_cap_wait_their_turn_in_order(tmp_path, tiny_llama_dir, make_adapter):
    """With --max-concurrent-fetches 2, requests for four uncached adapters start two fetches; each
    finished fetch lets the longest-waiting one start, and every request is served. The event loop's
    fetches (the fetch process keeps its own turns: tests/engine/test_fetch_process.py)."""
    async with engine_with_adapters(
        tmp_path, tiny_llama_dir, make_adapter, "turn", 4, 70, max_loras_per_batch=2, max_concurrent_fetches=2,
        disable_fetch_process=True,
    ) as (engine, stub, names):  # fmt: skip
        link = engine.core.link
        started, gates, real_messages = [], {name: asyncio.Event() for name in names}, link._artifact_messages

        async def gated(record):  # the stream of a fetch that has its turn
            started.append(record.name)
            await gates[record.name].wait()
            async for raw in real_messages(record):
                yield raw

        link._artifact_messages = gated
        calls = []
        for name in names:  # one at a time, so the order they asked in is known
            calls.append(asyncio.ensure_future(generate(stub, name)))
            await wait_for(functools.partial(_fetching, engine, len(calls)))
        await wait_for(lambda: _started(started, 2))
        await asyncio.sleep(0.2)  # time for a third fetch to start, were there no cap
        assert started == names[:2] and link.num_fetches_in_flight == 2
        gates["turn1"].set()
        await wait_for(lambda: _started(started, 3))
        assert started == names[:3] and link.num_fetches_in_flight == 2
        for gate in gates.values():
            gate.set()
        results = await asyncio.gather(*calls)
        assert [done.adapter for _, _, done in results] == [f"{name}@1" for name in names]
        assert started == names and link.num_fetches == 4 and link.num_fetches_in_flight == 0
        # two fetches had a turn at once (a free turn is taken without waiting); two waited through the pause
        waits = sorted(t.started - t.asked for t in link.fetch_timings)
        assert waits[1] < 0.1 and waits[2] >= 0.2, waits


@pytest.mark.parametrize("prep_threads", [1, 2])
async def test_fetched_adapters_pack_on_the_prep_threads_at_most_that_many_at_a_time(tmp_path, tiny_llama_dir, make_adapter, prep_threads):
    """Requests for three uncached adapters fetch them side by side (--max-concurrent-fetches 4), and
    each is checked and packed on one of --adapter-prep-threads threads, never more at a time, not on
    asyncio's default threads (whose many packers held the engine loop off the GIL), and all are served."""
    async with engine_with_adapters(tmp_path, tiny_llama_dir, make_adapter, "prep", 3, 90, max_loras_per_batch=3, adapter_prep_threads=prep_threads) as (engine, stub, names):
        core, changed = engine.core, threading.Condition()
        active, most, threads, real_pack, stuck = [0], [0], set(), core._pack, []

        def pack(record, artifact):
            with changed:
                active[0] += 1
                most[0] = max(most[0], active[0])
                threads.add(threading.current_thread().name)
                changed.notify_all()
                # hold until the threads allowed have all been packing at once (or a third one slipped
                # in), so the count does not depend on how the fetches happen to interleave. The wait
                # is for the high-water mark, not for `active`: a waiter woken when the last thread came
                # in may get the lock back only after the others have packed and left (a CI run on two
                # busy cores saw it, after 0.1 s sleeps); a wait that times out says where the other
                # loads were
                if not changed.wait_for(lambda: most[0] >= prep_threads, timeout=HANG_S / 4):
                    stuck.append({
                        "packing": active[0], "fetched": core.link.num_fetches, "fetches_in_flight": core.link.num_fetches_in_flight,
                        "loading": len(core._loading), "prep_threads_started": len(core._prep._threads),
                        "prep_queued": core._prep._work_queue.qsize(),
                    })  # fmt: skip
            time.sleep(0.1)  # time for a pack beyond the limit to start, were there no limit
            try:
                return real_pack(record, artifact)
            finally:
                with changed:
                    active[0] -= 1

        core._pack = pack
        results = await asyncio.gather(*(generate(stub, name) for name in names))
        assert not stuck, str(stuck)  # a str is printed whole, a list would be cut short
        assert [done.adapter for _, _, done in results] == [f"{name}@1" for name in names]
        assert most[0] == prep_threads and len(threads) == prep_threads
        assert all(name.startswith("adapter-prep") for name in threads), threads
        assert core.link.num_fetches == 3
        # each load's stages are timed (LoadTiming); packing held each thread for its 0.1 s sleep
        timings = list(core.load_timings)
        assert len(timings) == 3 and all(t.fetch > 0 and t.pack_wait >= 0 and t.pack >= 0.1 for t in timings), timings
        runs = core.metrics.registry.get_sample_value("loramux_engine_adapter_prep_seconds_count", {"stage": "run"})
        assert runs == 3 and core.metrics.registry.get_sample_value("loramux_engine_adapter_prep_seconds_sum", {"stage": "run"}) >= 0.3


async def _fetching(engine, n: int) -> bool:
    return engine.admission.num_fetching >= n


async def _started(started: list[str], n: int) -> bool:
    return len(started) >= n


async def test_a_slow_fetch_does_not_stall_other_streams(stack, make_adapter):
    registry, engine, stub = stack
    await registry.register("slow", make_adapter("link-slow", r=4, lora_alpha=8, seed=63))
    release = hold_fetches(engine.core.link)
    waiting = asyncio.create_task(generate(stub, "slow"))
    _ids, _, done = await generate(stub, max_new_tokens=24)  # the base model streams meanwhile
    assert done.usage.completion_tokens == 24 and not waiting.done()
    release.set()
    _, _, slow = await waiting
    assert slow.adapter == "slow@1"


async def test_pinned_at_registration_and_pins_learned_at_start(tmp_path, tiny_llama_dir, make_adapter):
    async with running_registry(tmp_path / "registry") as registry:
        await registry.register_base("tiny", tiny_llama_dir)
        await registry.register("early", make_adapter("link-early", r=4, lora_alpha=8, seed=64), pinned=True)
        config = EngineConfig(model_dir=str(tiny_llama_dir), port=0, registry=registry.server.address, base_model_name="tiny")
        engine = await start_engine(config)  # the engine learns pins made before it started
        channel = grpc.aio.insecure_channel(engine.address)
        stub = epb_grpc.EngineStub(channel)
        try:
            await wait_for(lambda: _pinned(stub, "early@1", True))
            await registry.register("late", make_adapter("link-late", r=4, lora_alpha=8, seed=65), pinned=True)
            await wait_for(lambda: _pinned(stub, "late@1", True))  # registered with pinned=True
        finally:
            await channel.close()
            await engine.stop(grace=0.5)


async def test_deleting_one_name_keeps_content_another_name_uses(stack, make_adapter):
    registry, engine, stub = stack
    shared = make_adapter("link-shared", r=4, lora_alpha=8, seed=66)
    a = await registry.register("alias-a", shared)
    await registry.register("alias-b", shared, pinned=True)
    await wait_for(lambda: _pinned(stub, a.digest, True, by_digest=True))
    await registry.stub.DeleteAdapter(rpb.DeleteAdapterRequest(name="alias-a"))
    last_event = registry.service.catalog.last_event_id()
    await wait_for(lambda: _seen_event(engine, last_event))  # the link has applied the delete
    _, _, done = await generate(stub, "alias-b")
    assert done.adapter == "alias-b@1"
    assert await _pinned(stub, a.digest, True, by_digest=True)
    assert engine.core.lora.slots.slot_of(a.digest) is not None


async def _seen_event(engine, event_id: int) -> bool:
    return engine.core.link.last_event_id >= event_id


async def test_a_base_model_name_taken_by_another_config_fails_the_start_at_once(tmp_path, tiny_llama_dir):
    """Not a silent retry loop: one error naming the model and what to do."""
    from engine.errors import FailedPrecondition
    from tests.registry.harness import config_json

    async with running_registry(tmp_path / "registry") as registry:
        other = config_json(tiny_llama_dir, num_hidden_layers=1)
        await registry.stub.RegisterBaseModel(rpb.BaseModel(name="tiny", config_json=other))
        config = EngineConfig(model_dir=str(tiny_llama_dir), port=0, registry=registry.server.address, base_model_name="tiny")
        with pytest.raises(FailedPrecondition) as info:  # the engine's own error, not the registry's
            await start_engine(config)
    assert "'tiny'" in str(info.value) and "--base-model-name" in str(info.value)


class ScriptedRegistry:
    """GetAdapter answers from `versions` (name -> live versions), or UNAVAILABLE while `down`."""

    def __init__(self, versions: dict[str, list[int]]):
        self.versions = versions
        self.down = False

    async def GetAdapter(self, request, timeout, metadata):  # the gRPC method's name
        if self.down:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down")
        live = self.versions.get(request.name, [])
        version = request.version or max(live, default=0)
        if version not in live:
            raise grpc.aio.AioRpcError(grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")
        return rpb.Adapter(name=request.name, version=version, digest=f"{request.name}{version}", base_model="tiny", rank=4)


@pytest.mark.parametrize("gone_ref, still_cached", [("bot", {}), ("bot@2", {"bot@1": 1}), ("bot@1", {"bot": 2, "bot@2": 2})])
async def test_not_found_drops_every_cached_key_of_what_is_gone(gone_ref, still_cached):
    """The fallback cache (answers while the registry is unreachable) keeps nothing the registry said
    is gone: NOT_FOUND for "name" drops every version, for "name@N" every key that resolved to N."""
    from engine.errors import NotFound, Unavailable
    from engine.registry_link import RegistryLink

    async def ignore(kind, record):
        pass

    link = RegistryLink("127.0.0.1:1", "tiny", "{}", ignore)
    registry = ScriptedRegistry({"bot": [1, 2]})
    link.stub = registry
    try:
        for ref in ("bot", "bot@1", "bot@2"):
            await link.resolve(ref)  # cached: (bot, 0) -> v2, (bot, 1), (bot, 2)
        registry.versions["bot"] = [] if gone_ref == "bot" else [v for v in (1, 2) if f"bot@{v}" != gone_ref]
        with pytest.raises(NotFound):
            await link.resolve(gone_ref)
        registry.down = True
        for ref in ("bot", "bot@1", "bot@2"):
            if ref in still_cached:
                assert (await link.resolve(ref)).version == still_cached[ref]  # served from the cache
            else:
                with pytest.raises(Unavailable):
                    await link.resolve(ref)
    finally:
        await link.close()
