"""Tune the LoRA kernels' tiles for this GPU and a model shape, and write them where the engine looks
them up (kernels/tuned.py: `kernels/configs/<device>.json`, or --out DIR for --kernel-configs).

    python benchmarks/tune_lora_tiles.py --shape llama3-8b [--max-rank 64] [--kernels shrink expand]

For each fused target of the shape, each kernel and each token count, every candidate tile runs the way
the engine runs it, ten projections captured in one CUDA graph and replayed:
- decode-sized steps ("shrink", "expand": kernels/sgmv_decode.py) as `LoraInputs.project_deferred` does:
  the base GEMM on the main stream under the SM carve-out, the shrink and the delta on a side stream
  forked before it, the main stream joining. The step's rows spread over --adapters adapters, each
  adapter's rows merged into one segment and the segments padded to the token count, as a captured
  decode graph holds them.
- prefill-sized steps ("sgmv_shrink", "sgmv_expand": kernels/sgmv.py) in line, the shrink then the
  expand into the projection's output; the step's rows in --prefill-segments requests of one adapter
  each.
A tile's score is the geometric mean over those groupings of its time over the built-in tile's. A
kernel's shrink is chosen first (with the built-in expand), then its expand; the first pass's leaders
are timed again before the choice, and a tile that is not faster than the built-in one is not chosen.
A candidate whose output differs from the built-in tile's, or that does not compile, is left out. One
JSON line per entry with the built-in and the chosen times (and the base GEMM alone, for scale); the
file, rewritten after each target, keeps the entries of other shapes and replaces these.

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
from collections.abc import Callable
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
from kernels.sgmv import _expand_config, _shrink_config, sgmv_expand, sgmv_shrink
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
from kernels.tuned import ExpandTile, SgmvTile, ShrinkTile

GRAPH_CALLS = 10  # projections a captured graph holds
RETIMED = 4  # first-pass leaders timed again
KERNELS = ("shrink", "expand", "sgmv_shrink", "sgmv_expand")


# ---- candidates (the built-in tile first) -----------------------------------------------------------


def decode_shrink_tiles(num_sms: int, num_stack: int, quick: bool) -> list[ShrinkTile]:
    builtin = ShrinkTile(max(1, PROGRAMS_PER_SM * num_sms // num_stack), BLOCK_K, 4)
    per_sm = (1, 2) if quick else (1, 2, 3, 4)
    block_ks = (64, 128) if quick else (64, 128, 256)
    warps = (4,) if quick else (2, 4, 8)
    tiles = [ShrinkTile(max(1, p * num_sms // num_stack), k, w) for p in per_sm for k in block_ks for w in warps]
    return [builtin, *(t for t in dict.fromkeys(tiles) if t != builtin)]


def decode_expand_tiles(quick: bool) -> list[ExpandTile]:
    builtin = ExpandTile(BLOCK_N, 4)
    block_ns = (64, 128) if quick else (32, 64, 128, 256)
    warps = (4,) if quick else (1, 2, 4, 8)
    return [builtin, *(t for t in (ExpandTile(n, w) for n in block_ns for w in warps) if t != builtin)]


def _as_tile(config: dict) -> SgmvTile:
    return SgmvTile(config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config["num_warps"], config["num_stages"])


# Built-in prefill tiles as tuned tiles: read for the longest segments (64 rows a program), a tile
# gives each step the rows the built-in choice would (kernels/sgmv.py `_tile_config`).
LONGEST = 1 << 30


def sgmv_shrink_tiles(max_rank: int, quick: bool) -> list[SgmvTile]:
    builtin = _as_tile(_shrink_config(LONGEST, max_rank))
    if quick:
        grid = [(m, 16, 64, 4, 3) for m in (32, 64)]
    else:  # block_n 16: one rank-16 tile a program (the built-in tile is the slot's capacity wide)
        grid = [(m, n, k, w, s) for m in (32, 64, 128) for n in (16, 64) for k in (64, 128) for w in (4, 8) for s in (3, 4)]
    return [builtin, *(t for t in dict.fromkeys(SgmvTile(*g) for g in grid) if t != builtin)]


def sgmv_expand_tiles(max_rank: int, quick: bool) -> list[SgmvTile]:
    builtin = _as_tile(_expand_config(LONGEST, max_rank))
    if quick:
        grid = [(m, 64, 16, 4, 2) for m in (32, 64)]
    else:
        grid = [(m, n, k, w, s) for m in (32, 64, 128) for n in (64, 128, 256) for k in (16, 32) for w in (4, 8) for s in (2, 3)]
    return [builtin, *(t for t in dict.fromkeys(SgmvTile(*g) for g in grid) if t != builtin)]


# ---- the work a step gives one projection -----------------------------------------------------------


def decode_grouping(num_tokens: int, num_adapters: int) -> tuple[list[int], list[int]]:
    """Row i uses adapter slot 1 + i mod N, sorted by slot as the scheduler sorts a batch, merged into
    runs (`lora_segments`), then empty segments up to num_tokens: a captured decode graph's layout."""
    slots = sorted(1 + i % num_adapters for i in range(num_tokens))
    seg_lens, seg_slots = lora_segments([1] * num_tokens, slots)
    pad = num_tokens - len(seg_lens)
    return seg_lens + [0] * pad, seg_slots + [0] * pad


def prefill_grouping(num_tokens: int, num_segments: int) -> tuple[list[int], list[int]]:
    """num_segments requests of (nearly) equal length, each with an adapter of its own."""
    base, extra = divmod(num_tokens, num_segments)
    return [base + (i < extra) for i in range(num_segments)], list(range(1, num_segments + 1))


class Projection:
    """One fused target at a token count: x, the base weight, the slots' A and B, and the step metadata
    of each grouping (decode or prefill layout)."""

    def __init__(self, target: FusedTarget, num_tokens: int, groupings: dict[int, tuple[list[int], list[int]]], args, device, carveout: int):
        self.target, self.num_tokens, self.device, self.carveout = target, num_tokens, device, carveout
        num_slots = 1 + max(max(slots) for _, slots in groupings.values())  # slot 0: the base model
        gen = torch.Generator(device="cpu").manual_seed(num_tokens)
        dtype = getattr(torch, args.dtype)

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

        self.x = randn(num_tokens, target.in_dim)
        self.w = randn(target.out_dim, target.in_dim, scale=target.in_dim**-0.5)
        self.a = randn(num_slots, target.num_stack * args.max_rank, target.in_dim, scale=target.in_dim**-0.5)
        self.b = randn(num_slots, target.out_dim, args.max_rank)
        self.y = randn(num_tokens, target.out_dim)
        ranks, scalings = [0] + [args.rank] * (num_slots - 1), [0.0] + [2.0] * (num_slots - 1)
        self.metas = {n: SgmvMeta.from_lists(*g, ranks, scalings, device) for n, g in groupings.items()}
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def decode_lora(self, meta: SgmvMeta, shrink: ShrinkTile, expand: ExpandTile) -> torch.Tensor:
        v = sgmv_shrink_decode(self.x, self.a, meta, num_stack=self.target.num_stack, tile=shrink)
        delta = torch.empty(self.num_tokens, self.target.out_dim, dtype=self.x.dtype, device=self.device)
        sgmv_expand_decode(v, self.b, meta, delta, output_slices=self.target.output_slices, tile=expand, overwrite=True)
        return delta

    def decode_step(self, meta: SgmvMeta, shrink: ShrinkTile, expand: ExpandTile) -> None:
        """What `LoraInputs.project_deferred` enqueues for one projection of a decode step."""
        if self.side is None:
            self.x @ self.w.t()
            self.decode_lora(meta, shrink, expand)
            return
        main = torch.cuda.current_stream(self.device)
        x_ready = main.record_event()
        with sm_carveout(self.carveout):
            self.x @ self.w.t()
        self.side.wait_event(x_ready)
        with torch.cuda.stream(self.side):
            self.decode_lora(meta, shrink, expand)
        main.wait_stream(self.side)

    def prefill_lora(self, meta: SgmvMeta, shrink: SgmvTile, expand: SgmvTile) -> torch.Tensor:
        """A prefill step's in-line LoRA: the shrink, then the expand adding into the output (a fresh copy
        of it, so every candidate adds to the same values)."""
        v = sgmv_shrink(self.x, self.a, meta, num_stack=self.target.num_stack, tile=shrink)
        y = self.y.clone()
        sgmv_expand(v, self.b, meta, y, output_slices=self.target.output_slices, tile=expand)
        return y

    def prefill_step(self, meta: SgmvMeta, shrink: SgmvTile, expand: SgmvTile) -> None:
        v = sgmv_shrink(self.x, self.a, meta, num_stack=self.target.num_stack, tile=shrink)
        sgmv_expand(v, self.b, meta, self.y, output_slices=self.target.output_slices, tile=expand)


def median_us(fn: Callable[[], object], device: torch.device, reps: int) -> float:
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


def choose(proj: Projection, candidates: list, step: Callable, result: Callable, reps: int) -> tuple[object, dict]:
    """The candidate with the least geometric-mean time over the groupings relative to candidates[0]
    (the built-in tile), after the first pass's leaders are timed again. step(meta, tile) runs the
    projection; result(meta, tile) is what it computes, checked against the built-in tile's."""
    builtin = candidates[0]
    reference = {n: result(meta, builtin).float() for n, meta in proj.metas.items()}

    def times(tile, num_reps: int) -> dict[int, float]:
        return {n: median_us(lambda m=meta: step(m, tile), proj.device, num_reps) for n, meta in proj.metas.items()}

    def score(t: dict[int, float], base: dict[int, float]) -> float:
        return math.exp(statistics.fmean(math.log(t[n] / base[n]) for n in t))

    def agrees(tile) -> bool:
        for n, meta in proj.metas.items():
            got, want = result(meta, tile).float(), reference[n]
            if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item() + 1e-6):
                return False
        return True

    base = times(builtin, reps)
    first = {}
    for tile in candidates[1:]:
        try:
            ok = agrees(tile)
            if ok:
                first[tile] = score(times(tile, reps), base)
        except Exception as exc:  # a tile the compiler or the device refuses (shared memory, registers)
            print(f"# {proj.target.name} T={proj.num_tokens}: {tile} failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        if not ok:
            print(f"# {proj.target.name} T={proj.num_tokens}: {tile} disagrees with the built-in tile; left out", flush=True)
    leaders = sorted(first, key=first.get)[:RETIMED]
    base = times(builtin, 3 * reps)
    final = {tile: times(tile, 3 * reps) for tile in leaders}
    best = min(final, key=lambda tile: score(final[tile], base), default=builtin)
    best_times = final.get(best, base)
    if score(best_times, base) >= 1.0:
        best, best_times = builtin, base
    return best, {  # by grouping (adapters, or prefill segments), as JSON keys are strings
        "builtin_us": {str(n): round(t, 2) for n, t in base.items()},
        "chosen_us": {str(n): round(t, 2) for n, t in best_times.items()},
    }


# ---- the tuning -------------------------------------------------------------------------------------


def tune_decode(target: FusedTarget, num_tokens: int, args, device, carveout: int, expand_done: set) -> list[dict]:
    groupings = {n: decode_grouping(num_tokens, n) for n in sorted({min(n, num_tokens) for n in args.adapters})}
    proj = Projection(target, num_tokens, groupings, args, device, carveout)
    common = {"num_stack": target.num_stack, "max_rank": args.max_rank, "tokens": num_tokens}
    measured = {"target": target.name, "gemm_alone_us": round(median_us(lambda: proj.x @ proj.w.t(), device, args.reps), 2)}
    entries = []
    builtin_expand = decode_expand_tiles(args.quick)[0]
    shrink = decode_shrink_tiles(_num_sms(device), target.num_stack, args.quick)[0]
    if "shrink" in args.kernels:
        shrink, timed = choose(
            proj, decode_shrink_tiles(_num_sms(device), target.num_stack, args.quick),
            lambda meta, tile: proj.decode_step(meta, tile, builtin_expand),
            lambda meta, tile: proj.decode_lora(meta, tile, builtin_expand), args.reps,
        )  # fmt: skip
        entries.append({"kernel": "shrink", "in_dim": target.in_dim, **common, "config": asdict(shrink), **measured, **timed})
    widest = max(size for _, size in target.output_slices)
    if "expand" in args.kernels and ("expand", widest, target.num_stack, num_tokens) not in expand_done:
        expand_done.add(("expand", widest, target.num_stack, num_tokens))  # o and down expand alike at 8B
        expand, timed = choose(
            proj, decode_expand_tiles(args.quick),
            lambda meta, tile: proj.decode_step(meta, shrink, tile),
            lambda meta, tile: proj.decode_lora(meta, shrink, tile), args.reps,
        )  # fmt: skip
        entries.append({"kernel": "expand", "out_dim": widest, **common, "config": asdict(expand), **measured, **timed})
    return entries


def tune_prefill(target: FusedTarget, num_tokens: int, args, device, expand_done: set) -> list[dict]:
    counts = sorted({min(n, num_tokens) for n in args.prefill_segments})
    groupings = {n: prefill_grouping(num_tokens, n) for n in counts}
    proj = Projection(target, num_tokens, groupings, args, device, 0)
    common = {"num_stack": target.num_stack, "max_rank": args.max_rank, "tokens": num_tokens}
    measured = {"target": target.name, "gemm_alone_us": round(median_us(lambda: proj.x @ proj.w.t(), device, args.reps), 2)}
    entries = []
    builtin_expand = sgmv_expand_tiles(args.max_rank, args.quick)[0]
    shrink = sgmv_shrink_tiles(args.max_rank, args.quick)[0]
    if "sgmv_shrink" in args.kernels:
        shrink, timed = choose(
            proj, sgmv_shrink_tiles(args.max_rank, args.quick),
            lambda meta, tile: proj.prefill_step(meta, tile, builtin_expand),
            lambda meta, tile: proj.prefill_lora(meta, tile, builtin_expand), args.reps,
        )  # fmt: skip
        entries.append({"kernel": "sgmv_shrink", "in_dim": target.in_dim, **common, "config": asdict(shrink), **measured, **timed})
    widest = max(size for _, size in target.output_slices)
    if "sgmv_expand" in args.kernels and ("sgmv_expand", widest, target.num_stack, num_tokens) not in expand_done:
        expand_done.add(("sgmv_expand", widest, target.num_stack, num_tokens))
        expand, timed = choose(
            proj, sgmv_expand_tiles(args.max_rank, args.quick),
            lambda meta, tile: proj.prefill_step(meta, shrink, tile),
            lambda meta, tile: proj.prefill_lora(meta, shrink, tile), args.reps,
        )  # fmt: skip
        entries.append({"kernel": "sgmv_expand", "out_dim": widest, **common, "config": asdict(expand), **measured, **timed})
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
        "made_by": "benchmarks/tune_lora_tiles.py",
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
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="tune one rank's shard of the shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    parser.add_argument("--targets", nargs="*", default=[], help="fused targets to tune (default: all)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128], help="decode batch sizes")
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 8, 32], help="decode groupings scored together")
    parser.add_argument("--prefill-tokens", type=int, nargs="+", default=[256, 1024, 2048, 8192])
    parser.add_argument("--prefill-segments", type=int, nargs="+", default=[1, 4, 16], help="prefill groupings")
    parser.add_argument("--max-rank", type=int, default=64, help="the slots' capacity (--max-lora-rank)")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    parser.add_argument("--lora-sm-carveout", type=int, default=DEFAULT_LORA_SM_CARVEOUT)
    parser.add_argument("--reps", type=int, default=5, help="graph replays a timing (the leaders get 3x)")
    parser.add_argument("--quick", action="store_true", help="a few candidates only")
    parser.add_argument("--out", default="", help="directory to write <device>.json in (default: kernels/configs)")
    args = parser.parse_args(argv)
    if any(not 1 <= t <= DECODE_MAX_TOKENS for t in args.tokens) or min(args.adapters + args.prefill_segments) < 1:
        parser.error(f"--tokens must be 1-{DECODE_MAX_TOKENS}, --adapters and --prefill-segments >= 1")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.preferred_blas_library("cublaslt")  # as the engine's workers (engine/worker.py)
    config = local_config(NAMED_SHAPES[args.shape], TensorParallel(0, args.tensor_parallel_size))
    carveout = usable_sm_carveout(args.lora_sm_carveout, _num_sms(device)) if device.type == "cuda" else 0
    name = tuned.device_name(device)
    path = Path(args.out or tuned.DEFAULT_DIR) / tuned.device_file_name(name)
    entries, expand_done = [], set()
    for target in fused_targets(config):
        if args.targets and target.name not in args.targets:
            continue
        if {"shrink", "expand"} & set(args.kernels):
            for num_tokens in args.tokens:
                entries += tune_decode(target, num_tokens, args, device, carveout, expand_done)
        if {"sgmv_shrink", "sgmv_expand"} & set(args.kernels):
            for num_tokens in args.prefill_tokens:
                entries += tune_prefill(target, num_tokens, args, device, expand_done)
        for entry in entries:
            if entry.get("target") == target.name:
                print(json.dumps(entry), flush=True)
        write(path, name, entries)  # after each target: a run cut short keeps what it tuned
    print(f"# wrote {len(entries)} entries to {path}", flush=True)
    return path, entries


if __name__ == "__main__":
    main()
