"""Tune the decode LoRA kernels' tiles for this GPU and a model shape, and write them where the engine
looks them up (kernels/tuned.py: `kernels/configs/<device>.json`, or --out DIR for --kernel-configs).

    python benchmarks/tune_decode_lora.py --shape llama3-8b [--max-rank 64] [--tokens 1 16 32 64 128]

For each fused target of the shape and each token count, every candidate tile runs the way a decode step
runs it (engine/lora_inputs.py `project_deferred`): the base GEMM on the main stream under the SM
carve-out, the shrink and the delta on a side stream forked before it, the main stream joining; ten such
projections are captured in one CUDA graph and replayed. A tile's score is the geometric mean, over the
adapter groupings (--adapters: the step's rows spread over that many adapters, each adapter's rows merged
into one segment and the segments padded to the token count, as a captured decode graph holds them), of
its time over the built-in tile's. The shrink's tile is chosen first (with the built-in expand), then
the expand's; the few best of each first pass are timed again before the choice. A candidate whose
output differs from the built-in tile's is refused. One JSON line per (target, tokens, kernel) with the
built-in and the chosen time; the file keeps entries of other shapes and replaces these.

On the CPU (`--device cpu`, under TRITON_INTERPRET=1) it runs the same steps without streams or graphs,
timed by the clock: a smoke test of the tuner, not a tuning.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import DEFAULT_LORA_SM_CARVEOUT
from engine.lora_inputs import lora_segments, sm_carveout, usable_sm_carveout
from engine.lora_pool import FusedTarget, fused_targets
from engine.named_shapes import NAMED_SHAPES
from engine.parallel import TensorParallel, local_config
from kernels import tuned
from kernels.sgmv_decode import (
    BLOCK_K,
    BLOCK_N,
    DECODE_MAX_TOKENS,
    PROGRAMS_PER_SM,
    _num_sms,
    sgmv_expand_decode,
    sgmv_shrink_decode,
)
from kernels.sgmv_ref import SgmvMeta
from kernels.tuned import ExpandTile, ShrinkTile

GRAPH_CALLS = 10  # projections a captured graph holds
RETIMED = 4  # first-pass leaders timed again


def shrink_candidates(num_sms: int, num_stack: int, quick: bool) -> list[ShrinkTile]:
    """The built-in tile first, then program counts of 1-4 per SM in all x BLOCK_K x warps."""
    builtin = ShrinkTile(max(1, PROGRAMS_PER_SM * num_sms // num_stack), BLOCK_K, 4)
    per_sm = (1, 2) if quick else (1, 2, 3, 4)
    block_ks = (64, 128) if quick else (64, 128, 256)
    warps = (4,) if quick else (2, 4, 8)
    tiles = [
        ShrinkTile(max(1, p * num_sms // num_stack), k, w) for p in per_sm for k in block_ks for w in warps
    ]
    return [builtin, *(t for t in dict.fromkeys(tiles) if t != builtin)]


def expand_candidates(quick: bool) -> list[ExpandTile]:
    builtin = ExpandTile(BLOCK_N, 4)
    block_ns = (64, 128) if quick else (32, 64, 128, 256)
    warps = (4,) if quick else (1, 2, 4, 8)
    tiles = [ExpandTile(n, w) for n in block_ns for w in warps]
    return [builtin, *(t for t in tiles if t != builtin)]


def grouping(num_tokens: int, num_adapters: int) -> tuple[list[int], list[int]]:
    """Row i uses adapter slot 1 + i mod N, sorted by slot as the scheduler sorts a batch, merged into
    runs (`lora_segments`), then empty segments up to num_tokens: a captured decode graph's layout."""
    slots = sorted(1 + i % num_adapters for i in range(num_tokens))
    seg_lens, seg_slots = lora_segments([1] * num_tokens, slots)
    pad = num_tokens - len(seg_lens)
    return seg_lens + [0] * pad, seg_slots + [0] * pad


class Projection:
    """One fused target's decode projection at a token count: x, the base weight, the slots' A and B,
    and the step metadata of each grouping."""

    def __init__(
        self,
        target: FusedTarget,
        num_tokens: int,
        adapters: list[int],
        max_rank: int,
        rank: int,
        device,
        dtype,
        carveout: int,
    ):
        self.target, self.num_tokens, self.device, self.carveout = target, num_tokens, device, carveout
        num_slots = max(adapters) + 1  # slot 0: the base model
        gen = torch.Generator(device="cpu").manual_seed(num_tokens)

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

        self.x = randn(num_tokens, target.in_dim)
        self.w = randn(target.out_dim, target.in_dim, scale=target.in_dim**-0.5)
        self.a = randn(num_slots, target.num_stack * max_rank, target.in_dim, scale=target.in_dim**-0.5)
        self.b = randn(num_slots, target.out_dim, max_rank)
        ranks, scalings = [0] + [rank] * (num_slots - 1), [0.0] + [2.0] * (num_slots - 1)
        self.metas = {
            n: SgmvMeta.from_lists(*grouping(num_tokens, n), ranks, scalings, device) for n in adapters
        }
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def lora(self, meta: SgmvMeta, shrink: ShrinkTile, expand: ExpandTile) -> torch.Tensor:
        v = sgmv_shrink_decode(self.x, self.a, meta, num_stack=self.target.num_stack, tile=shrink)
        delta = torch.empty(self.num_tokens, self.target.out_dim, dtype=self.x.dtype, device=self.device)
        sgmv_expand_decode(
            v, self.b, meta, delta, output_slices=self.target.output_slices, tile=expand, overwrite=True
        )
        return delta

    def run(self, meta: SgmvMeta, shrink: ShrinkTile, expand: ExpandTile) -> None:
        """What `LoraInputs.project_deferred` enqueues for one projection of a decode step."""
        if self.side is None:
            self.x @ self.w.t()
            self.lora(meta, shrink, expand)
            return
        main = torch.cuda.current_stream(self.device)
        x_ready = main.record_event()
        with sm_carveout(self.carveout):
            self.x @ self.w.t()
        self.side.wait_event(x_ready)
        with torch.cuda.stream(self.side):
            self.lora(meta, shrink, expand)
        main.wait_stream(self.side)

    def time_us(self, meta: SgmvMeta, shrink: ShrinkTile, expand: ExpandTile, reps: int) -> float:
        """Median microseconds a projection."""
        return median_us(lambda: self.run(meta, shrink, expand), self.device, reps)

    def agrees(self, shrink: ShrinkTile, expand: ExpandTile, reference: dict[int, torch.Tensor]) -> bool:
        """Each grouping's delta within bf16 rounding of the built-in tiles' (splits sum in another order)."""
        for n, meta in self.metas.items():
            got, want = self.lora(meta, shrink, expand).float(), reference[n].float()
            if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item() + 1e-6):
                return False
        return True

    def gemm_us(self, reps: int) -> float:
        """The base GEMM alone (every SM), for the LoRA's share of the projection."""
        return median_us(lambda: self.x @ self.w.t(), self.device, reps)


def median_us(fn, device: torch.device, reps: int) -> float:
    """Median microseconds a call of `fn`: on CUDA GRAPH_CALLS calls captured in a graph (after one call
    outside it, which compiles and sets up cuBLAS), replayed `reps` times; elsewhere timed one by one."""
    if device.type != "cuda":
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e6)
        return statistics.median(samples)
    fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / GRAPH_CALLS)
    return statistics.median(samples)


def choose(proj: Projection, candidates: list, pair, reps: int) -> tuple[object, dict]:
    """The candidate with the least geometric-mean time over the groupings relative to candidates[0]
    (the built-in tile), after the first pass's leaders are timed again; `pair(c)` -> (shrink, expand)."""
    builtin = candidates[0]
    reference = {n: proj.lora(meta, *pair(builtin)) for n, meta in proj.metas.items()}

    def times(tile, num_reps: int) -> dict[int, float]:
        return {n: proj.time_us(meta, *pair(tile), num_reps) for n, meta in proj.metas.items()}

    def score(t: dict[int, float], base: dict[int, float]) -> float:
        return math.exp(statistics.fmean(math.log(t[n] / base[n]) for n in t))

    base = times(builtin, reps)
    first = {}
    for tile in candidates[1:]:
        if proj.agrees(*pair(tile), reference):
            first[tile] = score(times(tile, reps), base)
        else:
            print(
                f"# {proj.target.name} T={proj.num_tokens}: {tile} disagrees with the built-in tile; skipped",
                flush=True,
            )
    leaders = sorted(first, key=first.get)[:RETIMED]
    base = times(builtin, 3 * reps)
    final = {tile: times(tile, 3 * reps) for tile in leaders}
    best = min(final, key=lambda tile: score(final[tile], base), default=builtin)
    best_times = final.get(best, base)
    if score(best_times, base) >= 1.0:
        best, best_times = builtin, base
    return best, {  # by the grouping's adapter count, as JSON keys are strings
        "builtin_us": {str(n): round(t, 2) for n, t in base.items()},
        "chosen_us": {str(n): round(t, 2) for n, t in best_times.items()},
    }


def tune(args, device: torch.device) -> list[dict]:
    config = local_config(NAMED_SHAPES[args.shape], TensorParallel(0, args.tensor_parallel_size))
    dtype = getattr(torch, args.dtype)
    num_sms = _num_sms(device)
    carveout = usable_sm_carveout(args.lora_sm_carveout, num_sms) if device.type == "cuda" else 0
    entries, expands = [], {}  # expand shape -> its chosen tile: o and down expand alike at 8B
    for target in fused_targets(config):
        if args.targets and target.name not in args.targets:
            continue
        widest = max(size for _, size in target.output_slices)
        for num_tokens in args.tokens:
            adapters = sorted({min(n, num_tokens) for n in args.adapters})
            proj = Projection(target, num_tokens, adapters, args.max_rank, args.rank, device, dtype, carveout)
            measured = {"target": target.name, "gemm_alone_us": round(proj.gemm_us(args.reps), 2)}
            common = {"num_stack": target.num_stack, "max_rank": args.max_rank, "tokens": num_tokens}
            builtin_expand = expand_candidates(args.quick)[0]
            shrink, shrink_times = choose(
                proj,
                shrink_candidates(num_sms, target.num_stack, args.quick),
                lambda t, e=builtin_expand: (t, e),
                args.reps,
            )
            entries.append(
                {
                    "kernel": "shrink",
                    "in_dim": target.in_dim,
                    **common,
                    "config": asdict(shrink),
                    **measured,
                    **shrink_times,
                }
            )
            print(json.dumps(entries[-1]), flush=True)
            expand_key = (widest, target.num_stack, num_tokens)
            if expand_key in expands:
                continue
            expand, expand_times = choose(
                proj, expand_candidates(args.quick), lambda t, s=shrink: (s, t), args.reps
            )
            expands[expand_key] = expand
            entries.append(
                {
                    "kernel": "expand",
                    "out_dim": widest,
                    **common,
                    "config": asdict(expand),
                    **measured,
                    **expand_times,
                }
            )
            print(json.dumps(entries[-1]), flush=True)
    return entries


def write(path: Path, device_name: str, entries: list[dict]) -> None:
    """Merge into the file at `path` (entries of the same kernel, shape and tokens replaced), checked by
    the engine's own parser before it replaces the old file in one rename."""

    def key(entry: dict) -> tuple:
        return tuple(entry.get(k) for k in ("kernel", "in_dim", "out_dim", "num_stack", "max_rank", "tokens"))

    old = json.loads(path.read_text())["entries"] if path.is_file() else []
    new_keys = {key(e) for e in entries}
    doc = {
        "device": device_name,
        "triton": triton.__version__,
        "torch": torch.__version__,
        "made_by": "benchmarks/tune_decode_lora.py",
        "entries": [e for e in old if key(e) not in new_keys] + entries,
    }
    tuned.parse(doc, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> tuple[Path, list[dict]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(NAMED_SHAPES))
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="tune one rank's shard of the shape"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--targets", nargs="*", default=[], help="fused targets to tune (default: all)")
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128], help="decode batch sizes"
    )
    parser.add_argument(
        "--adapters", type=int, nargs="+", default=[1, 8, 32], help="groupings scored together"
    )
    parser.add_argument("--max-rank", type=int, default=64, help="the slots' capacity (--max-lora-rank)")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    parser.add_argument("--lora-sm-carveout", type=int, default=DEFAULT_LORA_SM_CARVEOUT)
    parser.add_argument("--reps", type=int, default=5, help="graph replays a timing (the leaders get 3x)")
    parser.add_argument("--quick", action="store_true", help="a few candidates only")
    parser.add_argument(
        "--out", default="", help="directory to write <device>.json in (default: kernels/configs)"
    )
    args = parser.parse_args(argv)
    if any(not 1 <= t <= DECODE_MAX_TOKENS for t in args.tokens) or any(n < 1 for n in args.adapters):
        parser.error(f"--tokens must be 1-{DECODE_MAX_TOKENS} and --adapters >= 1")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.preferred_blas_library("cublaslt")  # as the engine's workers (engine/worker.py)
    entries = tune(args, device)
    name = tuned.device_name(device)
    path = Path(args.out or tuned.DEFAULT_DIR) / tuned.device_file_name(name)
    write(path, name, entries)
    print(f"# wrote {len(entries)} entries to {path}", flush=True)
    return path, entries


if __name__ == "__main__":
    main()
