"""How packing adapters on several threads holds up a thread that launches steps (the GIL).

The engine checks and packs each fetched adapter (engine/core.py `_pack`: read_canonical_within, then
pack_adapter) on --adapter-prep-threads threads while its loop thread plans and launches steps. Both
need the GIL. This times a stand-in loop thread, whose iteration is the pure Python of planning a step
(holding the GIL throughout), the small tensor ops of launching it, then a wait with the GIL released
(the device running the step), alone and while P threads pack the same number of real canonical
artifacts (Llama-3-8B shape, rank 16):

    PYTHONPATH=. python benchmarks/adapter_prep.py --threads 1 4 20 --targets q_proj v_proj

One JSON line per case: the loop iteration's host time (the iteration less its wait) median / p99 /
max in ms, the iterations that ran, the adapters packed per second and each pack's time (median / max
ms). Each torch call a packer makes lets go of the GIL; taking it back while the loop holds it waits up
to a switch interval, so the pack times show how many such calls packing makes. `--torch-threads` above
the core count shows what torch's OpenMP copies cost where the cores are busy.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.serve import write_random_peft_adapter
from engine.adapter_cache import pack_adapter
from engine.adapters import LocalAdapters, read_canonical_within
from engine.lora_pool import fused_targets
from engine.model_config import ModelConfig
from engine.named_shapes import LLAMA3_8B_CONFIG, TINY_LLAMA_CONFIG
from loraformat.model_shapes import ModelShape

CONFIGS = {"llama3-8b": LLAMA3_8B_CONFIG, "tiny": TINY_LLAMA_CONFIG}


def artifacts(work: Path, config: dict, num: int, rank: int, targets: tuple[str, ...]) -> list[memoryview]:
    """`num` distinct canonical artifacts, compiled as the registry and engine compile them, each in a
    writable buffer as a fetch or a local read hands it to `_pack` (bytes would be copied under the GIL)."""
    model_dir = work / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    specs = [(f"a{i}", write_random_peft_adapter(work / f"peft{i}", config, rank, seed=i, dtype=torch.bfloat16, targets=targets)) for i in range(num)]
    records = LocalAdapters.compile_all(specs, model_dir, "llama3-8b", rank, work / "compiled").records()
    return [memoryview(np.frombuffer(bytearray(Path(r.path).read_bytes()), np.uint8)) for r in records]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(CONFIGS))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 4, 20], help="packing threads per case")
    parser.add_argument("--targets", nargs="+", default=["q_proj", "v_proj"])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--distinct", type=int, default=4, help="distinct artifacts (each packed several times)")
    parser.add_argument("--packs", type=int, default=40, help="adapters packed per case")
    parser.add_argument("--ops", type=int, default=300, help="small tensor ops a loop iteration")
    parser.add_argument("--python-ms", type=float, default=0.0, help="pure Python a loop iteration (GIL held; 0: none, as before 2026-12-02)")
    parser.add_argument(
        "--torch-threads", type=int, default=0,
        help="torch's CPU threads (0: its default, one a core); more than the cores stand in for a host whose cores are busy",
    )  # fmt: skip
    parser.add_argument("--wait-ms", type=float, default=5.0, help="the iteration's GIL-free wait (a device step)")
    args = parser.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    config = CONFIGS[args.shape]
    shape = ModelShape.from_config(config)
    targets = {t.name: t for t in fused_targets(ModelConfig.from_hf(config), ())}
    served = frozenset(args.targets)
    with tempfile.TemporaryDirectory() as tmp:
        data = artifacts(Path(tmp), config, args.distinct, args.rank, tuple(args.targets))
    small = torch.zeros(64, dtype=torch.int64)
    ids = list(range(64))

    def iteration() -> float:
        """One stand-in step: host work, then the wait; returns the host part in ms."""
        started = time.perf_counter()
        while time.perf_counter() - started < args.python_ms / 1e3:
            pass
        for i in range(args.ops):
            t = torch.tensor(ids[: 1 + i % 64])
            small[: t.numel()].copy_(t)
        host = time.perf_counter() - started
        time.sleep(args.wait_ms / 1e3)  # the GIL is free while the device runs the step
        return host * 1e3

    def pack(artifact: memoryview) -> tuple[int, float]:
        """Pack one artifact; returns the packed bytes and the time it took (ms)."""
        started = time.perf_counter()
        adapter = read_canonical_within(artifact, shape, args.rank, "bench", served)
        packed = pack_adapter("d", adapter, targets, torch.bfloat16, pin=False)
        nbytes = sum(t.nbytes for t in (*packed.a.values(), *packed.b.values()))
        return nbytes, (time.perf_counter() - started) * 1e3

    def case(num_threads: int) -> dict:
        work: queue.Queue = queue.Queue()
        for i in range(args.packs if num_threads else 0):
            work.put(data[i % len(data)])
        packed: list[tuple[int, float]] = []  # (bytes, ms) of each adapter packed (list.append is atomic)

        def packer() -> None:
            while True:
                try:
                    artifact = work.get_nowait()
                except queue.Empty:
                    return
                packed.append(pack(artifact))

        threads = [threading.Thread(target=packer) for _ in range(num_threads)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        host_ms: list[float] = []
        if num_threads:
            while True:  # at least one iteration, however soon the packers finish
                host_ms.append(iteration())
                if not any(t.is_alive() for t in threads):
                    break
        else:
            host_ms = [iteration() for _ in range(200)]
        elapsed = time.perf_counter() - started
        return {
            "shape": args.shape, "pack_threads": num_threads, "torch_threads": torch.get_num_threads(), "targets": args.targets, "packs": len(packed),
            "packed_mb": sum(n for n, _ in packed) / 1e6 / max(1, len(packed)),
            "pack_ms_median": statistics.median(ms for _, ms in packed) if packed else None,
            "pack_ms_max": max((ms for _, ms in packed), default=None),
            "packs_per_s": len(packed) / elapsed if num_threads else None, "iterations": len(host_ms),
            "loop_host_ms_median": statistics.median(host_ms), "loop_host_ms_p99": float(np.percentile(host_ms, 99)),
            "loop_host_ms_max": max(host_ms),
        }  # fmt: skip

    pack(data[0])  # first-call costs out of the timings
    results = []
    for num_threads in [0, *args.threads]:
        results.append(case(num_threads))
        print(json.dumps(results[-1]), flush=True)
    return results


if __name__ == "__main__":
    main()
