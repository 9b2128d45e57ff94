"""Decode-step time and prefill throughput of the engine's base-model path (scheduler + runner +
model), with random weights in a named shape.

    python benchmarks/engine_step.py --shape llama3-8b --device cuda --batch 1 32 --prompt-len 128

Reports, per batch size, the median time of a decode step (every request computes one token and
samples), next to the weight-read floor (parameter bytes / copy bandwidth), and prefill tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.forward_inputs import KVBuffers
from engine.kv_pool import PageAllocator, ReqToTokenPool
from engine.model_runner import ModelRunner
from engine.radix_cache import RadixCache
from engine.request import Request
from engine.request_kv import RequestKV
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.text import StopMatcher
from engine.weights import random_model


class _NoText:
    """Benchmarks feed token ids: no detokenization."""

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(shape: str, device: torch.device, max_reqs: int, max_context: int, num_slots: int, attention: str):
    model = random_model(shape, device=device)
    dtype = next(model.parameters()).dtype
    allocator = PageAllocator(num_slots, 1)
    req_pool = ReqToTokenPool(max_reqs, max_context, device=device)
    kv = RequestKV(allocator, req_pool, RadixCache(1, allocator))
    scheduler = Scheduler(SchedulerConfig(max_reqs, max(8192, max_reqs)), kv)
    kv_buffers = KVBuffers.allocate(model.config, allocator.num_slots, dtype, device)
    runner = ModelRunner(model, kv_buffers, req_pool.table, device, attention)
    return model, scheduler, runner


def make_request(i: int, prompt_len: int, vocab: int, max_new: int) -> Request:
    prompt = torch.randint(3, vocab, (prompt_len,), generator=torch.Generator().manual_seed(i)).tolist()
    return Request(
        rid=str(i), prompt_ids=prompt, params=SamplingParams(max_new_tokens=max_new, ignore_eos=True),
        namespace="", sink=lambda event: None, detokenizer=_NoText(), stop_matcher=StopMatcher(()),
        generator=None, eos_token_ids=frozenset(),
    )


def step(scheduler: Scheduler, runner: ModelRunner) -> int:
    entries = scheduler.schedule()
    tokens = runner.run(entries)
    for req, token in zip((e.req for e in entries if e.samples), tokens, strict=True):
        req.output_ids.append(token)
    return sum(e.extend_len for e in entries)


def measure(shape: str, device: torch.device, batch: int, prompt_len: int, num_decode: int, attention: str) -> dict:
    max_context = prompt_len + num_decode + 8
    model, scheduler, runner = build(shape, device, batch, max_context, batch * max_context + 8, attention)
    vocab = model.config.vocab_size
    for i in range(batch):
        scheduler.add(make_request(i, prompt_len, vocab, num_decode + 4))
    sync(device)
    start = time.perf_counter()
    num_prefill = step(scheduler, runner)  # the whole batch's prompts in one extend step
    sync(device)
    prefill_s = time.perf_counter() - start
    times = []
    for _ in range(num_decode):
        start = time.perf_counter()
        step(scheduler, runner)
        sync(device)
        times.append(time.perf_counter() - start)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model, scheduler, runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "batch": batch,
        "decode_step_ms": statistics.median(times[3:]) * 1e3,
        "prefill_tokens": num_prefill,
        "prefill_tok_s": num_prefill / prefill_s,
        "param_gb": param_bytes / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--num-decode", type=int, default=20)
    parser.add_argument("--attention", choices=("ref", "sdpa"), default="sdpa")
    parser.add_argument("--copy-gbps", type=float, default=4200.0, help="device copy bandwidth for the floor")
    args = parser.parse_args()
    device = torch.device(args.device)
    for batch in args.batch:
        row = measure(args.shape, device, batch, args.prompt_len, args.num_decode, args.attention)
        row["floor_ms"] = row["param_gb"] / args.copy_gbps * 1e3
        row.update(shape=args.shape, attention=args.attention, device=str(device), torch=torch.__version__)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
