"""The StepPlan boundary and the model workers: what a plan carries, that nothing below it reads a
Request, and that a dead tensor-parallel rank ends the engine (UNAVAILABLE streams, NOT_SERVING)."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import pickle
import signal
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.adapter_cache import HostAdapterCache
from engine.adapter_slots import AdapterSlots
from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.kv_pool import PageAllocator, ReqToTokenPool
from engine.lora_manager import LoraManager
from engine.lora_pool import PackedAdapter
from engine.model_runner import ModelRunner
from engine.radix_cache import RadixCache
from engine.request import Request
from engine.request_kv import RequestKV
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.server import start_engine
from engine.step_plan import LoadSlot, SampleRow
from engine.text import IncrementalDetokenizer, StopMatcher, Tokenizer
from engine.worker import ModelWorker, WorkerSpec, start_workers
from loramux.engine_client import generate_request
from loramux.v1 import engine_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
BELOW_THE_PLAN = ["engine/model_runner.py", "engine/worker.py", "engine/cuda_graphs.py", "engine/models/blocks.py", "engine/attention.py", "engine/lora_pool.py"]


class NoWorkers:
    on_failure = None


def front(tokenizer: Tokenizer, num_slots: int = 1, max_batch_tokens: int = 64) -> EngineLoop:
    allocator = PageAllocator(64, 4)
    kv = RequestKV(allocator, ReqToTokenPool(4, 128), RadixCache(4, allocator))
    lora = LoraManager(AdapterSlots(num_slots), HostAdapterCache(4))
    return EngineLoop(Scheduler(SchedulerConfig(4, max_batch_tokens), kv, lora=lora), NoWorkers())


def request(tokenizer: Tokenizer, prompt: list[int], namespace: str = "", params: SamplingParams | None = None) -> Request:
    packed = PackedAdapter(namespace, 4, 2.0, {}, {}) if namespace else None
    return Request(
        rid="r", prompt_ids=prompt, params=params or SamplingParams(max_new_tokens=4), namespace=namespace, sink=lambda e: None,
        detokenizer=IncrementalDetokenizer(tokenizer, prompt), stop_matcher=StopMatcher(()),
        eos_token_ids=frozenset(), packed_adapter=packed,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


def test_plan_carries_rows_lengths_segments_and_loads(tokenizer):
    loop = front(tokenizer, max_batch_tokens=12)
    seeded = SamplingParams(max_new_tokens=4, temperature=0.7, seed=5)
    base, lora = request(tokenizer, list(range(3, 11)), params=seeded), request(tokenizer, list(range(20, 30)), "d" * 64)
    loop.scheduler.add(base)
    loop.scheduler.add(lora)
    plan, adapters = loop.plan(loop.scheduler.schedule())
    # budget 12: all 8 of base's tokens (it samples), the first 4 of the adapter request's 10 (it does not)
    assert plan.req_rows == (base.req_row, lora.req_row) and plan.prefix_lens == (0, 0) and plan.extend_lens == (8, 4)
    assert plan.input_ids == (*range(3, 11), 20, 21, 22, 23) and plan.positions == (*range(8), *range(4))
    assert plan.out_cache_loc == tuple(base.kv_slots + lora.kv_slots[:4])
    assert plan.samples == (SampleRow(base.uid, seeded), None) and plan.sample_rows == [7]
    assert plan.lora_slots == (-1, 0) and plan.loads == (LoadSlot(0, "d" * 64),) and adapters == {"d" * 64: lora.packed_adapter}
    assert plan.table_writes == ((base.req_row, 0, tuple(base.kv_slots)), (lora.req_row, 0, tuple(lora.kv_slots)))
    loop.scheduler.finish(base, loop.scheduler.finished_event(base, None))
    plan, adapters = loop.plan(loop.scheduler.schedule())  # the rest of the prompt; the slot is loaded already
    assert plan.extend_lens == (6,) and plan.prefix_lens == (4,) and plan.loads == () and adapters == {}
    assert plan.released == (base.uid,) and plan.samples == (SampleRow(lora.uid, lora.params),)
    assert pickle.loads(pickle.dumps(plan)) == plan  # plain data: it crosses process boundaries as is


def test_a_plan_entry_reads_its_tokens_without_joining_prompt_and_output(tokenizer):
    """Request.ids_between(start, end) is all_ids[start:end] for every range: within the prompt, within
    the output, across both, empty."""
    req = request(tokenizer, [11, 12, 13, 14, 15])
    req.output_ids += [21, 22, 23]
    ids = req.all_ids
    assert ids == [11, 12, 13, 14, 15, 21, 22, 23]
    for start in range(len(ids) + 1):
        for end in range(start, len(ids) + 2):
            assert req.ids_between(start, end) == ids[start:end], (start, end)


def test_table_writes_land_in_their_cells_and_the_last_write_of_a_cell_wins():
    """ModelRunner._write_table: each (row, start, slots) lands in row's cells from start on; a cell
    written twice in one plan holds the later slot (as the front's table does); nothing else changes."""
    runner = object.__new__(ModelRunner)  # the table write needs the table and the device alone
    runner.req_to_token, runner.device = torch.full((4, 8), -1, dtype=torch.int64), torch.device("cpu")
    runner._write_table(((1, 2, (10, 11, 12)), (3, 0, (5,)), (1, 3, (20,)), (0, 7, (9,))))
    expected = torch.full((4, 8), -1, dtype=torch.int64)
    expected[1, 2:5] = torch.tensor([10, 20, 12])
    expected[3, 0], expected[0, 7] = 5, 9
    assert torch.equal(runner.req_to_token, expected)
    runner._write_table(())  # nothing to write: nothing changes
    assert torch.equal(runner.req_to_token, expected)


def test_nothing_below_the_plan_reads_a_request():
    for path in BELOW_THE_PLAN:
        tree = ast.parse((ROOT / path).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not imported & {"engine.request", "engine.scheduler", "engine.request_kv", "engine.core"}, path


def test_a_bad_tuned_tile_file_fails_the_worker_build_and_a_good_one_is_used(tiny_llama_dir, tmp_path):
    """--kernel-configs: the worker reads the decode LoRA kernels' tiles for its device at its build, so
    a malformed file stops the start with the file's name instead of failing a step later."""
    from lorakernels import tuned

    (tmp_path / "cpu.json").write_text(json.dumps({"entries": [{"kernel": "expand"}]}))
    config = EngineConfig(model_dir=str(tiny_llama_dir), device="cpu", max_running_requests=4, num_kv_slots=256, kernel_configs=str(tmp_path))
    try:
        with pytest.raises(ValueError, match=r"cpu\.json: entry 0: .*out_dim"):
            ModelWorker.build(WorkerSpec(config, 128))
        entry = {"kernel": "expand", "out_dim": 64, "num_stack": 1, "max_rank": 16, "tokens": 8, "config": {"block_n": 32, "num_warps": 2}}
        (tmp_path / "cpu.json").write_text(json.dumps({"entries": [entry]}))
        ModelWorker.build(WorkerSpec(config, 128))
        assert tuned.device_tiles(torch.device("cpu")).lookup("expand", 64, 1, 16, 8) == tuned.ExpandTile(32, 2)
    finally:
        tuned.use_dir(None)


def test_worker_executes_a_pickled_plan_as_the_engine_does(tiny_llama_dir, tokenizer):
    """A worker built alone runs the plans the front makes (after a round trip through pickle) and
    samples a seeded request exactly as a fresh generator with that seed does."""
    workers = start_workers(WorkerSpec(EngineConfig(model_dir=str(tiny_llama_dir), max_running_requests=4, num_kv_slots=256), 128))
    loop = front(tokenizer)
    req = request(tokenizer, tokenizer.encode("Hello world"), params=SamplingParams(max_new_tokens=3, temperature=1.0, seed=7))
    loop.scheduler.add(req)
    plan, adapters = loop.plan(loop.scheduler.schedule())
    runner = workers.local.runner
    logits_rows = []
    real_sample = runner.model.compute_logits
    runner.model.compute_logits = lambda h: logits_rows.append(real_sample(h)) or logits_rows[-1]
    [token] = workers.execute(pickle.loads(pickle.dumps(plan)), adapters)
    from engine.sampling import make_generator, sample

    expected = sample(logits_rows[0], [req.params], [make_generator(7, "cpu")])
    assert token == expected.item()
    assert set(runner.generators) == {req.uid}
    loop.scheduler.finish(req, loop.scheduler.finished_event(req, None))
    workers.execute(loop.plan([])[0], {})  # a plan of releases only
    assert runner.generators == {}


async def test_a_killed_worker_ends_streams_with_unavailable_and_health_not_serving(tiny_llama_dir):
    config = EngineConfig(model_dir=str(tiny_llama_dir), port=0, tensor_parallel_size=2)
    server = await start_engine(config)
    channel = grpc.aio.insecure_channel(server.address)
    try:
        stub, health = pb_grpc.EngineStub(channel), health_pb2_grpc.HealthStub(channel)
        stream = stub.Generate(generate_request("Hello there", max_new_tokens=400, ignore_eos=True))
        await stream.read()  # the first chunk: the stream is in flight on both ranks
        [pid] = server.core.workers.pids
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            while True:
                response = await stream.read()
                assert response is not grpc.aio.EOF, "the stream ended without an error"
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE and "model worker rank 1" in failure.value.details()
        await _assert_engine_ended(server, stub, health)
    finally:
        await channel.close()
        await server.stop(grace=0.5)
    assert not torch.distributed.is_initialized()


async def test_a_step_failing_on_rank_0_alone_ends_the_tp_engine(tiny_llama_dir):
    """Rank 1 is already in the step's collectives when rank 0's launch raises (an adapter load, OOM):
    the engine must end as for a dead worker, not fail one request and run a desynchronised next step."""
    config = EngineConfig(model_dir=str(tiny_llama_dir), port=0, tensor_parallel_size=2)
    server = await start_engine(config)
    channel = grpc.aio.insecure_channel(server.address)
    local = server.core.workers.local
    real_launch = local.launch

    def fail_once(plan, adapters):
        local.launch = real_launch
        raise RuntimeError("simulated rank-0 fault")

    local.launch = fail_once
    try:
        stub, health = pb_grpc.EngineStub(channel), health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await stub.Generate(generate_request("Hello there", max_new_tokens=4)).read()
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE and "simulated rank-0 fault" in failure.value.details()
        await _assert_engine_ended(server, stub, health)
    finally:
        await channel.close()
        await server.stop(grace=0.5)
    assert not torch.distributed.is_initialized()


async def _assert_engine_ended(server, stub, health) -> None:
    """The engine failed as a whole: the serving function's failure is set (it exits non-zero on this),
    health is NOT_SERVING and a new request is refused UNAVAILABLE."""
    await asyncio.wait_for(server.failed.wait(), 60)
    reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Generate(generate_request("again", max_new_tokens=2)).read()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def _exit_at_once(spec, conn) -> None:
    """A spawned rank that dies before it joins the process group (a crash at import or device set-up)."""
    os._exit(3)


@pytest.mark.parametrize("when", ["before joining", "while building"])
def test_a_rank_failing_at_start_fails_the_start_at_once(tiny_llama_dir, monkeypatch, when):
    """A rank that dies before joining the group (rank 0's rendezvous would wait for it until the store's
    timeout), or one that reports a failure while rank 0 builds (rank 0 waits for it in a collective):
    the start fails with WorkerDied naming the rank, not with rank 0's own error after a timeout, and no
    rank is left running."""
    import multiprocessing

    from engine import worker as worker_module
    from engine.parallel import TensorParallel
    from engine.worker import WorkerDied

    monkeypatch.setattr(worker_module, "START_TIMEOUT_S", 30.0)  # the rendezvous' own bound, should the fix regress
    spawn = multiprocessing.get_context("spawn")
    real_process = spawn.Process

    def rank_1(target, args, **kwargs):
        rank_spec, conn = args
        if when == "before joining":
            return real_process(target=_exit_at_once, args=args, **kwargs)
        # Rank 1 gets a model directory that does not exist: it joins, fails in its build and says so,
        # while rank 0 (a real directory) waits for it in the build's first collective.
        broken = replace(rank_spec, config=replace(rank_spec.config, model_dir=str(tiny_llama_dir) + "-missing"))
        return real_process(target=target, args=(broken, conn), **kwargs)

    monkeypatch.setattr(spawn, "Process", rank_1)
    config = EngineConfig(model_dir=str(tiny_llama_dir), device="cpu", tensor_parallel_size=2, max_running_requests=4, num_kv_slots=256)
    expected = "rank 1 exited while starting [(]code 3[)]" if when == "before joining" else "rank 1 failed to start: .*-missing"
    with pytest.raises(WorkerDied, match=expected):
        start_workers(WorkerSpec(config, 128, TensorParallel(0, 2)))
    assert not [c for c in multiprocessing.active_children() if c.name.startswith("loramux-worker")]
