"""A decode projection's base GEMM split by its output columns: the first share under the SM carve-out
with the LoRA chain beside it on the side stream (as the engine runs the whole GEMM now), the rest after
it on every SM, once the chain no longer needs the SMs. The question it answers: does a GEMM that leaves
SMs free only while the chain runs beat one that leaves them free throughout (the twenty-first session's
profile: gate/up's GEMM takes 95.5 us a layer under the carve-out against 85.4 on every SM, while its
chain is done in about 30)? On an H100 it does not (BENCHMARKS.md, thirty-third session): two GEMMs over
the column shares take longer than the one they replace, more than the SMs given back earn.

    python benchmarks/carve_split.py --tokens 32 64 --adapters 8 32 --split 1 0.75 0.5 0.35 0.25 0

Weights are stored as the engine stores them (`in_out`: W^T row-major, so a share of the output columns
is a strided view cuBLASLt reads in place) and each share is written into its columns of one output by
`torch.mm(out=...)`. `--split 1` is the engine's projection (the whole GEMM carved out), `0` no carve-out
at all. One JSON row per (target, tokens, adapters, split): the projection with its chain beside
(`beside_us`), the split GEMM alone (`gemm_us`), and the whole GEMM on every SM (`full_gemm_us`); the
split output is checked against the whole GEMM's first. On the CPU it runs one call each, a smoke test.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fused_delta import add_projection_arguments, decode_projections
from benchmarks.tune_lora_tiles import Projection, median_us, resolve_device
from engine.lora_inputs import sm_carveout, usable_sm_carveout
from lorakernels import pdl
from lorakernels.sgmv_decode import _num_sms

COLUMN_ALIGN = 128  # a share's columns: a multiple of a GEMM tile's width


def split_columns(out_dim: int, share: float) -> int:
    """The columns the carved-out GEMM computes: share of out_dim, rounded to COLUMN_ALIGN (all of them
    for a share of 1)."""
    return out_dim if share >= 1.0 else min(out_dim, round(out_dim * share / COLUMN_ALIGN) * COLUMN_ALIGN)


def store_in_out(proj: Projection) -> Projection:
    """proj with its base weights stored as the engine stores them (`in_out`: the logical [out, in]
    weight with strides (1, out), so w.t() is a row-major [in, out] matrix)."""
    proj.copies = [(w.t().contiguous().t(), a, b) for w, a, b in proj.copies]
    return proj


class SplitProjection:
    """A Projection whose weights are stored `in_out` and whose GEMM is split at `cols` output columns."""

    def __init__(self, proj: Projection):
        self.proj = store_in_out(proj)
        self.y = torch.empty(proj.num_tokens, proj.target.out_dim, dtype=proj.x.dtype, device=proj.device)

    def columns(self, start: int, stop: int, i: int) -> None:
        """Output columns start:stop of the i-th copy's GEMM, into their slice of y."""
        if start < stop:
            w = self.proj.copies[i % len(self.proj.copies)][0]
            torch.mm(self.proj.x, w[start:stop].t(), out=self.y[:, start:stop])

    def gemm(self, cols: int, i: int) -> None:
        """The first cols columns under the carve-out, the rest on every SM."""
        with sm_carveout(self.proj.carveout):
            self.columns(0, cols, i)
        self.columns(cols, self.proj.target.out_dim, i)

    def beside(self, cols: int, meta, i: int) -> None:
        """The split GEMM with the LoRA chain beside its carved-out share (Projection.beside_gemm)."""
        self.proj.beside_gemm(
            lambda: self.proj.decode_lora(meta, None, None, i), i,
            gemm=lambda i: self.columns(0, cols, i), after=lambda i: self.columns(cols, self.proj.target.out_dim, i),
        )  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_projection_arguments(parser, adapters=[8, 32])
    parser.add_argument("--split", type=float, nargs="+", default=[1.0, 0.5, 0.0], help="shares of the output columns under the carve-out")
    args = parser.parse_args(argv)
    if any(not 0.0 <= s <= 1.0 for s in args.split):
        parser.error(f"--split takes shares in [0, 1], got {args.split}")
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.preferred_blas_library("cublaslt")  # as the engine's workers
    carveout = usable_sm_carveout(args.lora_sm_carveout, _num_sms(device)) if device.type == "cuda" else 0
    reps = args.reps if device.type == "cuda" else 1
    pdl.set_lora_enabled(True)  # the engine's default
    rows = []
    for proj, metas in decode_projections(args, device, carveout):
        target, num_tokens = proj.target, proj.num_tokens
        split = SplitProjection(proj)
        full_gemm_us = median_us(lambda i, split=split: split.gemm(0, i), device, reps)
        split.gemm(0, 0)  # the graph's last GEMM read another copy of the weights
        whole = split.y.clone()
        for share in args.split:
            cols = split_columns(target.out_dim, share)
            split.y.zero_()
            split.gemm(cols, 0)
            err = (split.y.float() - whole.float()).abs().max().item()
            if err > 2e-2 * whole.float().abs().max().item() + 1e-6:
                raise SystemExit(f"{target.name} T={num_tokens} split at {cols}: the split GEMM differs from the whole by {err}")
            gemm_us = median_us(lambda i, cols=cols, split=split: split.gemm(cols, i), device, reps)
            for n, meta in metas.items():
                beside_us = median_us(lambda i, cols=cols, meta=meta, split=split: split.beside(cols, meta, i), device, reps)
                row = {
                    "target": target.name, "tokens": num_tokens, "adapters": n, "split": share, "columns": cols,
                    "out_dim": target.out_dim, "full_gemm_us": round(full_gemm_us, 2), "gemm_us": round(gemm_us, 2),
                    "beside_us": round(beside_us, 2), "max_abs_diff": err, "carveout": carveout, "device": str(device),
                }  # fmt: skip
                print(json.dumps(row), flush=True)
                rows.append(row)
    pdl.set_lora_enabled(False)
    return rows


if __name__ == "__main__":
    main()
