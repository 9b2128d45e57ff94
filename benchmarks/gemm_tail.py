"""A prefill projection's LoRA with the expand done by the base GEMM (lorakernels/gemm_tail.py) against the
in-line path (GEMM, shrink, expand; gate/up: GEMM, shrink, SiLU-mul with the expand), Llama-3-8B widths,
bf16, the weights stored [in, out] row-major as the engine stores them.

    python benchmarks/gemm_tail.py --tokens 2048 8192 --segments 1 4

One JSON line per (target, tokens, segments): microseconds (triton's do_bench, median) of the base
GEMM alone (gate/up: with SiLU-mul), the in-line LoRA path, the tail path (shrink, tail placement, one
GEMM over in + segments * stack * R), the same with the shrink done by cuBLAS for every block at once
(each row then keeps its own block's columns), the shrinks, the placement and the widened GEMM alone,
and the largest differences between the paths' outputs.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from lorakernels.gemm_tail import place_lora_tail
from lorakernels.sgmv import sgmv_expand, sgmv_shrink
from lorakernels.sgmv_ref import SgmvMeta
from lorakernels.silu_mul import silu_mul, silu_mul_expand

HIDDEN, INTER, Q, KV = 4096, 14336, 4096, 1024
TARGETS = {  # name: (in_dim, output slices)
    "qkv": (HIDDEN, ((0, Q), (Q, KV), (Q + KV, KV))),
    "o": (Q, ((0, HIDDEN),)),
    "gate_up": (HIDDEN, ((0, INTER), (INTER, INTER))),
    "down": (INTER, ((0, HIDDEN),)),
}


def run(name: str, tokens: int, segments: int, rank: int, slots: int) -> dict:
    dev, dtype = "cuda", torch.bfloat16
    in_dim, slices = TARGETS[name]
    stack, out_dim = len(slices), slices[-1][0] + slices[-1][1]
    width = stack * rank
    tail_rows = segments * width
    storage = torch.randn(in_dim + tail_rows, out_dim, device=dev, dtype=dtype) / in_dim**0.5  # [in + tail, out]
    weight = storage[:in_dim].t()  # logical [out, in], strides (1, out): the engine's in_out layout
    A = torch.randn(slots + 1, width, in_dim, device=dev, dtype=dtype) / in_dim**0.5
    B = torch.randn(slots + 1, out_dim, rank, device=dev, dtype=dtype) / 4
    A[slots], B[slots] = 0, 0
    lens = [tokens // segments] * segments
    lens[-1] += tokens - sum(lens)
    used = list(range(segments))
    ranks = [rank] * slots + [0]
    meta = SgmvMeta.from_lists(lens, used, ranks, [2.0] * slots + [0.0], dev)
    slot_block = torch.full((slots + 1,), -1, dtype=torch.int32, device=dev)
    slot_block[: len(used)] = torch.arange(len(used), dtype=torch.int32, device=dev)
    for j, slot in enumerate(used):  # block j's weight rows: slot's B^T, projection k's rows in its own columns
        rows = storage[in_dim + j * width : in_dim + (j + 1) * width].view(stack, rank, out_dim)
        rows.zero_()
        for k, (offset, size) in enumerate(slices):
            rows[k, :, offset : offset + size] = B[slot, offset : offset + size].t()
    x_aug = torch.randn(tokens, in_dim + tail_rows, device=dev, dtype=dtype)
    x = x_aug[:, :in_dim]
    x_plain = x.contiguous()
    weight_aug = storage.t()
    tail = x_aug[:, in_dim:]
    is_mlp = name == "gate_up"

    def base():
        y = F.linear(x_plain, weight)
        return silu_mul(y) if is_mlp else y

    def inline():
        y = F.linear(x_plain, weight)
        v = sgmv_shrink(x_plain, A, meta, num_stack=stack)
        if is_mlp:
            return silu_mul_expand(y, v, B, meta, output_slices=slices)
        sgmv_expand(v, B, meta, y, output_slices=slices)
        return y

    def tailed():
        v = sgmv_shrink(x, A, meta, num_stack=stack)
        place_lora_tail(v, meta, slot_block, tail, max_rank=rank, num_stack=stack)
        y = F.linear(x_aug, weight_aug)
        return silu_mul(y) if is_mlp else y

    a_blocks = A[used].reshape(len(used) * width, in_dim)  # every block's A, one GEMM's weight

    def tailed_cublas():  # the shrink for every block by cuBLAS, each row keeping its own block's columns
        v_all = F.linear(x, a_blocks)
        place_lora_tail(v_all, meta, slot_block, tail, max_rank=rank, num_stack=stack)
        y = F.linear(x_aug, weight_aug)
        return silu_mul(y) if is_mlp else y

    v = sgmv_shrink(x_plain, A, meta, num_stack=stack)
    diff = (inline().float() - tailed().float()).abs().max().item()
    diff_cublas = (inline().float() - tailed_cublas().float()).abs().max().item()
    row = {"target": name, "tokens": tokens, "segments": segments, "rank": rank}
    row["base_us"] = do_bench(base) * 1e3
    row["inline_us"] = do_bench(inline) * 1e3
    row["tail_us"] = do_bench(tailed) * 1e3
    row["tail_cublas_us"] = do_bench(tailed_cublas) * 1e3
    row["shrink_us"] = do_bench(lambda: sgmv_shrink(x, A, meta, num_stack=stack)) * 1e3
    row["shrink_cublas_us"] = do_bench(lambda: F.linear(x, a_blocks)) * 1e3
    row["place_us"] = do_bench(lambda: place_lora_tail(v, meta, slot_block, tail, max_rank=rank, num_stack=stack)) * 1e3
    row["gemm_aug_us"] = do_bench(lambda: F.linear(x_aug, weight_aug)) * 1e3
    row["inline_lora_us"] = row["inline_us"] - row["base_us"]
    row["tail_lora_us"] = row["tail_us"] - row["base_us"]
    row["tail_cublas_lora_us"] = row["tail_cublas_us"] - row["base_us"]
    row["max_abs_diff"] = diff
    row["max_abs_diff_cublas"] = diff_cublas
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--segments", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=8)
    args = parser.parse_args()
    for tokens in args.tokens:
        for segments in args.segments:
            for name in args.targets:
                print(json.dumps(run(name, tokens, segments, args.rank, args.slots)), flush=True)


if __name__ == "__main__":
    main()
