"""The fused decode kernels against the unfused PyTorch ops they replace, and the split-K decode shrink
against `sgmv_shrink`, at Llama-3-8B shapes in bf16, every op timed inside a replayed CUDA graph.

    python benchmarks/decode_kernels.py [--batch 1 32 64] [--adapters 1 8 32] [--max-rank 16 64]

One JSON line per case: microseconds per call (triton.testing.do_bench_cudagraph, median) of the fused
kernel and of the PyTorch ops (the model's CPU path), or of both shrinks; for the shrinks also the
bandwidth of the decode shrink as a fraction of --copy-gbps (bytes: x, the used adapters' A rows up to
their rank, v), and the decode delta (`sgmv_delta_auto`: the expand into a new tensor, as the engine's
side stream runs it). Request i uses adapter i mod N (rank-16 adapters in slots of capacity --max-rank),
in two layouts: one segment per request ("rows") and each adapter's requests merged into one segment
after the scheduler's sort by slot ("merged", what the engine runs). The norm-shrink cases time the
residual add + RMSNorm alone, then followed by the decode shrink of its output, and the two in one
kernel (`add_rmsnorm_shrink`, --lora-decode-norm-shrink) for q/k/v and gate/up, merged segments.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton.testing

from engine.lora_inputs import lora_segments
from lorakernels.norm_shrink import add_rmsnorm_shrink, shrink_counters
from lorakernels.rmsnorm import add_rmsnorm, add_rmsnorm_ref
from lorakernels.rope_kv import rope_kv_write, rope_kv_write_ref
from lorakernels.sgmv import sgmv_shrink
from lorakernels.sgmv_decode import sgmv_delta_auto, sgmv_shrink_decode
from lorakernels.sgmv_ref import SgmvMeta
from lorakernels.silu_mul import silu_mul

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
SHRINKS = {"qkv": (4096, 3), "o": (4096, 1), "gate_up": (4096, 2), "down": (14336, 1)}  # in_dim, num_stack
SLICES = {
    "qkv": ((0, 4096), (4096, 1024), (5120, 1024)),
    "o": ((0, 4096),),
    "gate_up": ((0, 14336), (14336, 14336)),
    "down": ((0, 4096),),
}
DTYPE = torch.bfloat16


def graph_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3


def fused_cases(batch: int) -> list[dict]:
    x = torch.randn(batch, HIDDEN, device="cuda", dtype=DTYPE)
    residual = torch.randn_like(x)
    weight = torch.rand(HIDDEN, device="cuda", dtype=DTYPE) + 0.5
    gate_up = torch.randn(batch, 2 * INTER, device="cuda", dtype=DTYPE)
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=DTYPE)
    positions = torch.randint(0, 4096, (batch,), device="cuda")
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM)
    freqs = torch.arange(8192, device="cuda").float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    k_cache = torch.zeros(65536, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.zeros_like(k_cache)
    loc = torch.randperm(65536, device="cuda")[:batch]
    heads = {"num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM}

    def silu_mul_torch():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    pairs = {
        "add_rmsnorm": (
            lambda: add_rmsnorm(x, residual, weight, 1e-5),
            lambda: add_rmsnorm_ref(x, residual, weight, 1e-5),
        ),
        "silu_mul": (lambda: silu_mul(gate_up), silu_mul_torch),
        "rope_kv_write": (
            lambda: rope_kv_write(qkv, positions, cos_sin, k_cache, v_cache, loc, **heads),
            lambda: rope_kv_write_ref(qkv, positions, cos_sin, k_cache, v_cache, loc, **heads),
        ),
    }
    rows = []
    for name, (fused, torch_ops) in pairs.items():
        fused_us, torch_us = graph_us(fused), graph_us(torch_ops)
        rows.append({"op": name, "batch": batch, "fused_us": round(fused_us, 2), "torch_us": round(torch_us, 2),
                     "speedup": round(torch_us / fused_us, 2)})  # fmt: skip
    return rows


def shrink_case(proj: str, batch: int, num_adapters: int, max_rank: int, rank: int, copy_gbps: float) -> dict:
    in_dim, num_stack = SHRINKS[proj]
    num_slots = num_adapters + 1  # slot 0: the base model
    slots = [1 + i % num_adapters for i in range(batch)]
    ranks = [0] + [rank] * num_adapters
    scalings = [0.0] + [2.0] * num_adapters
    meta = SgmvMeta.from_lists([1] * batch, slots, ranks, scalings, "cuda")
    merged = SgmvMeta.from_lists(*lora_segments([1] * batch, sorted(slots)), ranks, scalings, "cuda")
    A = torch.randn(num_slots, num_stack * max_rank, in_dim, device="cuda", dtype=DTYPE) / in_dim**0.5
    out_dim = sum(size for _, size in SLICES[proj])
    B = torch.randn(num_slots, out_dim, max_rank, device="cuda", dtype=DTYPE)
    x = torch.randn(batch, in_dim, device="cuda", dtype=DTYPE)
    v = torch.zeros(batch, num_stack * max_rank, device="cuda", dtype=DTYPE)
    v_ref = torch.zeros_like(v)
    sgmv_shrink(x, A, meta, num_stack=num_stack, out=v_ref)
    sgmv_shrink_decode(x, A, meta, num_stack=num_stack, out=v)
    max_err = (v.float() - v_ref.float()).abs().max().item()
    current = graph_us(lambda: sgmv_shrink(x, A, meta, num_stack=num_stack, out=v_ref))
    decode = graph_us(lambda: sgmv_shrink_decode(x, A, meta, num_stack=num_stack, out=v))
    decode_merged = graph_us(lambda: sgmv_shrink_decode(x, A, merged, num_stack=num_stack, out=v))
    delta = graph_us(lambda: sgmv_delta_auto(v, B, meta, output_slices=SLICES[proj]))
    delta_merged = graph_us(lambda: sgmv_delta_auto(v, B, merged, output_slices=SLICES[proj]))
    nbytes = 2 * (batch * in_dim + num_adapters * num_stack * rank * in_dim + batch * num_stack * rank)
    return {
        "proj": proj, "batch": batch, "adapters": num_adapters, "rank": rank, "max_rank": max_rank,
        "sgmv_shrink_us": round(current, 2), "decode_shrink_rows_us": round(decode, 2),
        "decode_shrink_merged_us": round(decode_merged, 2),
        "delta_rows_us": round(delta, 2), "delta_merged_us": round(delta_merged, 2),
        "decode_bw_frac": round(nbytes / (decode_merged * 1e-6) / (copy_gbps * 1e9), 3),
        "max_abs_diff": max_err,
    }  # fmt: skip


def norm_shrink_case(proj: str, batch: int, num_adapters: int, max_rank: int, rank: int) -> dict:
    num_stack = SHRINKS[proj][1]
    slots = sorted(1 + i % num_adapters for i in range(batch))
    meta = SgmvMeta.from_lists(*lora_segments([1] * batch, slots), [0] + [rank] * num_adapters, [0.0] + [2.0] * num_adapters, "cuda")
    A = torch.randn(num_adapters + 1, num_stack * max_rank, HIDDEN, device="cuda", dtype=DTYPE) / HIDDEN**0.5
    x, residual, delta = (torch.randn(batch, HIDDEN, device="cuda", dtype=DTYPE) for _ in range(3))
    weight = torch.rand(HIDDEN, device="cuda", dtype=DTYPE) + 0.5
    counters = shrink_counters("cuda")

    def separate():
        out, _ = add_rmsnorm(x, residual, weight, 1e-5, delta)
        return sgmv_shrink_decode(out, A, meta, num_stack=num_stack)

    fused = add_rmsnorm_shrink(x, residual, weight, 1e-5, A, meta, num_stack=num_stack, counters=counters, delta=delta)[2]
    cols = torch.cat([torch.arange(k * max_rank, k * max_rank + rank) for k in range(num_stack)]).cuda()
    max_err = (fused[:, cols].float() - separate()[:, cols].float()).abs().max().item()
    return {
        "case": "norm_shrink", "proj": proj, "batch": batch, "adapters": num_adapters, "rank": rank, "max_rank": max_rank,
        "norm_us": round(graph_us(lambda: add_rmsnorm(x, residual, weight, 1e-5, delta)), 2),
        "norm_then_shrink_us": round(graph_us(separate), 2),
        "norm_shrink_us": round(graph_us(
            lambda: add_rmsnorm_shrink(x, residual, weight, 1e-5, A, meta, num_stack=num_stack, counters=counters, delta=delta)
        ), 2),
        "max_abs_diff": max_err,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 64])
    parser.add_argument("--shrink-batch", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-rank", type=int, nargs="+", default=[16, 64], help="slot capacities R")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    parser.add_argument("--copy-gbps", type=float, default=4200.0)
    parser.add_argument("--parts", nargs="+", default=["fused", "shrink", "norm_shrink"], choices=["fused", "shrink", "norm_shrink"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/decode_kernels.py needs CUDA")
    for batch in args.batch if "fused" in args.parts else ():
        for row in fused_cases(batch):
            print(json.dumps(row), flush=True)
    for max_rank in args.max_rank:
        for batch in args.shrink_batch:
            for num_adapters in args.adapters:
                for proj in SHRINKS if "shrink" in args.parts else ():
                    row = shrink_case(proj, batch, num_adapters, max_rank, args.rank, args.copy_gbps)
                    print(json.dumps(row), flush=True)
                for proj in ("qkv", "gate_up") if "norm_shrink" in args.parts else ():
                    print(json.dumps(norm_shrink_case(proj, batch, num_adapters, max_rank, args.rank)), flush=True)


if __name__ == "__main__":
    main()
