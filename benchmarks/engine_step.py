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

from engine.adapter_cache import HostAdapterCache
from engine.adapter_slots import AdapterSlots
from engine.forward_inputs import KVBuffers
from engine.kv_pool import PageAllocator, ReqToTokenPool
from engine.lora_manager import LoraManager
from engine.lora_pool import LoraSlotPool, PackedAdapter
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


def random_packed(digest: str, pool: LoraSlotPool, rank: int, dtype: torch.dtype, seed: int) -> PackedAdapter:
    """A random adapter of `rank` on all seven projections, packed for the pool (host memory)."""
    gen = torch.Generator().manual_seed(seed)
    num_layers = pool.a["qkv"].shape[0]
    a = {n: (torch.randn(num_layers, t.num_stack * rank, t.in_dim, generator=gen) * 0.01).to(dtype) for n, t in pool.targets.items()}
    b = {n: (torch.randn(num_layers, t.out_dim, rank, generator=gen) * 0.01).to(dtype) for n, t in pool.targets.items()}
    return PackedAdapter(digest, rank, 2.0, a, b)


def lora_manager(model, num_adapters: int, rank: int, device: torch.device) -> LoraManager:
    dtype = next(model.parameters()).dtype
    pool = LoraSlotPool(model.config, num_adapters, rank, dtype, device)
    adapters = {f"adapter-{i}": random_packed(f"adapter-{i}", pool, rank, dtype, i) for i in range(num_adapters)}
    return LoraManager(pool, AdapterSlots(pool), HostAdapterCache(num_adapters), adapters.__getitem__)


def build(shape: str, device: torch.device, max_reqs: int, max_context: int, num_slots: int, attention: str, num_adapters: int, lora_backend: str, graphs: bool = False):
    model = random_model(shape, device=device)
    dtype = next(model.parameters()).dtype
    allocator = PageAllocator(num_slots, 1)
    req_pool = ReqToTokenPool(max_reqs, max_context, device=device)
    kv = RequestKV(allocator, req_pool, RadixCache(1, allocator))
    lora = lora_manager(model, num_adapters, 16, device) if num_adapters else None
    scheduler = Scheduler(SchedulerConfig(max_reqs, max(8192, max_reqs)), kv, lora=lora)
    kv_buffers = KVBuffers.allocate(model.config, allocator.num_slots, dtype, device)
    pool = lora.pool if lora else None
    runner = ModelRunner(model, kv_buffers, req_pool.table, device, attention, pool, lora_backend)
    if graphs:
        runner.enable_cuda_graphs(max_reqs, buckets=(max_reqs,))
    return model, scheduler, runner


def make_request(i: int, prompt_len: int, vocab: int, max_new: int, namespace: str = "") -> Request:
    prompt = torch.randint(3, vocab, (prompt_len,), generator=torch.Generator().manual_seed(i)).tolist()
    return Request(
        rid=str(i), prompt_ids=prompt, params=SamplingParams(max_new_tokens=max_new, ignore_eos=True),
        namespace=namespace, sink=lambda event: None, detokenizer=_NoText(), stop_matcher=StopMatcher(()),
        generator=None, eos_token_ids=frozenset(),
    )


def step(scheduler: Scheduler, runner: ModelRunner) -> int:
    entries = scheduler.schedule()
    tokens = runner.run(entries)
    for req, token in zip((e.req for e in entries if e.samples), tokens, strict=True):
        req.output_ids.append(token)
    return sum(e.extend_len for e in entries)


def measure(shape: str, device: torch.device, batch: int, prompt_len: int, num_decode: int, attention: str, num_adapters: int, lora_backend: str, graphs: bool) -> dict:
    max_context = prompt_len + num_decode + 8
    model, scheduler, runner = build(shape, device, batch, max_context, batch * max_context + 8, attention, num_adapters, lora_backend, graphs)
    vocab = model.config.vocab_size
    for i in range(batch):
        namespace = f"adapter-{i % num_adapters}" if num_adapters else ""
        scheduler.add(make_request(i, prompt_len, vocab, num_decode + 4, namespace))
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
        "num_adapters": num_adapters,
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
    parser.add_argument("--adapters", type=int, nargs="+", default=[0], help="distinct rank-16 adapters (0 = base)")
    parser.add_argument("--lora-backend", default="triton", choices=("ref", "triton", "chunked", "splitk"))
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly")
    parser.add_argument("--copy-gbps", type=float, default=4200.0, help="device copy bandwidth for the floor")
    args = parser.parse_args()
    device = torch.device(args.device)
    for batch in args.batch:
        base_ms = None
        for num_adapters in args.adapters:
            graphs = device.type == "cuda" and not args.no_cuda_graphs
            row = measure(args.shape, device, batch, args.prompt_len, args.num_decode, args.attention, num_adapters, args.lora_backend, graphs)
            row["cuda_graphs"] = graphs
            row["floor_ms"] = row["param_gb"] / args.copy_gbps * 1e3
            base_ms = row["decode_step_ms"] if num_adapters == 0 else base_ms
            if base_ms is not None:
                row["throughput_vs_base"] = base_ms / row["decode_step_ms"]
            row.update(shape=args.shape, attention=args.attention, lora_backend=args.lora_backend, device=str(device), torch=torch.__version__)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
