"""SGMV shrink+expand on CUDA against two PyTorch baselines, Llama-3-8B projection shapes, bf16.

    python benchmarks/sgmv.py [--rank 16] [--copy-gbps 4200] [--backend triton chunked]

For every projection (qkv, o, gate_up, down), token count and number of distinct adapters it prints one
JSON line: median microseconds per call (triton.testing.do_bench) of the Triton op, the chunked
backend, a per-adapter loop in torch and gather+bmm in torch, and the Triton op's achieved bandwidth as
a fraction of --copy-gbps. Bytes = x read + A and B rows of the used slots (rank rows only) read + y read
and written + v written and read.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from lorakernels.sgmv import sgmv_expand, sgmv_shrink
from lorakernels.sgmv_chunked import sgmv_expand_chunked, sgmv_shrink_chunked
from lorakernels.sgmv_ref import SgmvMeta

# name -> (in_dim, output_slices): Llama-3-8B, fused q/k/v and gate/up
PROJECTIONS = {
    "qkv": (4096, ((0, 4096), (4096, 1024), (5120, 1024))),
    "o": (4096, ((0, 4096),)),
    "gate_up": (4096, ((0, 14336), (14336, 14336))),
    "down": (14336, ((0, 4096),)),
}
TOKENS = (1, 16, 64, 128, 256)
ADAPTERS = (1, 8, 32, 128)


def make_case(in_dim, output_slices, num_tokens, num_adapters, rank, num_slots):
    """Tokens split evenly over num_adapters requests (grouped by adapter), slot i+1 for adapter i."""
    num_adapters = min(num_adapters, num_tokens)
    seg_lens = [num_tokens // num_adapters + (i < num_tokens % num_adapters) for i in range(num_adapters)]
    slots = list(range(1, num_adapters + 1))
    ranks = [0] + [rank] * (num_slots - 1)
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, [0.0] + [0.5] * (num_slots - 1), "cuda")
    out_dim = sum(size for _, size in output_slices)
    num_stack = len(output_slices)
    dtype = torch.bfloat16
    A = torch.randn(num_slots, num_stack * rank, in_dim, device="cuda", dtype=dtype) / in_dim**0.5
    B = torch.randn(num_slots, out_dim, rank, device="cuda", dtype=dtype)
    x = torch.randn(num_tokens, in_dim, device="cuda", dtype=dtype)
    y = torch.randn(num_tokens, out_dim, device="cuda", dtype=dtype)
    return meta, seg_lens, slots, A, B, x, y


def moved_bytes(in_dim, out_dim, num_stack, num_tokens, num_used, rank) -> int:
    elem = 2
    weights = num_used * rank * (num_stack * in_dim + out_dim)
    return elem * (
        num_tokens * in_dim + weights + 2 * num_tokens * out_dim + 2 * num_tokens * num_stack * rank
    )


def torch_loop(x, A, B, y, seg_lens, slots, output_slices, rank):
    """Per-adapter loop: one pair of matmuls per segment and target."""
    start = 0
    for seg_len, w in zip(seg_lens, slots, strict=True):
        rows = slice(start, start + seg_len)
        v = x[rows] @ A[w].T  # [n, stack * rank]
        for k, (offset, size) in enumerate(output_slices):
            y[rows, offset : offset + size] += 0.5 * (
                v[:, k * rank : (k + 1) * rank] @ B[w, offset : offset + size].T
            )
        start += seg_len


def torch_gather_bmm(x, A, B, y, token_slots, output_slices, rank):
    """Gather each token's adapter weights and bmm: [T, 1, in] @ [T, in, stack*r] ..."""
    v = torch.bmm(x.unsqueeze(1), A[token_slots].transpose(1, 2))  # [T, 1, stack * rank]
    for k, (offset, size) in enumerate(output_slices):
        b = B[token_slots, offset : offset + size].transpose(1, 2)  # [T, rank, size]
        y[:, offset : offset + size] += 0.5 * torch.bmm(v[:, :, k * rank : (k + 1) * rank], b).squeeze(1)


def bench_case(name, num_tokens, num_adapters, rank, copy_gbps, num_slots) -> dict:
    in_dim, output_slices = PROJECTIONS[name]
    meta, seg_lens, slots, A, B, x, y = make_case(
        in_dim, output_slices, num_tokens, num_adapters, rank, num_slots
    )
    num_stack = len(output_slices)
    token_slots = torch.repeat_interleave(torch.tensor(slots), torch.tensor(seg_lens)).cuda()
    v = torch.empty(num_tokens, num_stack * rank, device="cuda", dtype=x.dtype)
    chunked_meta = meta.chunked(16)  # computed once per batch, as the engine would

    def triton_op():
        sgmv_expand(
            sgmv_shrink(x, A, meta, num_stack=num_stack, out=v), B, meta, y, output_slices=output_slices
        )

    def chunked_op():
        sgmv_shrink_chunked(x, A, meta, num_stack=num_stack, out=v)
        sgmv_expand_chunked(v, B, meta, y, output_slices=output_slices)

    times = {
        "triton_us": triton.testing.do_bench(triton_op, return_mode="median") * 1e3,
        # inside a replayed CUDA graph: kernel time without Python launch overhead (the decode-step case)
        "triton_graph_us": triton.testing.do_bench_cudagraph(triton_op, return_mode="median") * 1e3,
        "chunked_us": triton.testing.do_bench(chunked_op, return_mode="median") * 1e3,
        "torch_loop_us": triton.testing.do_bench(
            lambda: torch_loop(x, A, B, y, seg_lens, slots, output_slices, rank), return_mode="median"
        )
        * 1e3,
        "gather_bmm_us": triton.testing.do_bench(
            lambda: torch_gather_bmm(x, A, B, y, token_slots, output_slices, rank), return_mode="median"
        )
        * 1e3,
    }
    out_dim = y.shape[1]
    nbytes = moved_bytes(in_dim, out_dim, num_stack, num_tokens, len(set(slots)), rank)
    best = min(times["triton_us"], times["chunked_us"])
    return {
        "proj": name,
        "tokens": num_tokens,
        "adapters": len(set(slots)),
        "rank": rank,
        "chunked_segments": chunked_meta.num_segments,
        **{key: round(value, 2) for key, value in times.items()},
        "bytes": nbytes,
        "triton_bw_frac": round(nbytes / (times["triton_us"] * 1e-6) / (copy_gbps * 1e9), 3),
        "best_bw_frac": round(nbytes / (best * 1e-6) / (copy_gbps * 1e9), 3),
        "graph_bw_frac": round(nbytes / (times["triton_graph_us"] * 1e-6) / (copy_gbps * 1e9), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--copy-gbps", type=float, default=4200.0, help="copy bandwidth of the GPU, GB/s")
    parser.add_argument("--proj", nargs="*", default=list(PROJECTIONS))
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--adapters", type=int, nargs="*", default=list(ADAPTERS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/sgmv.py needs CUDA")
    num_slots = max(args.adapters) + 1  # slot 0 = base model
    for name in args.proj:
        for num_tokens in args.tokens:
            for num_adapters in args.adapters:
                if num_adapters > num_tokens:
                    continue
                row = bench_case(name, num_tokens, num_adapters, args.rank, args.copy_gbps, num_slots)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
