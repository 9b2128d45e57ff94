"""Engine.Generate over gRPC in process: streaming, status codes, cancellation, concurrency."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading

import grpc
import pytest

from engine.config import EngineConfig
from engine.server import start_engine
from loramux.engine_client import generate_request
from loramux.v1 import engine_pb2 as pb
from loramux.v1 import engine_pb2_grpc as pb_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
async def engine(tiny_llama_dir):
    config = EngineConfig(model_dir=str(tiny_llama_dir), port=0, max_running_requests=32, max_batch_tokens=256)
    server = await start_engine(config)
    channel = grpc.aio.insecure_channel(server.address)
    try:
        yield server, pb_grpc.EngineStub(channel)
    finally:
        await channel.close()
        await server.stop(grace=0.5)


async def collect(stub, request, timeout: float = 120) -> tuple[list[int], str, pb.GenerateComplete]:
    ids, text, completes = [], "", []
    async for response in stub.Generate(request, timeout=timeout):
        if response.WhichOneof("event") == "chunk":
            ids += response.chunk.token_ids
            text += response.chunk.text
        else:
            completes.append(response.complete)
    assert len(completes) == 1
    return ids, text, completes[0]


async def test_the_startup_heap_is_out_of_garbage_collection_while_serving(tiny_llama_dir):
    """A started engine has frozen what startup left (a full collection then scans only what serving
    makes, and stops no step for long); freezing is process-wide, so the objects go back to the
    collector when the last engine of the process stops, not the first."""
    first = await start_engine(EngineConfig(model_dir=str(tiny_llama_dir), port=0))
    try:
        assert gc.get_freeze_count() > 10_000  # modules, the model, the tokenizer: far more than serving holds
        second = await start_engine(EngineConfig(model_dir=str(tiny_llama_dir), port=0))
    finally:
        await first.stop(grace=0.5)
    try:
        assert gc.get_freeze_count() > 10_000
    finally:
        await second.stop(grace=0.5)
    assert gc.get_freeze_count() == 0


async def test_stream_of_deltas_then_one_complete(engine):
    server, stub = engine
    chunks = []
    async for response in stub.Generate(generate_request("Hello there", max_new_tokens=6, ignore_eos=True)):
        chunks.append(response)
    assert [c.WhichOneof("event") for c in chunks] == ["chunk"] * 6 + ["complete"]
    complete = chunks[-1].complete
    assert complete.finish_reason == pb.FINISH_REASON_LENGTH and complete.adapter == ""
    prompt_len = len(server.core.tokenizer.encode("Hello there"))
    assert (complete.usage.prompt_tokens, complete.usage.completion_tokens) == (prompt_len, 6)
    ids = [t for c in chunks[:-1] for t in c.chunk.token_ids]
    assert "".join(c.chunk.text for c in chunks[:-1]) == server.core.tokenizer.decode(ids)


async def test_repeated_prompt_reports_cached_tokens(engine):
    _, stub = engine
    prompt = "The registry compiles every adapter into one canonical artifact"
    first_ids, _, first = await collect(stub, generate_request(prompt, max_new_tokens=4, ignore_eos=True))
    again_ids, _, again = await collect(stub, generate_request(prompt, max_new_tokens=4, ignore_eos=True))
    assert first.usage.cached_prompt_tokens <= 1  # only the BOS, cached by the warm-up
    assert again.usage.cached_prompt_tokens == again.usage.prompt_tokens - 1
    assert again_ids == first_ids


async def test_hundred_concurrent_streams_all_complete_with_their_tokens(engine):
    _, stub = engine
    prompts = [f"request number {i} says" for i in range(10)]
    alone = [await collect(stub, generate_request(p, max_new_tokens=5, ignore_eos=True)) for p in prompts]
    requests = [generate_request(prompts[i % 10], max_new_tokens=5, ignore_eos=True) for i in range(100)]
    results = await asyncio.gather(*(collect(stub, r) for r in requests))
    for i, (ids, _, complete) in enumerate(results):
        assert ids == alone[i % 10][0]
        assert complete.usage.completion_tokens == 5


async def test_seeded_sampling_is_reproducible(engine):
    _, stub = engine
    request = generate_request("Sampling with a seed", max_new_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    first, _, _ = await collect(stub, request)
    others = [generate_request(f"noise {i}", max_new_tokens=8, temperature=1.0, ignore_eos=True) for i in range(4)]
    together = await asyncio.gather(collect(stub, request), *(collect(stub, r) for r in others))
    assert together[0][0] == first


@contextlib.asynccontextmanager
async def frozen_loop(core):
    """Holds the engine's loop thread inside a call until the block ends: no step runs meanwhile, so what
    the test does in between cannot race with generation."""
    entered, gate = threading.Event(), threading.Event()

    def hold():
        entered.set()
        gate.wait()

    core.loop.call(hold)
    await asyncio.to_thread(entered.wait)
    try:
        yield
    finally:
        gate.set()


async def until(predicate, what: str, limit_s: float = 30.0) -> None:
    """Waits for an explicit state; the limit only turns a hang into a failure."""
    for _ in range(int(limit_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_cancel_mid_stream_frees_the_kv(engine):
    """Guards: gRPC cancellation reaching the engine. The loop is frozen while the client cancels, so the
    request (450 tokens asked) can only end by that cancellation: at once, with no token more."""
    server, stub = engine
    loop = server.core.loop
    allocator = loop.scheduler.kv.allocator
    call = stub.Generate(generate_request("cancel me " * 5, max_new_tokens=450, ignore_eos=True))
    async for _ in call:
        break
    async with frozen_loop(server.core):
        (req,) = loop.scheduler.running
        num_generated = len(req.output_ids)
        assert allocator.num_used_pages > 0 and num_generated < 450
        call.cancel()
        await until(lambda: req.is_cancelled, "the cancellation reached the request", limit_s=10)
    await until(lambda: req.is_finished, "the cancelled request ended")
    assert len(req.output_ids) == num_generated
    await until(lambda: loop.num_active == 0, "the loop counts no active request")
    assert not loop.scheduler.running and req.req_row == -1 and not req.kv_slots
    radix = loop.scheduler.kv.radix
    assert radix.protected_size() == 0
    assert allocator.num_used_pages == radix.total_size()  # only unlocked cache entries remain


async def test_deadline_exceeded_frees_the_request(engine):
    """The loop is frozen until the client's deadline has passed, so the request cannot finish first."""
    server, stub = engine
    loop = server.core.loop
    async with frozen_loop(server.core):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub, generate_request("slow " * 10, max_new_tokens=450, ignore_eos=True), timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert loop.num_active == 1
    await until(lambda: loop.num_active == 0, "the expired request ended")
    assert not loop.scheduler.running and not loop.scheduler.waiting
    assert loop.scheduler.kv.radix.protected_size() == 0


BAD_REQUESTS = {
    "empty text": (generate_request("", max_new_tokens=4), INVALID, "empty"),
    "no prompt": (pb.GenerateRequest(sampling=pb.SamplingParams(max_new_tokens=4)), INVALID, "prompt"),
    "empty token ids": (generate_request([], max_new_tokens=4), INVALID, "prompt"),
    "too long for the context": (generate_request([5] * 600, max_new_tokens=4), INVALID, "context"),
    "max_new_tokens 0": (generate_request("hi", max_new_tokens=0), INVALID, "max_new_tokens"),
    "max_new_tokens negative": (generate_request("hi", max_new_tokens=-3), INVALID, "max_new_tokens"),
    "temperature negative": (generate_request("hi", max_new_tokens=4, temperature=-0.5), INVALID, "temperature"),
    "top_p over 1": (generate_request("hi", max_new_tokens=4, top_p=1.5), INVALID, "top_p"),
    "top_p negative": (generate_request("hi", max_new_tokens=4, top_p=-0.1), INVALID, "top_p"),
    "top_k negative": (generate_request("hi", max_new_tokens=4, top_k=-1), INVALID, "top_k"),
    "token outside the vocabulary": (generate_request([1, 2, 99999], max_new_tokens=4), INVALID, "99999"),
    "unknown adapter": (generate_request("hi", adapter="nope", max_new_tokens=4), grpc.StatusCode.NOT_FOUND, "nope"),
    "malformed adapter": (generate_request("hi", adapter="Bad Name@x", max_new_tokens=4), INVALID, "adapter"),
    "10 MB of text": (generate_request("x" * (10 << 20), max_new_tokens=4), INVALID, "bytes"),
}


async def test_bad_requests_fail_without_disturbing_a_running_stream(engine):
    _, stub = engine
    expected, _, _ = await collect(stub, generate_request("steady stream", max_new_tokens=30, ignore_eos=True))
    running = asyncio.create_task(collect(stub, generate_request("steady stream", max_new_tokens=30, ignore_eos=True)))
    for name, (request, code, needle) in BAD_REQUESTS.items():
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub, request)
        assert info.value.code() == code, (name, info.value.details())
        assert needle in info.value.details(), (name, info.value.details())
    ids, _, complete = await running
    assert ids == expected and complete.finish_reason == pb.FINISH_REASON_LENGTH


async def test_stop_string_across_tokens_is_never_streamed(engine):
    server, stub = engine
    tokenizer = server.core.tokenizer
    ids, text, _ = await collect(stub, generate_request("Stop strings span tokens", max_new_tokens=12, ignore_eos=True))
    spans = [tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    # A stop string that starts inside token 3's text and ends inside token 5's: no token holds it whole.
    stop = spans[5][len(spans[3]) - 1 : len(spans[5]) - 1] if len(spans[5]) - len(spans[3]) > 1 else spans[5][-3:]
    assert stop and stop in text
    stopped_ids, stopped_text, complete = await collect(
        stub, generate_request("Stop strings span tokens", max_new_tokens=12, ignore_eos=True, stop=[stop])
    )
    assert complete.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE and complete.matched_stop == stop
    assert stopped_text == text[: text.index(stop)] and stop not in stopped_text
    assert stopped_ids == ids[: len(stopped_ids)] and len(stopped_ids) < len(ids)


async def test_generate_with_local_adapters(tiny_llama_dir, make_adapter, tmp_path):
    qv = make_adapter("grpc-qv", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=31)
    config = EngineConfig(model_dir=str(tiny_llama_dir), port=0, adapters=(("qv", str(qv)),), work_dir=str(tmp_path))
    server = await start_engine(config)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.EngineStub(channel)
            base_ids, _, base = await collect(stub, generate_request("Adapters over gRPC", max_new_tokens=8, ignore_eos=True))
            ids, _, done = await collect(stub, generate_request("Adapters over gRPC", adapter="qv", max_new_tokens=8, ignore_eos=True))
            pinned_ids, _, pinned = await collect(stub, generate_request("Adapters over gRPC", adapter="qv@1", max_new_tokens=8, ignore_eos=True))
            assert (base.adapter, done.adapter, pinned.adapter) == ("", "qv@1", "qv@1")
            assert ids == pinned_ids and ids != base_ids
            for ref, code in (("qv@2", grpc.StatusCode.NOT_FOUND), ("other", grpc.StatusCode.NOT_FOUND), ("qv@zero", INVALID)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await collect(stub, generate_request("x", adapter=ref, max_new_tokens=2))
                assert info.value.code() == code and ref.split("@")[0] in info.value.details()
    finally:
        await server.stop(grace=0.5)


async def test_full_queue_is_resource_exhausted(tiny_llama_dir):
    config = EngineConfig(model_dir=str(tiny_llama_dir), port=0, max_queued_requests=2)
    server = await start_engine(config)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.EngineStub(channel)
            busy = [stub.Generate(generate_request(f"busy {i}", max_new_tokens=300, ignore_eos=True)) for i in range(2)]
            for call in busy:
                await anext(aiter(call))  # both are running
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(stub, generate_request("one too many", max_new_tokens=2))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue" in info.value.details()
            for call in busy:
                call.cancel()
            await until(lambda: server.core.loop.num_active == 0, "the cancelled requests left the queue")
            _, _, done = await collect(stub, generate_request("room again", max_new_tokens=2))
            assert done.usage.completion_tokens == 2
    finally:
        await server.stop(grace=0.5)
