"""The prefill MLP's LoRA expand and SiLU-mul: `sgmv_expand` into gate_up then `silu_mul` (two kernels,
gate_up read and written once more) against `silu_mul_expand` (one kernel), at Llama-3-8B's width.

    python benchmarks/silu_mul_expand.py --tokens 8192 --segments 4 --rank 16

Prints one JSON line per configuration: microseconds (CUDA events, median of triton's do_bench) and the
bytes each path moves at its floor.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from lorakernels.sgmv import sgmv_expand
from lorakernels.sgmv_ref import SgmvMeta
from lorakernels.silu_mul import launch_silu_mul_expand, silu_mul, silu_mul_expand


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--inter", type=int, default=14336)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tiles", nargs="*", default=["32x64x4", "64x64x4", "64x128x4", "64x128x8", "128x64x8", "32x128x4"],
                        help="BLOCK_M x BLOCK_N x num_warps of the fused kernel to time besides the default")
    args = parser.parse_args()
    dev, dtype, T, I, R = "cuda", torch.bfloat16, args.tokens, args.inter, args.rank  # noqa: E741
    slots = args.segments + 1
    gate_up = torch.randn(T, 2 * I, device=dev, dtype=dtype)
    v = torch.randn(T, 2 * R, device=dev, dtype=dtype)
    B = torch.randn(slots, 2 * I, R, device=dev, dtype=dtype) / 4
    lens = [T // args.segments] * args.segments
    lens[-1] += T - sum(lens)
    meta = SgmvMeta.from_lists(lens, list(range(1, slots)), [0] + [R] * args.segments, [0.0] + [0.5] * args.segments, dev)
    slices = ((0, I), (I, I))

    def two_kernels():
        y = gate_up.clone()  # timed apart below and subtracted
        sgmv_expand(v, B, meta, y, output_slices=slices)
        return silu_mul(y)

    clone_us = do_bench(lambda: gate_up.clone()) * 1e3
    results = {
        "expand_then_silu_mul": do_bench(two_kernels) * 1e3 - clone_us,
        "expand_alone": do_bench(lambda: sgmv_expand(v, B, meta, gate_up, output_slices=slices)) * 1e3,
        "silu_mul_alone": do_bench(lambda: silu_mul(gate_up)) * 1e3,
        "silu_mul_expand": do_bench(lambda: silu_mul_expand(gate_up, v, B, meta)) * 1e3,
    }
    out = torch.empty(T, I, device=dev, dtype=dtype)
    for tile in args.tiles:
        bm, bn, warps = (int(n) for n in tile.split("x"))

        def fused(bm=bm, bn=bn, warps=warps):
            launch_silu_mul_expand(gate_up, v, B, meta, out, block_m=bm, block_n=bn, num_warps=warps)

        results[f"silu_mul_expand_{tile}"] = do_bench(fused) * 1e3
    floor_fused = (T * 2 * I + T * I) * 2  # read gate_up, write out (bytes)
    floor_two = floor_fused + 2 * (T * 2 * I) * 2  # plus the expand's read and write of gate_up
    print(json.dumps({"tokens": T, "inter": I, "rank": R, "segments": args.segments,
                      "floor_gb_fused": floor_fused / 1e9, "floor_gb_two": floor_two / 1e9,
                      **{k: round(us, 1) for k, us in results.items()}}))  # fmt: skip


if __name__ == "__main__":
    main()
