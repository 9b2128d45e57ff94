"""How a fresh pinned host allocation in one thread delays GPU work launched by another.

Without its pinned arena (`--host-pinned-gb 0`; engine/pinned_arena.py), the engine packs each fetched
adapter into new pinned host memory (engine/adapter_cache.py, in a worker thread) while its loop thread
launches steps. This times a stand-in step (four bf16 8192^3 matmuls and a
sync) alone and while another thread keeps allocating pinned buffers of a packed adapter's size, each
of a new size and with the host allocator's cache emptied every 8, so most are fresh page-locking calls
to the driver:

    python benchmarks/pinned_alloc_stall.py --sizes-mb 14 84

One JSON line per case: step ms median / p99 / max, and the allocations' median / max ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[14, 84], help="q/v and all-target rank-16 8B adapters")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        for _ in range(4):
            torch.mm(a, a)
        torch.cuda.synchronize()

    def timed() -> dict:
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        times.sort()
        return {"step_ms_median": round(statistics.median(times), 2), "step_ms_p99": round(times[int(0.99 * len(times)) - 1], 2),
                "step_ms_max": round(times[-1], 2)}  # fmt: skip

    for _ in range(5):
        step()
    print(json.dumps({"case": "quiet", **timed()}))
    for mb in args.sizes_mb:
        stop = threading.Event()
        allocs: list[float] = []

        def pin(mb: int = mb, stop: threading.Event = stop, allocs: list[float] = allocs) -> None:
            i = 0
            while not stop.is_set():
                start = time.perf_counter()
                x = torch.empty((mb << 20) // 2 + 4096 * (i % 97), dtype=torch.bfloat16, pin_memory=True)
                allocs.append((time.perf_counter() - start) * 1e3)
                x.fill_(1)
                del x
                i += 1
                if i % 8 == 0 and hasattr(torch._C, "_host_emptyCache"):
                    torch._C._host_emptyCache()

        thread = threading.Thread(target=pin)
        thread.start()
        result = timed()
        stop.set()
        thread.join()
        allocs.sort()
        print(json.dumps({"case": f"pinning {mb} MB", **result, "allocs": len(allocs),
                          "alloc_ms_median": round(statistics.median(allocs), 2), "alloc_ms_max": round(allocs[-1], 2)}))  # fmt: skip


if __name__ == "__main__":
    main()
