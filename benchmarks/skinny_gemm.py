"""Exploration: a Triton split-K GEMM for decode-size rows (y = x @ W^T, W [N, K] as nn.Linear stores
it) against cuBLAS (F.linear), over a grid of tiles and splits, at the narrow projections of the
Llama shapes; every call timed inside a CUDA graph. Prints one JSON line per (shape, rows): cuBLAS's
time, the best Triton config and its time, and both as fractions of --copy-gbps for the weight read.

    python benchmarks/skinny_gemm.py [--rows 64]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl
import triton.testing

SHAPES = {"8b.qkv": (4096, 6144), "8b.o": (4096, 4096), "70b-tp2.qkv": (8192, 5120), "70b-tp2.o": (4096, 8192)}


@triton.jit
def _split_gemm(x_ptr, w_ptr, out_ptr, M, N, K, sxm, sxk, swn, swk, sos, som, son,
                K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                NUM_STAGES: tl.constexpr):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k0 = pid_s * K_SPLIT
    for kk in tl.range(k0, k0 + K_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
        k = kk + offs_k
        a = tl.load(x_ptr + offs_m[:, None] * sxm + k[None, :] * sxk, mask=mask_m[:, None], other=0.0)
        b = tl.load(w_ptr + offs_n[None, :] * swn + k[:, None] * swk, mask=mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
    ptrs = out_ptr + pid_s * sos + offs_m[:, None] * som + offs_n[None, :] * son
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _sum_splits(p_ptr, y_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def split_gemm(x, w, splits, block_n, block_k, stages, partial, y):
    m, k = x.shape
    n = w.shape[0]
    k_split = k // splits
    out = y if splits == 1 else partial
    so = (0, y.stride(0), y.stride(1)) if splits == 1 else partial.stride()
    _split_gemm[(triton.cdiv(n, block_n), splits)](
        x, w, out, m, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1), *so,
        K_SPLIT=k_split, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
        NUM_STAGES=stages, num_warps=4,
    )  # fmt: skip
    if splits > 1:
        _sum_splits[(triton.cdiv(m * n, 1024),)](partial, y, m * n, SPLITS=splits, BLOCK=1024)
    return y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64])
    parser.add_argument("--copy-gbps", type=float, default=4200.0)
    args = parser.parse_args()
    configs = list(itertools.product((1, 2, 4, 8), (64, 128), (128, 256), (3, 4)))
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            want = torch.nn.functional.linear(x, w)
            cublas = triton.testing.do_bench_cudagraph(lambda x=x, w=w: torch.nn.functional.linear(x, w), return_mode="median") * 1e3
            y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
            best = None
            for splits, block_n, block_k, stages in configs:
                if k % (splits * block_k):
                    continue
                partial = torch.empty(splits, rows, n, device="cuda", dtype=torch.float32)
                try:
                    split_gemm(x, w, splits, block_n, block_k, stages, partial, y)
                except Exception as exc:  # out of shared memory etc.
                    print(json.dumps({"shape": name, "skip": [splits, block_n, block_k, stages], "why": str(exc)[:80]}))
                    continue
                err = (y.float() - want.float()).abs().max().item()
                us = triton.testing.do_bench_cudagraph(
                    lambda s=splits, bn=block_n, bk=block_k, st=stages, p=partial, x=x, w=w, y=y: split_gemm(x, w, s, bn, bk, st, p, y),
                    return_mode="median",
                ) * 1e3
                if best is None or us < best[0]:
                    best = (us, [splits, block_n, block_k, stages], err)
            bw = n * k * 2 / (args.copy_gbps * 1e9) * 1e6  # us at the copy rate
            print(json.dumps({
                "shape": name, "rows": rows, "cublas_us": round(cublas, 2), "cublas_bw": round(bw / cublas, 3),
                "triton_us": round(best[0], 2), "triton_bw": round(bw / best[0], 3),
                "config [splits, block_n, block_k, stages]": best[1], "max_abs_diff": best[2],
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
