"""Prefill attention over the paged KV cache on CUDA: the Triton extend kernel against the SDPA backend,
Llama-3-8B attention shapes (H=32, Hkv=8, D=128), bf16.

    python benchmarks/extend_attention.py [--cases 8x256 4x1024 2x2048+2048 1x8192]

A case "NxE" is N requests of E new tokens each; "NxE+P" gives each a cached prefix of P tokens. For each
case it prints one JSON line: median milliseconds per call (triton.testing.do_bench) of both backends,
each one's TFLOP/s on the causal FLOPs (4 x H x D per visible (query, key) pair), and their ratio. Slots
are shuffled over the pool, as a long-running server's are.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from lorakernels.attention_sdpa import SdpaPlan, sdpa_extend_attention
from lorakernels.extend_attention import ExtendPlan, extend_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128


def parse(case: str) -> tuple[int, int, int]:
    count, rest = case.split("x")
    extend, _, prefix = rest.partition("+")
    return int(count), int(extend), int(prefix or 0)


def run(case: str) -> dict:
    count, extend, prefix = parse(case)
    dtype, length = torch.bfloat16, prefix + extend
    num_slots = count * length
    q = torch.randn(count * extend, NUM_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    k_cache = torch.randn(num_slots, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    v_cache = torch.randn(num_slots, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    req_to_token = torch.randperm(num_slots, device="cuda").view(count, length)
    rows, prefixes, extends = list(range(count)), [prefix] * count, [extend] * count
    scale = HEAD_DIM**-0.5
    plan = ExtendPlan(rows, prefixes, extends, NUM_HEADS // NUM_KV_HEADS, q.device)
    sdpa_plan = SdpaPlan.build(rows, prefixes, extends, req_to_token, q.device)
    got = extend_attention(q, k_cache, v_cache, req_to_token, plan, scale)
    want = sdpa_extend_attention(q, k_cache, v_cache, sdpa_plan, scale)
    max_diff = (got.float() - want.float()).abs().max().item()
    triton_ms = triton.testing.do_bench(lambda: extend_attention(q, k_cache, v_cache, req_to_token, plan, scale))
    sdpa_ms = triton.testing.do_bench(lambda: sdpa_extend_attention(q, k_cache, v_cache, sdpa_plan, scale))
    pairs = count * (extend * prefix + extend * (extend + 1) // 2)  # visible (query, key) pairs
    flops = 4 * NUM_HEADS * HEAD_DIM * pairs
    return {
        "case": case, "tokens": count * extend, "prefix": prefix, "triton_ms": triton_ms, "sdpa_ms": sdpa_ms,
        "triton_tflops": flops / triton_ms / 1e9, "sdpa_tflops": flops / sdpa_ms / 1e9,
        "speedup": sdpa_ms / triton_ms, "max_abs_diff": max_diff,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="+", default=["8x256", "4x1024", "2x2048+2048", "1x8192", "64x128"])
    args = parser.parse_args()
    for case in args.cases:
        print(json.dumps(run(case)), flush=True)


if __name__ == "__main__":
    main()
