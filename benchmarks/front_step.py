"""Host time of the front per step, with no model: schedule, plan, then the tokens' way back (detokenize,
stop strings, events delivered to an asyncio loop in another thread, as the servers' handlers get them).

    python benchmarks/front_step.py --batch 64 --steps 200

The workers are replaced by one that returns token ids at once, so what is timed is what a GPU step
waits on the host between two forwards (today the front does not plan step k+1 while step k runs). A
real tokenizer (the demo model's byte-level BPE) and one stop string per request; every request decodes
until the run ends. Prints one JSON line: median milliseconds a step, and per request.

    python benchmarks/front_step.py --batch 64 --adapters 64 --waiting 192 --slots 142 --overlap

adds what a cold LoRA pass schedules each step: running requests with adapters, requests queued behind
them whose adapters load ahead into free slots (--load-ahead a step), and the overlapped schedule's
chained plans (`Scheduler.schedule_ahead`); --metrics adds the server's metrics sampler, which the
loop runs after every step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from engine.adapter_cache import HostAdapterCache
from engine.adapter_slots import AdapterSlots
from engine.admission import _thread_safe_sink
from engine.config import DEFAULT_LORA_LOAD_AHEAD
from engine.delivery import batched
from engine.engine_loop import EngineLoop
from engine.kv_pool import PageAllocator, ReqToTokenPool
from engine.lora_manager import LoraManager
from engine.lora_pool import PackedAdapter
from engine.model_runner import SampledTokens
from engine.radix_cache import RadixCache
from engine.request import Request
from engine.request_kv import RequestKV
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.telemetry import StepSampler
from engine.text import IncrementalDetokenizer, StopMatcher, Tokenizer
from loramux.demo_model import write_llama_checkpoint
from loramux.metrics import EngineMetrics


class InstantWorkers:
    """Returns a token for every sampling row at once (ids the demo tokenizer decodes to text)."""

    on_failure = None

    def __init__(self) -> None:
        self.num_steps = self.num_chained = 0

    def launch(self, plan, adapters) -> SampledTokens:
        self.num_steps += 1
        self.num_chained += plan.chained
        return SampledTokens(torch.tensor([50 + (17 * i + self.num_steps) % 400 for i in range(len(plan.sample_rows))]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=0, help="request i uses adapter i mod N (0: the base model)")
    parser.add_argument("--slots", type=int, default=0, help="adapter slots (default: --adapters + --waiting, all fit)")
    parser.add_argument("--waiting", type=int, default=0, help="requests queued behind the running batch all run long")
    parser.add_argument("--load-ahead", type=int, default=DEFAULT_LORA_LOAD_AHEAD, help="waiting requests' adapters loaded a step")
    parser.add_argument("--overlap", action="store_true", help="the overlapped schedule: chained decode plans (schedule_ahead)")
    parser.add_argument("--metrics", action="store_true", help="the server's metrics sampler after every step, as the loop runs it")
    args = parser.parse_args()
    tokenizer = Tokenizer.from_dir(write_llama_checkpoint(Path(tempfile.mkdtemp()) / "model", seed=1))
    max_context = 64 + args.steps + 8
    num_requests = args.batch + args.waiting
    allocator = PageAllocator(num_requests * max_context, args.page_size)
    kv = RequestKV(allocator, ReqToTokenPool(num_requests, max_context), RadixCache(args.page_size, allocator))
    lora = None
    if args.adapters:
        lora = LoraManager(AdapterSlots(args.slots or args.adapters + args.waiting), HostAdapterCache(args.adapters + args.waiting))
    config = SchedulerConfig(args.batch, 8192, max_lora_load_ahead=args.load_ahead if lora else 0)
    workers = InstantWorkers()
    loop = EngineLoop(Scheduler(config, kv, lora=lora), workers, overlap=args.overlap)
    if args.metrics:
        loop.after_step = StepSampler(EngineMetrics(base_model_name="demo"), loop.scheduler, lora, {})
    server = asyncio.new_event_loop()
    threading.Thread(target=server.run_forever, daemon=True).start()
    counts = [0] * num_requests
    queues, consumers = asyncio.run_coroutine_threadsafe(_consumers(counts), server).result()
    for i, queue in enumerate(queues):
        prompt = tokenizer.encode(f"Request {i}: tell me a story about cats and dogs")
        # the waiting requests' adapters are their own (the cold pass's queue: adapters fetched, not loaded)
        namespace, adapter = "", 0
        if args.adapters:
            adapter = i % args.adapters if i < args.batch else args.adapters + i - args.batch
            namespace = f"{adapter:064x}"
        loop.scheduler.add(Request(
            rid=str(i), namespace=namespace, prompt_ids=prompt, sink=_thread_safe_sink(server, queue),
            params=SamplingParams(max_new_tokens=args.steps + 2, stop=("the end",)),
            detokenizer=IncrementalDetokenizer(tokenizer, prompt), stop_matcher=StopMatcher(("the end",)),
            eos_token_ids=frozenset(), packed_adapter=PackedAdapter(namespace, 16, 2.0, {}, {}) if namespace else None,
            adapter_ref=f"adapter-{adapter}@1" if namespace else "",
        ))  # fmt: skip
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        with batched():  # as EngineLoop._run wraps each iteration
            loop._advance()  # schedule (or schedule ahead), plan, launch, post-process (the workers answer at once)
            if loop.after_step is not None:
                loop.after_step()
        times.append(time.perf_counter() - start)
    in_flight = loop._take_in_flight()  # under overlap, the step launched last
    if in_flight is not None:
        with batched():
            loop._post_process(in_flight)
    step_ms = statistics.median(times[5:]) * 1e3
    # Every token reached its handler's queue: one a step for each running request (none finished
    # early, the waiting ones never ran).
    expected = args.batch * loop.num_steps
    delivered = asyncio.run_coroutine_threadsafe(_wait_for(counts, expected), server).result(30)
    print(json.dumps({"batch": args.batch, "adapters": args.adapters, "waiting": args.waiting, "overlap": args.overlap, "metrics": args.metrics,
                      "front_step_ms": step_ms, "per_request_us": step_ms * 1e3 / args.batch,
                      "events_delivered": delivered, "events_expected": expected, "chained_steps": workers.num_chained,
                      "slot_loads": lora.slots.num_loads if lora else 0}))  # fmt: skip
    asyncio.run_coroutine_threadsafe(_cancel(consumers), server).result()
    server.call_soon_threadsafe(server.stop)


async def _consumers(counts: list[int]) -> tuple[list[asyncio.Queue], list[asyncio.Task]]:
    """One queue per request, each drained by a task on this loop (as the handlers drain theirs)."""
    queues = [asyncio.Queue() for _ in counts]
    return queues, [asyncio.create_task(_drain(q, counts, i)) for i, q in enumerate(queues)]


async def _wait_for(counts: list[int], expected: int, timeout: float = 10.0) -> int:
    deadline = asyncio.get_running_loop().time() + timeout
    while sum(counts) < expected and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    return sum(counts)


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _drain(queue: asyncio.Queue, counts: list[int], i: int) -> None:
    while True:
        await queue.get()
        counts[i] += 1


if __name__ == "__main__":
    main()
