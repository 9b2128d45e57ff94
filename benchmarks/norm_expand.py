"""A prefill step's o or down LoRA expand and the residual add + RMSNorm after it: `sgmv_expand` into the
projection's output then `add_rmsnorm` (two kernels, the output read and written once more) against
`add_rmsnorm_expand` (one kernel, `--lora-prefill-fused-expand o down`), at Llama-3-8B's hidden width.

    python benchmarks/norm_expand.py --tokens 2048 8192 --segments 1 4 --rank 16

Prints one JSON line per (tokens, segments): microseconds (median of triton's do_bench) of each path and
of the fused kernel under other tiles (BLOCK_M x BLOCK_N x num_warps), and the bytes each path moves at
its floor.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from lorakernels.rmsnorm import add_rmsnorm, add_rmsnorm_expand
from lorakernels.sgmv import sgmv_expand
from lorakernels.sgmv_ref import SgmvMeta


def run(tokens: int, segments: int, hidden: int, rank: int, tiles: list[str]) -> dict:
    dev, dtype, T, N, R = "cuda", torch.bfloat16, tokens, hidden, rank
    x = torch.randn(T, N, device=dev, dtype=dtype)
    residual = torch.randn(T, N, device=dev, dtype=dtype)
    weight = torch.randn(N, device=dev, dtype=dtype)
    v = torch.randn(T, R, device=dev, dtype=dtype)
    B = torch.randn(segments + 1, N, R, device=dev, dtype=dtype) / 4
    lens = [T // segments] * segments
    lens[-1] += T - sum(lens)
    meta = SgmvMeta.from_lists(lens, list(range(1, segments + 1)), [0] + [R] * segments, [0.0] + [0.5] * segments, dev)

    def two_kernels():
        y = x.clone()  # timed apart below and subtracted
        sgmv_expand(v, B, meta, y, output_slices=((0, N),))
        return add_rmsnorm(y, residual, weight, 1e-5)

    clone_us = do_bench(lambda: x.clone()) * 1e3
    results = {
        "expand_then_add_rmsnorm": do_bench(two_kernels) * 1e3 - clone_us,
        "expand_alone": do_bench(lambda: sgmv_expand(v, B, meta, x, output_slices=((0, N),))) * 1e3,
        "add_rmsnorm_alone": do_bench(lambda: add_rmsnorm(x, residual, weight, 1e-5)) * 1e3,
        "add_rmsnorm_expand": do_bench(lambda: add_rmsnorm_expand(x, residual, weight, 1e-5, v, B, meta)) * 1e3,
    }
    for tile in tiles:
        bm, bn, warps = (int(n) for n in tile.split("x"))

        def fused(bm=bm, bn=bn, warps=warps):
            add_rmsnorm_expand(x, residual, weight, 1e-5, v, B, meta, block_m=bm, block_n=bn, num_warps=warps)

        results[f"add_rmsnorm_expand_{tile}"] = do_bench(fused) * 1e3
    floor_fused = 4 * T * N * 2  # read x and the residual, write the sum and the output (bytes)
    floor_two = floor_fused + 2 * T * N * 2  # plus the expand's read and write of x
    return {"tokens": T, "hidden": N, "rank": R, "segments": segments, "floor_gb_fused": floor_fused / 1e9,
            "floor_gb_two": floor_two / 1e9, **{k: round(us, 1) for k, us in results.items()}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--segments", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tiles", nargs="*", default=["16x128x4", "16x512x4", "16x512x8", "32x256x4", "32x256x8", "64x128x8"],
                        help="BLOCK_M x BLOCK_N x num_warps of the fused kernel to time besides the default")  # fmt: skip
    args = parser.parse_args()
    for tokens in args.tokens:
        for segments in args.segments:
            print(json.dumps(run(tokens, segments, args.hidden, args.rank, args.tiles)), flush=True)


if __name__ == "__main__":
    main()
