"""Slot loads: how long copying a packed adapter into a GPU slot takes, and what a load beside decoding
costs the decode steps (DESIGN's target: a slot load of an 8B rank-16 adapter within 5 ms, never
stalling decoding).

    python benchmarks/slot_load.py --shape llama3-8b --batch 32 --adapters 8

Part 1, the load alone, for an adapter on all seven projections ("all") and a q/v one ("qv"), packed in
pinned host memory as the engine packs them: the host time of `LoraSlotPool.load` (it zeroes the slot
and issues the copies on the pool's copy stream) and the device time of that work (CUDA events on the
copy stream), with the bytes copied.

Part 2, loads beside decoding: `batch` requests over `adapters` adapters decode through the engine's
steps (graphs on); every step also loads a spare slot with another adapter, as a load ahead for a queued
request does. Median decode step with and without those loads. On the CPU both parts run with host
times only (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.engine_step import SHAPES, build, make_request, random_packed, step, sync
from engine.lora_pool import LoraSlotPool, PackedAdapter

KINDS = {"all": (), "qv": ("qkv",)}  # fused targets of each kind of adapter (empty: all four)


def nbytes(packed: PackedAdapter) -> int:
    return sum(t.numel() * t.element_size() for t in (*packed.a.values(), *packed.b.values()))


def load_alone(config, device: torch.device, rank: int, max_rank: int, repeats: int) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pool = LoraSlotPool(config, 2, max_rank, dtype, device)
    rows = []
    for kind, fused in KINDS.items():
        packed = random_packed(f"slot-load-{kind}", config, rank, dtype, seed=1, share=False, fused=fused, pin=device.type == "cuda")
        host_ms, device_ms = [], []
        for i in range(repeats + 1):  # the first load is a warm-up
            sync(device)
            start = time.perf_counter()
            if device.type == "cuda":
                stream = pool._copy_stream
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record(stream)
                pool.load(i % 2, packed)
                end.record(stream)
                issued = time.perf_counter()
                end.synchronize()
                device_ms.append(begin.elapsed_time(end))
            else:
                pool.load(i % 2, packed)
                issued = time.perf_counter()
            host_ms.append((issued - start) * 1e3)
        row = {"part": "load", "adapter": kind, "rank": rank, "slot_max_rank": max_rank, "bytes": nbytes(packed),
               "issue_ms": statistics.median(host_ms[1:])}  # fmt: skip
        if device_ms:
            row["device_ms"] = statistics.median(device_ms[1:])
            row["gb_s"] = row["bytes"] / row["device_ms"] / 1e6
        rows.append(row)
    return rows


def decode_beside_loads(config, device: torch.device, batch: int, num_adapters: int, num_steps: int, kind: str) -> dict:
    """Median decode step of `batch` requests over `num_adapters` adapters, without and with a slot load
    (into a slot no running request reads) issued before every step."""
    graphs = device.type == "cuda"
    loop = build(config, device, 1, [batch], 64 + 2 * num_steps + 8, "triton" if graphs else "ref", num_adapters + 1,
                 "splitk" if graphs else "ref", graphs, fused=KINDS[kind], graph_max_tokens=0)  # fmt: skip
    try:
        runner = loop.workers.local.runner
        dtype = next(runner.model.parameters()).dtype
        extra = random_packed("slot-load-extra", config, 16, dtype, seed=2, share=False, fused=KINDS[kind], pin=device.type == "cuda")
        vocab = runner.model.config.vocab_size
        for i in range(batch):
            loop.scheduler.add(make_request(i, 64, vocab, 2 * num_steps + 4, f"adapter-{i % num_adapters}"))
        step(loop)  # the prompts
        used = {req.lora_slot for req in loop.scheduler.running}
        spare = next(s for s in range(runner.lora_pool.num_slots) if s not in used)
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(2 * num_steps):
            loading = i % 2 == 1  # alternate, so drift in the device's clocks touches both alike
            sync(device)
            start = time.perf_counter()
            if loading:
                runner.lora_pool.load(spare, extra)
            step(loop)
            sync(device)
            times[loading].append((time.perf_counter() - start) * 1e3)
        settled = {k: v[2:] or v for k, v in times.items()}  # the first steps of each kind set up
        return {"part": "decode", "adapter": kind, "batch": batch, "num_adapters": num_adapters,
                "decode_step_ms": statistics.median(settled[False]), "with_load_step_ms": statistics.median(settled[True])}  # fmt: skip
    finally:
        loop.workers.close()


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slot-max-rank", type=int, nargs="+", default=[16, 64], help="the pool's rank (the slot's capacity)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--num-steps", type=int, default=10, help="decode steps timed with and without a load each")
    args = p.parse_args(argv)
    device, config = torch.device(args.device), SHAPES[args.shape]
    rows = []
    for max_rank in args.slot_max_rank:
        rows += load_alone(config, device, args.rank, max_rank, args.repeats)
    for kind in KINDS:
        rows.append(decode_beside_loads(config, device, args.batch, args.adapters, args.num_steps, kind))
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
