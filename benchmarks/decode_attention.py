"""Paged split-KV decode attention on CUDA, Llama-3-8B attention shapes (H=32, Hkv=8, D=128), bf16.

    python benchmarks/decode_attention.py [--copy-gbps 4200] [--splits 1 4 16]

For every batch size and context length it prints one JSON line: median microseconds per call inside a
replayed CUDA graph (triton.testing.do_bench_cudagraph: the decode-step case, no launch overhead) with the
default chunk count and with each --splits, and the default's achieved bandwidth as a fraction of
--copy-gbps. Bytes = the K and V rows read: B x L x Hkv x D x 2 (K and V) x 2 (bf16). Every request has
the full context L, its slots shuffled over the pool; max_context = L.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from lorakernels.decode_attention import DecodeAttentionWorkspace, decode_attention, default_num_splits

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
BATCHES = (1, 32, 64)
CONTEXTS = (512, 2048, 8192)


def make_case(batch_size: int, context: int):
    num_slots = batch_size * context
    dtype = torch.bfloat16
    q = torch.randn(batch_size, NUM_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    k_cache = torch.randn(num_slots, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    v_cache = torch.randn(num_slots, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    req_to_token = torch.randperm(num_slots, device="cuda", dtype=torch.int32).view(batch_size, context)
    req_rows = torch.arange(batch_size, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((batch_size,), context, device="cuda", dtype=torch.int32)
    return q, k_cache, v_cache, req_to_token, req_rows, seq_lens


def time_us(case, context: int, num_splits: int) -> float:
    q = case[0]
    workspace = DecodeAttentionWorkspace.allocate(q.shape[0], NUM_HEADS, HEAD_DIM, num_splits, "cuda")
    out = torch.empty_like(q)

    def op():
        decode_attention(*case, HEAD_DIM**-0.5, max_context=context, workspace=workspace, out=out)

    op()  # compile outside the capture
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(op, return_mode="median") * 1e3


def bench_case(batch_size: int, context: int, copy_gbps: float, splits: list[int]) -> dict:
    case = make_case(batch_size, context)
    default = default_num_splits(batch_size, NUM_KV_HEADS, context, torch.device("cuda"))
    us = time_us(case, context, default)
    nbytes = batch_size * context * NUM_KV_HEADS * HEAD_DIM * 2 * 2
    return {
        "batch": batch_size,
        "context": context,
        "num_splits": default,
        "us": round(us, 2),
        "kv_mb": round(nbytes / 1e6, 2),
        "frac_copy_bw": round(nbytes / (us * 1e-6) / (copy_gbps * 1e9), 3),
        "us_by_splits": {s: round(time_us(case, context, s), 2) for s in splits},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--copy-gbps", type=float, default=4200.0)
    parser.add_argument("--splits", type=int, nargs="*", default=[])
    args = parser.parse_args()
    for batch_size in BATCHES:
        for context in CONTEXTS:
            print(json.dumps(bench_case(batch_size, context, args.copy_gbps, args.splits)), flush=True)


if __name__ == "__main__":
    main()
