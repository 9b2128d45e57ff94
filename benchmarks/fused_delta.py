"""A decode projection with its LoRA delta as the engine runs it (the base GEMM under the SM carve-out,
the LoRA kernels beside it on a side stream, the main stream joining them), against the same with the
fused delta (`sgmv_lora_delta_decode`: the expand sums the split shrink's partials, no reduce kernel)
and against the GEMM alone with every SM. Times per projection from CUDA graphs of ten projections,
each over its own copy of the weights, as `tune_lora_tiles.py` times them (its `Projection`).

    python benchmarks/fused_delta.py --shape llama3-8b --tokens 32 64 --adapters 1 8 32
    python benchmarks/fused_delta.py --tokens 128 --adapters 32 --lora-pdl off on
    python benchmarks/fused_delta.py --tokens 32 128 --adapters 8 32 --segments graph exact
    python benchmarks/fused_delta.py --tokens 128 --adapters 32 --segments exact --per-kernel

One JSON row per (target, tokens, adapters): gemm_us, unfused_us, fused_us and fused_vs_unfused; the
LoRA kernels alone with every SM (unfused_lora_us, fused_lora_us) and the share of --copy-gbps they move
of the delta's bytes (x read, the used adapters' A and B at their rank read, the delta written): the
issue's SGMV target is half the copy rate at 32+ adapters and 128 tokens. The fused delta is checked
against the unfused one first. `--lora-pdl off on` times every row both ways (lorakernels/pdl.py
`set_lora_enabled`: the kernels after the split shrink launched with programmatic dependent launch), each
delta first checked bit for bit against the same kernels' without it. `--segments graph exact` times every
row with a decode graph's metadata (one segment a row, those the step leaves unused empty: the default, what
the engine replays) and with the step's own segments alone (what an eager step launches), the two deltas
first checked equal: what the graph's padding programs cost. `--per-kernel` also times each kernel of the
unfused chain alone (the split shrink, the reduce, the expand: graphs of ten launches of one kernel, PDL off,
the reduce and the expand over the inputs the kernel before wrote), with the bytes each must move and their
share of the copy rate: where the chain's time goes. On the CPU (the interpreter) it runs one call
each, for a smoke test only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.copy_rate import resolve_copy_gbps
from benchmarks.tune_lora_tiles import Projection, decode_grouping, median_us, resolve_device
from engine.config import DEFAULT_LORA_SM_CARVEOUT
from engine.lora_inputs import usable_sm_carveout
from engine.lora_pool import fused_targets
from engine.named_shapes import NAMED_SHAPES
from engine.parallel import TensorParallel, local_config
from lorakernels import pdl
from lorakernels.sgmv_decode import (
    _num_sms,
    _reduce_partials,
    _split_partials,
    decode_config,
    sgmv_expand_decode,
    sgmv_lora_delta_decode,
    sgmv_shrink_decode,
)
from lorakernels.sgmv_ref import SgmvMeta


def fused_lora(proj: Projection, meta: SgmvMeta, i: int = 0) -> torch.Tensor:
    _, a, b = proj.copies[i % len(proj.copies)]
    t = proj.target
    return sgmv_lora_delta_decode(proj.x, a, b, meta, num_stack=t.num_stack, output_slices=t.output_slices)


def delta_bytes(proj: Projection, num_adapters: int, rank: int) -> int:
    """What a decode delta must move: x read, each used adapter's A and B at its rank read once, the delta
    written."""
    t, elem = proj.target, proj.x.element_size()
    weights = num_adapters * rank * (t.num_stack * t.in_dim + t.out_dim)
    return elem * (proj.num_tokens * t.in_dim + weights + proj.num_tokens * t.out_dim)


def fused_step(proj: Projection, meta: SgmvMeta, i: int) -> None:
    """`Projection.decode_step` with the fused delta on the side stream."""
    proj.beside_gemm(lambda: fused_lora(proj, meta, i), i)


def per_kernel(proj: Projection, meta: SgmvMeta, n: int, rank: int, device, reps: int, copy_gbps: float) -> dict:
    """Each kernel of the unfused chain alone, PDL off (lorakernels/pdl.py's switch restored after): the split
    shrink, the reduce (over partials the split wrote first) and the expand (over v the shrink wrote first),
    us a launch and the share of the copy rate of what it must move: the split x and the used adapters' A
    (its fp32 partials, a few KB, left out), the reduce nothing counted (it sums partials into v), the expand
    v, B and the delta it writes. All but the split over copy 0's inputs, the weights per copy i."""
    t, elem = proj.target, proj.x.element_size()
    x, num_stack = proj.x, t.num_stack
    was = pdl.lora_enabled()
    pdl.set_lora_enabled(False)
    try:
        a0 = proj.copies[0][1]
        config = decode_config(t.in_dim, num_stack, x.device, max_rank=a0.shape[1] // num_stack, num_tokens=proj.num_tokens)
        partial = _split_partials(x, a0, meta, num_stack, config)
        v = sgmv_shrink_decode(x, a0, meta, num_stack=num_stack)
        delta = torch.empty(proj.num_tokens, t.out_dim, dtype=x.dtype, device=x.device)

        def split(i: int) -> None:
            _split_partials(x, proj.copies[i % len(proj.copies)][1], meta, num_stack, config)

        def reduce(i: int) -> None:  # the shrink's reduce alone: what sgmv_shrink_decode adds to the split
            _reduce_partials(partial, v, meta, num_stack, config, t.in_dim)

        def expand(i: int) -> None:
            sgmv_expand_decode(v, proj.copies[i % len(proj.copies)][2], meta, delta, output_slices=t.output_slices, overwrite=True)

        split_us, reduce_us, expand_us = (median_us(fn, device, reps) for fn in (split, reduce, expand))
    finally:
        pdl.set_lora_enabled(was)
    split_bytes = elem * (proj.num_tokens * t.in_dim + n * rank * num_stack * t.in_dim)
    expand_bytes = elem * (proj.num_tokens * num_stack * rank + n * rank * t.out_dim + proj.num_tokens * t.out_dim)
    return {
        "split_us": round(split_us, 2), "reduce_us": round(reduce_us, 2), "expand_us": round(expand_us, 2),
        "split_bytes": split_bytes, "expand_bytes": expand_bytes,
        "split_bw_frac": float(f"{split_bytes / split_us * 1e-3 / copy_gbps:.3g}"),
        "expand_bw_frac": float(f"{expand_bytes / expand_us * 1e-3 / copy_gbps:.3g}"),
    }  # fmt: skip


def time_row(
    proj: Projection, meta: SgmvMeta, n: int, gemm_us: float, args, device, reps: int, copy_gbps: float, carveout: int, setting: str,
    segments: str = "graph",
) -> dict:  # fmt: skip
    """One row: the projection's decode step and its LoRA kernels alone, unfused and fused, timed (and with
    --per-kernel each kernel of the unfused chain alone)."""
    unfused_us = median_us(lambda i: proj.decode_step(meta, None, None, i), device, reps)
    fused_us = median_us(lambda i: fused_step(proj, meta, i), device, reps)
    unfused_lora_us = median_us(lambda i: proj.decode_lora(meta, None, None, i), device, reps)
    fused_lora_us = median_us(lambda i: fused_lora(proj, meta, i), device, reps)
    nbytes = delta_bytes(proj, n, args.rank)
    row = {
        "target": proj.target.name, "tokens": proj.num_tokens, "adapters": n, "lora_pdl": setting, "segments": segments,
        "num_segments": meta.num_segments, "gemm_us": round(gemm_us, 2),
        "unfused_us": round(unfused_us, 2), "fused_us": round(fused_us, 2),
        "fused_vs_unfused": round(fused_us / unfused_us, 4),
        "unfused_lora_us": round(unfused_lora_us, 2), "fused_lora_us": round(fused_lora_us, 2), "lora_bytes": nbytes,
        "unfused_bw_frac": float(f"{nbytes / unfused_lora_us * 1e-3 / copy_gbps:.3g}"),
        "fused_bw_frac": float(f"{nbytes / fused_lora_us * 1e-3 / copy_gbps:.3g}"), "copy_gbps": round(copy_gbps, 1),
        "carveout": carveout, "device": str(device),
    }  # fmt: skip
    if args.per_kernel:
        row.update(per_kernel(proj, meta, n, args.rank, device, reps, copy_gbps))
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_projection_arguments(parser, adapters=[1, 8, 32])
    parser.add_argument("--lora-pdl", nargs="+", choices=["off", "on"], default=["on"], help="the LoRA chain's PDL switch (the engine's default: on): rows for each")
    parser.add_argument("--copy-gbps", type=float, default=0.0, help="device copy bandwidth, GB/s (0: measured on the device first)")
    parser.add_argument(
        "--segments", nargs="+", choices=["graph", "exact"], default=["graph"],
        help="the metadata: a decode graph's (one segment a row, the unused ones empty) or the step's own segments alone: rows for each",
    )  # fmt: skip
    parser.add_argument("--per-kernel", action="store_true", help="also each kernel of the unfused chain alone, PDL off")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    copy_gbps = resolve_copy_gbps(args.copy_gbps, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.preferred_blas_library("cublaslt")  # as the engine's workers
    carveout = usable_sm_carveout(args.lora_sm_carveout, _num_sms(device)) if device.type == "cuda" else 0
    reps = args.reps if device.type == "cuda" else 1
    rows = []
    for proj, metas in decode_projections(args, device, carveout):
        target, num_tokens = proj.target, proj.num_tokens
        gemm_us = median_us(proj.gemm, device, reps)
        for (n, graph_meta), layout in itertools.product(metas.items(), args.segments):
            meta = graph_meta if layout == "graph" else live_segments(graph_meta, device)
            pdl.set_lora_enabled(False)
            unfused, fused = proj.decode_lora(meta, None, None).float(), fused_lora(proj, meta).float()
            if not torch.allclose(fused, unfused, rtol=2e-2, atol=2e-2 * unfused.abs().max().item() + 1e-6):
                raise SystemExit(f"{target.name} T={num_tokens} {n} adapters: the fused delta differs from the unfused one")
            if layout == "exact" and not torch.equal(unfused, proj.decode_lora(graph_meta, None, None).float()):
                raise SystemExit(f"{target.name} T={num_tokens} {n} adapters: the graph's padding segments change the delta")
            for setting in args.lora_pdl:
                pdl.set_lora_enabled(setting == "on")
                if not (torch.equal(proj.decode_lora(meta, None, None).float(), unfused) and torch.equal(fused_lora(proj, meta).float(), fused)):
                    raise SystemExit(f"{target.name} T={num_tokens} {n} adapters: the deltas with --lora-pdl {setting} differ")
                row = time_row(proj, meta, n, gemm_us, args, device, reps, copy_gbps, carveout, setting, layout)
                rows.append(row)
            pdl.set_lora_enabled(False)
    return rows


def live_segments(meta: SgmvMeta, device: torch.device) -> SgmvMeta:
    """A decode graph's metadata without its padding: the step's own (non-empty) segments, as an eager
    step gives them."""
    live = [(n, slot) for n, slot in zip(meta.host_seg_lens, meta.host_slots, strict=True) if n > 0]
    return SgmvMeta.from_lists([n for n, _ in live], [slot for _, slot in live], list(meta.host_ranks), meta.scalings.tolist(), device)


def add_projection_arguments(parser: argparse.ArgumentParser, adapters: list[int]) -> None:
    """The options `decode_projections` reads, and --device, --lora-sm-carveout and --reps."""
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(NAMED_SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--targets", nargs="*", default=[], help="fused targets (default: all)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--adapters", type=int, nargs="+", default=adapters)
    parser.add_argument("--max-rank", type=int, default=16, help="the slots' capacity")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lora-sm-carveout", type=int, default=DEFAULT_LORA_SM_CARVEOUT)
    parser.add_argument("--reps", type=int, default=15, help="graph replays a timing")


def decode_projections(args, device: torch.device, carveout: int) -> Iterator[tuple[Projection, dict[int, SgmvMeta]]]:
    """Each fused target of args.shape (those args.targets names, if any) at each of args.tokens, with the
    decode groupings of args.adapters (capped at the token count) at rank args.rank: a Projection and its
    metadata by adapter count."""
    config = local_config(NAMED_SHAPES[args.shape], TensorParallel(0, 1))
    for target in fused_targets(config):
        if args.targets and target.name not in args.targets:
            continue
        for num_tokens in args.tokens:
            counts = sorted({min(n, num_tokens) for n in args.adapters})
            ranks, scalings = [0] + [args.rank] * max(counts), [0.0] + [2.0] * max(counts)
            metas = {n: SgmvMeta.from_lists(*decode_grouping(num_tokens, n), ranks, scalings, device) for n in counts}
            yield Projection(target, num_tokens, {str(n): m for n, m in metas.items()}, len(ranks), args, device, carveout), metas


if __name__ == "__main__":
    main()
