"""Profile decode steps of the engine (torch.profiler): where the host and the device spend a step.

    python benchmarks/profile_step.py --shape llama3-8b --batch 64 --adapters 32
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.engine_step import SHAPES, build, make_request, step, sync


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--adapters", type=int, default=0)
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--lora-backend", default="splitk" if torch.cuda.is_available() else "ref")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    graphs = device.type == "cuda"
    loop = build(SHAPES[args.shape], device, args.tensor_parallel_size, [args.batch], 64 + 64 + 8, args.attention, args.adapters, args.lora_backend, graphs)
    vocab = loop.workers.local.runner.model.config.vocab_size
    for i in range(args.batch):
        loop.scheduler.add(make_request(i, 64, vocab, 64, f"adapter-{i % args.adapters}" if args.adapters else ""))
    for _ in range(5):
        step(loop)
    sync(device)
    start = time.perf_counter()
    for _ in range(5):
        step(loop)
    sync(device)
    print(f"decode step: {(time.perf_counter() - start) / 5 * 1e3:.2f} ms")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            step(loop)
        sync(device)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows))
    loop.workers.close()


if __name__ == "__main__":
    main()
