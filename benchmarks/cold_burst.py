"""The first second of a cold pass, against the registry alone: N adapters new to the engine asked for
at once, each resolved (one GetAdapter, as admission resolves every request's adapter) and then fetched
through the engine's own `RegistryLink` (its fetch process, --max-concurrent-fetches turns), from a real
`loramux registry serve` process on loopback.

    python benchmarks/cold_burst.py [--shape llama3-8b] [--adapters 64] [--concurrency 4] [--passes 3]
        [--mode burst apart]

`burst` asks for every adapter at once, as a burst of requests does: the resolutions and the first
fetches meet in the registry. `apart` resolves them all first and only then fetches them, for the
fetches alone. One JSON line a pass: from the start, when the resolutions ended (p50 / max ms), when
the first fetch and the last fetch ended, the bytes received (beside the artifacts' registered sizes)
and the rate of the whole pass, and the CPU seconds the registry spent in it (Linux). serve.py's cold Zipf pass on the H200 (BENCHMARKS.md, 2026-12-04) asked for its 128
fetches within 0.3 s, and its first four fetches ended only 0.2-0.4 s after they began (44-51 ms is a
fetch's median).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fetch_contention import SHAPES, process_usage
from benchmarks.registry_transfer import write_peft_adapter
from engine.registry_link import RegistryLink, record_of
from loraformat.model_shapes import ModelShape
from loramux.registry_client import RegistryClient
from loramux.testing.procs import Service
from loramux.v1 import registry_pb2 as pb


async def burst_pass(address: str, adapters: list[pb.Adapter], warm: pb.Adapter, concurrency: int, mode: str, registry_pid: int | None) -> dict:
    """One pass over a fresh link (its connection and fetch process warmed by one fetch of `warm`)."""
    names = [a.name for a in adapters]
    link = RegistryLink(address, warm.base_model, "{}", on_event=lambda event: None, max_concurrent_fetches=concurrency)
    try:
        await link.fetch(record_of(warm))
        before = process_usage(registry_pid) if registry_pid else None
        start = time.perf_counter()
        resolved: list[float] = []
        fetched: list[float] = []
        size = 0

        async def one(name: str, record=None) -> None:
            nonlocal size
            if record is None:
                record = await link.resolve(name)
                resolved.append(time.perf_counter() - start)
            data = await link.fetch(record)  # (not `size += await ...`: size would be read before the await)
            size += data.nbytes
            fetched.append(time.perf_counter() - start)

        if mode == "burst":
            await asyncio.gather(*(one(name) for name in names))
        else:
            records = []
            for record in await asyncio.gather(*(link.resolve(name) for name in names)):
                resolved.append(time.perf_counter() - start)
                records.append(record)
            await asyncio.gather(*(one(r.name, r) for r in records))
        seconds = time.perf_counter() - start
        after = process_usage(registry_pid) if registry_pid else None
    finally:
        await link.close()
    row = {
        "mode": mode, "adapters": len(names), "concurrency": concurrency,
        "resolved_ms_p50": round(statistics.median(resolved) * 1e3, 1), "resolved_ms_max": round(max(resolved) * 1e3, 1),
        "first_fetch_ms": round(min(fetched) * 1e3, 1), "last_fetch_ms": round(max(fetched) * 1e3, 1),
        "mb": round(size / 1e6, 3), "registered_mb": round(sum(a.size_bytes for a in adapters) / 1e6, 3), "mb_s": round(size / 1e6 / seconds, 1),
    }  # fmt: skip
    if before is not None and after is not None:
        row["registry_cpu_s"] = round(after[0] - before[0], 3)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--adapters", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4, help="the link's fetch turns (--max-concurrent-fetches)")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--mode", nargs="+", default=["burst", "apart"], choices=("burst", "apart"))
    args = p.parse_args(argv)
    if args.adapters < 1 or args.passes < 1:
        p.error("--adapters and --passes must be >= 1")
    config = SHAPES[args.shape]
    shape = ModelShape.from_config(config)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "model").mkdir()
        (root / "model" / "config.json").write_text(json.dumps(config))
        server = Service(["registry", "serve", "--port", "0", "--data-dir", str(root / "data")], "registry")
        try:
            with RegistryClient(server.address) as client:
                client.register_base_model("bench", root / "model")
                adapters = []
                for i in range(args.adapters + 1):  # the last one warms each pass's link
                    write_peft_adapter(root / "adapter", shape, 16, seed=i, modules=("q_proj", "v_proj"))
                    adapters.append(client.register_adapter(pb.AdapterSpec(name=f"burst-{i}"), root / "adapter"))
            for _ in range(args.passes):
                for mode in args.mode:
                    row = asyncio.run(burst_pass(server.address, adapters[:-1], adapters[-1], args.concurrency, mode, server.proc.pid))
                    print(json.dumps(row), flush=True)
                    rows.append(row)
        finally:
            server.interrupt()
    return rows


if __name__ == "__main__":
    main()
