"""Profile decode steps of the engine (torch.profiler): where the host and the device spend a step.

    python benchmarks/profile_step.py --shape llama3-8b --batch 1 [--adapters 0]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.engine_step import build, make_request, step, sync


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--adapters", type=int, default=0)
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, scheduler, runner = build(args.shape, device, args.batch, 256, args.batch * 256 + 8, args.attention, args.adapters, "triton" if device.type == "cuda" else "ref", graphs=device.type == "cuda")
    for i in range(args.batch):
        scheduler.add(make_request(i, 64, model.config.vocab_size, 64, f"adapter-{i % args.adapters}" if args.adapters else ""))
    for _ in range(5):
        step(scheduler, runner)
    sync(device)
    start = time.perf_counter()
    for _ in range(5):
        step(scheduler, runner)
    sync(device)
    print(f"decode step: {(time.perf_counter() - start) / 5 * 1e3:.2f} ms")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            step(scheduler, runner)
        sync(device)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
