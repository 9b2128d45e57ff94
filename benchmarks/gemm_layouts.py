"""The decode-size GEMMs of the Llama shapes (a tensor-parallel rank's share) in the two weight layouts,
timed inside CUDA graphs: y = x @ W^T with W [out, in] (what nn.Linear stores, the engine's layout) and
y = x @ Wt with Wt [in, out] contiguous; each with cuBLASLt and cuBLAS preferred. "wt_linear" is the
engine's call on the second layout (EngineConfig.linear_weight_layout "in_out": `F.linear` of the
logical [out, in] view Wt.t()), which should time as "wt".

    python benchmarks/gemm_layouts.py [--rows 1 32 64]

One JSON line per case: microseconds a call (median) and the fraction of --copy-gbps the weight read
reaches.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

SHAPES = {  # name: (in, out) of one rank
    "8b.qkv": (4096, 6144), "8b.o": (4096, 4096), "8b.gate_up": (4096, 28672), "8b.down": (14336, 4096), "8b.lm_head": (4096, 128256),
    "70b-tp2.qkv": (8192, 5120), "70b-tp2.o": (4096, 8192), "70b-tp2.gate_up": (8192, 28672), "70b-tp2.down": (14336, 8192),
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 64])
    parser.add_argument("--copy-gbps", type=float, default=4200.0)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    for name in args.shapes:
        k, n = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        wt = w.t().contiguous()
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "rows": rows}
            for library in ("cublaslt", "cublas"):
                torch.backends.cuda.preferred_blas_library(library)
                cases = (
                    ("w", lambda x=x, w=w: torch.nn.functional.linear(x, w)),
                    ("wt", lambda x=x, wt=wt: x @ wt),
                    ("wt_linear", lambda x=x, wt=wt: torch.nn.functional.linear(x, wt.t())),
                )
                for layout, fn in cases:
                    us = triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3
                    row[f"{library}.{layout}_us"] = round(us, 2)
                    row[f"{library}.{layout}_bw"] = round(n * k * 2 / (us * 1e-6) / (args.copy_gbps * 1e9), 3)
            torch.backends.cuda.preferred_blas_library("cublaslt")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
