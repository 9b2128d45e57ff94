"""Tune the LoRA kernels' tiles for this GPU and a model shape, and write them where the engine looks
them up (lorakernels/tuned.py: `lorakernels/configs/<device>.json`, or --out DIR for --kernel-configs).

    python benchmarks/tune_lora_tiles.py --shape llama3-8b --max-rank 64 [--kernels shrink expand]

For each fused target of the shape, each kernel and each token count, every candidate tile runs as the
engine's CUDA graphs run it; ten projections, each over its own copy of the weights (as a step's layers
read theirs from memory, not from L2), are captured in one graph and replayed:
- decode steps ("shrink", "expand": lorakernels/sgmv_decode.py) as `LoraInputs.project_deferred` runs them:
  the base GEMM on the main stream under the SM carve-out, the shrink and the delta on a side stream
  forked before it, the main stream joining. The rows spread over --adapters adapters, sorted by slot
  and merged into runs of at most DECODE_RUN rows, the segments padded to the batch: a decode graph's
  layout (engine/cuda_graphs.py).
- prefill and mixed steps ("sgmv_shrink", "sgmv_expand": lorakernels/sgmv.py) in line, the shrink then the
  expand into the projection's output: --prefill-segments prompts of one adapter each, and a mixed step
  (63 decode rows beside one prompt chunk), with the metadata a step graph captures for steps up to
  --graph-max-tokens (every segment slot, max_seg_len the token count: engine/step_graphs.py). gate/up's
  expand is not tuned at ranks the SiLU-mul kernel takes it over (lorakernels/silu_mul.py).
A tile's score is the geometric mean over those groupings of its time over the built-in tile's. The
shrink is chosen first (with the built-in expand), then the expand. The first pass's leaders are timed
again; a leader is chosen only if it beats the built-in tile by MARGIN and is not more than WORST slower
in any grouping. A candidate whose output differs from the built-in tile's, or that does not compile,
is left out. One JSON line per entry (the built-in and chosen times, the base GEMM alone for scale); the
file, rewritten after each target, keeps the entries of other shapes and replaces these.

On the CPU (`--device cpu`, under TRITON_INTERPRET=1) it runs the same steps without streams or graphs,
timed by the clock: a smoke test of the tuner, not a tuning.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import DEFAULT_LORA_SM_CARVEOUT
from engine.cuda_graphs import DECODE_RUN
from engine.lora_inputs import lora_segments, sm_carveout, usable_sm_carveout
from engine.lora_pool import FusedTarget, fused_targets
from engine.named_shapes import NAMED_SHAPES
from engine.parallel import TensorParallel, local_config
from lorakernels import tuned
from lorakernels.sgmv import builtin_tile, sgmv_expand, sgmv_shrink
from lorakernels.sgmv_decode import (
    BUILTIN_EXPAND,
    DECODE_MAX_TOKENS,
    _num_sms,
    builtin_shrink_tile,
    sgmv_expand_decode,
    sgmv_shrink_decode,
)
from lorakernels.sgmv_ref import SgmvMeta
from lorakernels.silu_mul import FUSED_MAX_RANK
from lorakernels.tuned import ExpandTile, SgmvTile, ShrinkTile, graph_median_us

GRAPH_CALLS = 10  # projections a captured graph holds
RETIMED = 4  # first-pass leaders timed again
MARGIN = 0.02  # a tile must beat the built-in one by this (geometric mean over the groupings)
WORST = 1.05  # and be at most this much slower than it in any grouping
DECODE_KERNELS, PREFILL_KERNELS = ("shrink", "expand"), ("sgmv_shrink", "sgmv_expand")
MIXED_DECODE_ROWS = 63  # a mixed step: a full batch's other requests decoding beside one prompt chunk


# ---- candidates (the built-in tile first) -----------------------------------------------------------


def decode_shrink_tiles(num_stack: int, device: torch.device, quick: bool) -> list[ShrinkTile]:
    builtin = builtin_shrink_tile(num_stack, device)
    per_sm = (1, 2) if quick else (1, 2, 3, 4)
    block_ks = (64, 128) if quick else (64, 128, 256)
    warps = (4,) if quick else (2, 4, 8)
    num_sms = _num_sms(device)
    tiles = [ShrinkTile(max(1, p * num_sms // num_stack), k, w) for p in per_sm for k in block_ks for w in warps]
    return [builtin, *(t for t in dict.fromkeys(tiles) if t != builtin)]


def decode_expand_tiles(quick: bool) -> list[ExpandTile]:
    block_ns = (64, 128) if quick else (32, 64, 128, 256)
    warps = (4,) if quick else (1, 2, 4, 8)
    return [BUILTIN_EXPAND, *(t for t in (ExpandTile(n, w) for n in block_ns for w in warps) if t != BUILTIN_EXPAND)]


def sgmv_tiles(is_shrink: bool, max_rank: int, quick: bool) -> list[SgmvTile]:
    """The built-in tile, then rows x columns x K x warps x stages (shrink columns 16: one rank-16 tile a
    program, where the built-in tile is the slot's capacity wide; expand K 16 or 32: the rank), and for
    the shrink a few tiles split 2, 4 or 8 ways over in_dim (more programs where row blocks are few),
    those within the parser's shared-memory bound."""
    builtin = builtin_tile(is_shrink, max_rank)
    if quick:
        grid = [(m, 16, 64, 4, 3) if is_shrink else (m, 64, 16, 4, 2) for m in (32, 64)]
        grid += [(64, 16, 128, 4, 3, split) for split in (2, 4, 8)] if is_shrink else []
    elif is_shrink:
        grid = [(m, n, k, w, s) for m in (32, 64, 128) for n in (16, 64) for k in (64, 128) for w in (4, 8) for s in (3, 4)]
        grid += [(m, 16, 128, 4, 3, split) for m in (32, 64) for split in (2, 4, 8)]
    else:
        grid = [(m, n, k, w, s) for m in (32, 64, 128) for n in (64, 128, 256) for k in (16, 32) for w in (4, 8) for s in (2, 3)]
    tiles = (SgmvTile(*g) for g in grid)
    return [builtin, *(t for t in dict.fromkeys(tiles) if t != builtin and t.smem_bytes <= tuned.SGMV_SMEM_BYTES)]


# ---- the work a step gives one projection -----------------------------------------------------------


def decode_grouping(num_tokens: int, num_adapters: int) -> tuple[list[int], list[int]]:
    """Row i uses adapter slot 1 + i mod N, sorted by slot as the scheduler sorts a batch, merged into
    runs of at most DECODE_RUN rows, then empty segments up to num_tokens: a decode graph's layout."""
    slots = sorted(1 + i % num_adapters for i in range(num_tokens))
    seg_lens, seg_slots = lora_segments([1] * num_tokens, slots, DECODE_RUN)
    pad = num_tokens - len(seg_lens)
    return seg_lens + [0] * pad, seg_slots + [0] * pad


def prefill_grouping(num_tokens: int, name: str) -> tuple[list[int], list[int]]:
    """`name` prompts of (nearly) equal length with an adapter each, or "mixed": MIXED_DECODE_ROWS
    decode rows over 8 adapters beside one prompt chunk of the rest (its own adapter)."""
    if name == "mixed":
        lens = [num_tokens - MIXED_DECODE_ROWS] + [1] * MIXED_DECODE_ROWS
        return lora_segments(lens, [1] + [2 + i % 8 for i in range(MIXED_DECODE_ROWS)])
    base, extra = divmod(num_tokens, int(name))
    return [base + (i < extra) for i in range(int(name))], list(range(1, int(name) + 1))


def graph_meta(seg_lens: list[int], slots: list[int], ranks: list[int], scalings: list[float], num_segments: int, device) -> SgmvMeta:
    """The metadata a step graph captures with (engine/step_graphs.py): num_segments segment slots, the
    step's own in front, and max_seg_len its token count, so its tiles' rows are the tiles' own."""
    pad = num_segments - len(seg_lens)
    meta = SgmvMeta.from_lists(seg_lens + [0] * pad, slots + [0] * pad, ranks, scalings, device)
    return dataclasses.replace(meta, max_seg_len=sum(seg_lens), host_seg_lens=None, host_slots=None)


class Projection:
    """One fused target at a token count: x, the output y, GRAPH_CALLS copies (one on the CPU) of the
    base weight and of the slots' A and B, and each grouping's step metadata."""

    def __init__(self, target: FusedTarget, num_tokens: int, metas: dict[str, SgmvMeta], num_slots: int, args, device, carveout: int = 0):
        self.target, self.num_tokens, self.device, self.carveout, self.metas = target, num_tokens, device, carveout, metas
        gen = torch.Generator(device="cpu").manual_seed(num_tokens)
        dtype = getattr(torch, args.dtype)

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

        self.x = randn(num_tokens, target.in_dim)
        self.y0 = randn(num_tokens, target.out_dim)  # what the prefill expand adds to, for the results
        self.y = self.y0.clone()  # what timed prefill steps add to
        self.copies = [
            (randn(target.out_dim, target.in_dim, scale=target.in_dim**-0.5),
             randn(num_slots, target.num_stack * args.max_rank, target.in_dim, scale=target.in_dim**-0.5),
             randn(num_slots, target.out_dim, args.max_rank))
            for _ in range(GRAPH_CALLS if device.type == "cuda" else 1)
        ]  # fmt: skip
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def gemm(self, i: int = 0) -> None:
        self.x @ self.copies[i % len(self.copies)][0].t()

    def decode_lora(self, meta: SgmvMeta, shrink: ShrinkTile, expand: ExpandTile, i: int = 0) -> torch.Tensor:
        _, a, b = self.copies[i % len(self.copies)]
        v = sgmv_shrink_decode(self.x, a, meta, num_stack=self.target.num_stack, tile=shrink)
        delta = torch.empty(self.num_tokens, self.target.out_dim, dtype=self.x.dtype, device=self.device)
        sgmv_expand_decode(v, b, meta, delta, output_slices=self.target.output_slices, tile=expand, overwrite=True)
        return delta

    def decode_step(self, meta: SgmvMeta, shrink: ShrinkTile, expand: ExpandTile, i: int) -> None:
        """What `LoraInputs.project_deferred` enqueues for one projection of a decode step."""
        self.beside_gemm(lambda: self.decode_lora(meta, shrink, expand, i), i)

    def beside_gemm(self, lora: Callable[[], object], i: int, gemm: Callable[[int], object] | None = None, after: Callable[[int], object] | None = None) -> None:
        """The i-th GEMM (gemm(i), the projection's own by default) under the carve-out and lora() on the
        side stream beside it, then after(i) on the main stream with every SM, joined (in line on the CPU)."""
        gemm = self.gemm if gemm is None else gemm
        if self.side is None:
            gemm(i)
            lora()
        else:
            main = torch.cuda.current_stream(self.device)
            x_ready = main.record_event()
            with sm_carveout(self.carveout):
                gemm(i)
            self.side.wait_event(x_ready)
            with torch.cuda.stream(self.side):
                lora()
        if after is not None:
            after(i)
        if self.side is not None:
            main.wait_stream(self.side)

    def prefill_lora(self, meta: SgmvMeta, shrink: SgmvTile, expand: SgmvTile, i: int = 0, y: torch.Tensor | None = None) -> torch.Tensor:
        """A prefill step's in-line LoRA, the shrink then the expand adding into y (a copy of y0: the
        result every candidate must reproduce)."""
        _, a, b = self.copies[i % len(self.copies)]
        y = self.y0.clone() if y is None else y
        v = sgmv_shrink(self.x, a, meta, num_stack=self.target.num_stack, tile=shrink)
        sgmv_expand(v, b, meta, y, output_slices=self.target.output_slices, tile=expand)
        return y

    def prefill_step(self, meta: SgmvMeta, shrink: SgmvTile, expand: SgmvTile, i: int) -> None:
        self.prefill_lora(meta, shrink, expand, i, self.y)


def median_us(fn: Callable[[int], object], device: torch.device, reps: int) -> float:
    """Median microseconds a call of fn(i): on CUDA fn(0..GRAPH_CALLS-1) captured in one graph (after one
    call outside it, which compiles and sets up cuBLAS), replayed `reps` times; elsewhere timed one by one."""
    if device.type != "cuda":
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            fn(0)
            samples.append((time.perf_counter() - start) * 1e6)
        return statistics.median(samples)
    return graph_median_us(fn, device, GRAPH_CALLS, reps)


def choose(proj: Projection, candidates: list, step: Callable, result: Callable, reps: int) -> tuple[object, dict]:
    """The best candidate against candidates[0] (the built-in tile): step(meta, tile, i) runs the
    projection, result(meta, tile) is what it computes. A candidate that fails or disagrees in eager
    calls (where Triton compiles) is left out; a failure while timing stops the run."""
    builtin = candidates[0]
    reference = {n: result(meta, builtin).float() for n, meta in proj.metas.items()}

    def times(tile, num_reps: int) -> dict[str, float]:
        return {n: median_us(lambda i, m=meta: step(m, tile, i), proj.device, num_reps) for n, meta in proj.metas.items()}

    def ratios(t: dict[str, float], base: dict[str, float]) -> list[float]:
        return [t[n] / base[n] for n in t]

    def score(t: dict[str, float], base: dict[str, float]) -> float:
        return math.exp(statistics.fmean(math.log(r) for r in ratios(t, base)))

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
        except Exception as exc:  # a tile the compiler or the device refuses (shared memory, registers)
            print(f"# {proj.target.name} T={proj.num_tokens}: {tile} failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        if not ok:
            print(f"# {proj.target.name} T={proj.num_tokens}: {tile} disagrees with the built-in tile; left out", flush=True)
            continue
        first[tile] = score(times(tile, reps), base)
    leaders = sorted(first, key=first.get)[:RETIMED]
    base = times(builtin, 3 * reps)
    final = {tile: times(tile, 3 * reps) for tile in leaders}
    good = [t for t in leaders if score(final[t], base) <= 1 - MARGIN and max(ratios(final[t], base)) <= WORST]
    best = min(good, key=lambda t: score(final[t], base), default=builtin)
    return best, {  # by grouping (decode adapters, prefill prompts or "mixed")
        "builtin_us": {n: round(t, 2) for n, t in base.items()},
        "chosen_us": {n: round(t, 2) for n, t in final.get(best, base).items()},
    }


# ---- the tuning -------------------------------------------------------------------------------------


def tune_decode(target: FusedTarget, num_tokens: int, args, device, carveout: int, done: set) -> list[dict]:
    counts = sorted({min(n, num_tokens) for n in args.adapters})
    ranks, scalings = [0] + [args.rank] * max(counts), [0.0] + [2.0] * max(counts)
    metas = {str(n): SgmvMeta.from_lists(*decode_grouping(num_tokens, n), ranks, scalings, device) for n in counts}
    proj = Projection(target, num_tokens, metas, len(ranks), args, device, carveout)
    shrinks, expands = decode_shrink_tiles(target.num_stack, device, args.quick), decode_expand_tiles(args.quick)
    return tune_pair(
        proj, args, done, ("shrink", "expand"), (shrinks, expands),
        lambda meta, s, e, i: proj.decode_step(meta, s, e, i), lambda meta, s, e: proj.decode_lora(meta, s, e),
    )  # fmt: skip


def tune_prefill(target: FusedTarget, num_tokens: int, args, device, done: set) -> list[dict]:
    names = [str(n) for n in sorted({min(n, num_tokens) for n in args.prefill_segments})]
    names += ["mixed"] if num_tokens > 2 * MIXED_DECODE_ROWS else []
    groupings = {name: prefill_grouping(num_tokens, name) for name in names}
    num_slots = 1 + max(max(slots) for _, slots in groupings.values())
    ranks, scalings = [0] + [args.rank] * (num_slots - 1), [0.0] + [2.0] * (num_slots - 1)
    if num_tokens <= args.graph_max_tokens:  # a step graph's metadata: every segment slot a step may use
        segment_slots = min(num_tokens, max(args.max_running, *(len(g[0]) for g in groupings.values())))
        metas = {n: graph_meta(*g, ranks, scalings, segment_slots, device) for n, g in groupings.items()}
    else:
        metas = {n: SgmvMeta.from_lists(*g, ranks, scalings, device) for n, g in groupings.items()}
    proj = Projection(target, num_tokens, metas, num_slots, args, device)
    kernels = ("sgmv_shrink", "sgmv_expand")
    if target.name == "gate_up" and args.max_rank <= FUSED_MAX_RANK:  # its expand is the SiLU-mul kernel's
        kernels = ("sgmv_shrink", None)
    tiles = (sgmv_tiles(True, args.max_rank, args.quick), sgmv_tiles(False, args.max_rank, args.quick))
    return tune_pair(
        proj, args, done, kernels, tiles,
        lambda meta, s, e, i: proj.prefill_step(meta, s, e, i), lambda meta, s, e: proj.prefill_lora(meta, s, e),
    )  # fmt: skip


def tune_pair(proj: Projection, args, done: set, kernels: tuple, tiles: tuple[list, list], step, result) -> list[dict]:
    """A target's shrink (with the built-in expand), then its expand (with the chosen shrink), as
    `kernels` names them (None: not this one); an expand shape already tuned (o and down expand alike
    at 8B) is not tuned again."""
    target, (shrink_kernel, expand_kernel), (shrinks, expands) = proj.target, kernels, tiles
    common = {"num_stack": target.num_stack, "max_rank": args.max_rank, "tokens": proj.num_tokens}
    measured = {"target": target.name, "gemm_alone_us": round(median_us(proj.gemm, proj.device, args.reps), 2)}
    entries, shrink = [], shrinks[0]
    if shrink_kernel in args.kernels:
        shrink, timed = choose(proj, shrinks, lambda m, t, i: step(m, t, expands[0], i), lambda m, t: result(m, t, expands[0]), args.reps)
        entries.append({"kernel": shrink_kernel, "in_dim": target.in_dim, **common, "config": dataclasses.asdict(shrink), **measured, **timed})
    widest = max(size for _, size in target.output_slices)
    key = (expand_kernel, widest, target.num_stack, proj.num_tokens)
    if expand_kernel in args.kernels and key not in done:
        done.add(key)
        expand, timed = choose(proj, expands, lambda m, t, i: step(m, shrink, t, i), lambda m, t: result(m, shrink, t), args.reps)
        entries.append({"kernel": expand_kernel, "out_dim": widest, **common, "config": dataclasses.asdict(expand), **measured, **timed})
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(NAMED_SHAPES))
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="tune one rank's shard of the shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kernels", nargs="+", default=[*DECODE_KERNELS, *PREFILL_KERNELS], choices=[*DECODE_KERNELS, *PREFILL_KERNELS])
    parser.add_argument("--targets", nargs="*", default=[], help="fused targets to tune (default: all)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128], help="decode batch sizes")
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 8, 32], help="decode groupings scored together")
    parser.add_argument("--prefill-tokens", type=int, nargs="+", default=[256, 1024, 2048, 8192])
    parser.add_argument("--prefill-segments", type=int, nargs="+", default=[1, 4, 16], help="prompts a prefill grouping")
    parser.add_argument("--graph-max-tokens", type=int, default=2048, help="the engine's --cuda-graph-max-tokens")
    parser.add_argument("--max-running", type=int, default=64, help="the engine's --max-running-requests")
    parser.add_argument("--max-rank", type=int, default=64, help="the slots' capacity (--max-lora-rank)")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    parser.add_argument("--lora-sm-carveout", type=int, default=DEFAULT_LORA_SM_CARVEOUT)
    parser.add_argument("--reps", type=int, default=5, help="graph replays a timing (the leaders get 3x)")
    parser.add_argument("--quick", action="store_true", help="a few candidates only")
    parser.add_argument("--out", default="", help="directory to write <device>.json in (default: lorakernels/configs)")
    args = parser.parse_args(argv)
    if any(not 1 <= t <= DECODE_MAX_TOKENS for t in args.tokens) or min(args.adapters + args.prefill_segments) < 1:
        parser.error(f"--tokens must be 1-{DECODE_MAX_TOKENS}, --adapters and --prefill-segments >= 1")
    return args


def resolve_device(name: str) -> torch.device:
    """The device to tune, with an index: `torch.cuda.set_device` refuses a bare "cuda"."""
    device = torch.device(name)
    return torch.device(device.type, 0) if device.type == "cuda" and device.index is None else device


def main(argv: list[str] | None = None) -> tuple[Path, list[dict]]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.preferred_blas_library("cublaslt")  # as the engine's workers (engine/worker.py)
    name = tuned.device_name(device)
    path = Path(args.out or tuned.DEFAULT_DIR) / tuned.device_file_name(name)
    if path.is_file():
        tuned.load_file(path)  # a file this run cannot merge into fails now, not after the tuning
    config = local_config(NAMED_SHAPES[args.shape], TensorParallel(0, args.tensor_parallel_size))
    carveout = usable_sm_carveout(args.lora_sm_carveout, _num_sms(device)) if device.type == "cuda" else 0
    entries, done = [], set()
    for target in fused_targets(config):
        if args.targets and target.name not in args.targets:
            continue
        tuned_here = []
        if set(DECODE_KERNELS) & set(args.kernels):
            for num_tokens in args.tokens:
                tuned_here += tune_decode(target, num_tokens, args, device, carveout, done)
        if set(PREFILL_KERNELS) & set(args.kernels):
            for num_tokens in args.prefill_tokens:
                tuned_here += tune_prefill(target, num_tokens, args, device, done)
        for entry in tuned_here:
            print(json.dumps(entry), flush=True)
        entries += tuned_here
        write(path, name, entries)  # after each target: a run cut short keeps what it tuned
    print(f"# wrote {len(entries)} entries to {path}", flush=True)
    return path, entries


if __name__ == "__main__":
    main()
