"""A device's copy rate, the bandwidth benchmarks divide by for their floors: one buffer copied into
another, bytes read plus bytes written over the median copy's time (the figure BENCHMARKS.md has
quoted since issue 3: 4.26 TB/s on an H200, so a read-only kernel can reach 1.0 of it).

    python benchmarks/copy_rate.py [--device cuda] [--mib 1024]

Benchmarks that take `--copy-gbps 0` (their default) measure it here on their own device first, so
an H100's floors are an H100's, not an H200's 4.2 TB/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure_copy_gbps(device: torch.device, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """GB/s of (read + write) bytes of a copy of nbytes, the median of reps copies after one warm-up."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.fill_(1)
    dst.copy_(src)  # warm-up: first touch, allocator
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        else:
            began = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - began)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the benchmark's engine sizes its memory after this: give the buffers back
    return 2 * nbytes / statistics.median(times) / 1e9


def resolve_copy_gbps(copy_gbps: float, device: torch.device) -> float:
    """The --copy-gbps a benchmark was given, or (0) this device's measured rate."""
    if copy_gbps < 0:
        raise ValueError(f"--copy-gbps must be >= 0 (0: measure), got {copy_gbps}")
    return copy_gbps or measure_copy_gbps(device, nbytes=(1 << 30) if device.type == "cuda" else (64 << 20))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mib", type=int, default=1024, help="the buffer copied")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    row = {"device": str(device), "mib": args.mib, "copy_gbps": round(measure_copy_gbps(device, args.mib << 20, args.reps), 1)}
    if device.type == "cuda":
        row["name"] = torch.cuda.get_device_name(device)
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
