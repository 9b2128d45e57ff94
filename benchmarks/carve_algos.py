"""cuBLASLt's algorithms for a decode projection's base GEMM under the SM carve-out, each timed alone and
with the LoRA chain beside it on the side stream. The question it answers: is the algorithm PyTorch runs
under the carve-out (the heuristic's first for the device's SMs less the carve-out) the fastest there?
The twenty-first session's profile put three quarters of the 8-adapter decode cost in that GEMM (gate/up
95.5 us a layer under the carve-out, 85.4 on every SM, a 384x32 tile against 128x32).

    python benchmarks/carve_algos.py --tokens 32 64 --adapters 8 32 --candidates 16 --query-sms 0 100

Candidates are the heuristic's first `--candidates` algorithms for the carved SM-count target, and for
each of `--query-sms` (0: every SM), all run with the carved target (lorakernels/cublaslt.py
`pooled_candidates`: what cuBLASLt's check rejects is left out). Weights are stored as the engine stores them
(`in_out`). Each candidate's output is checked against `torch.mm`'s first, then timed alone in graphs of
ten; the `--beside` fastest alone, and the heuristic's first, are timed with the chain beside them, as is
`torch.mm` under the carve-out (the engine's projection). One JSON row per (target, tokens, candidate)
and a summary row per (target, tokens). CUDA only: cuBLASLt has no CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.carve_split import store_in_out
from benchmarks.fused_delta import add_projection_arguments, decode_projections
from benchmarks.tune_lora_tiles import median_us, resolve_device
from engine.lora_inputs import sm_carveout, usable_sm_carveout
from lorakernels import cublaslt, pdl
from lorakernels.sgmv_decode import _num_sms


def measure(proj, metas: dict, args, carveout: int, num_sms: int) -> list[dict]:
    """The rows of one projection (weights `in_out`) at its token count."""
    device, rows = proj.device, []
    target, num_tokens, x = proj.target, proj.num_tokens, proj.x
    weights = [w.t() for w, _, _ in proj.copies]  # row-major [in, out]
    y = torch.empty(num_tokens, target.out_dim, dtype=x.dtype, device=device)
    runner = cublaslt.LtGemm(num_tokens, target.in_dim, target.out_dim, x.dtype, device, sm_count=num_sms - carveout)
    queries = [cublaslt.LtGemm(num_tokens, target.in_dim, target.out_dim, x.dtype, device, sm_count=n) for n in args.query_sms if n != num_sms - carveout]
    reference = (x.float() @ weights[0].float()).to(x.dtype)
    scale = reference.float().abs().max().item()

    def lora(meta, i):
        return proj.decode_lora(meta, None, None, i)

    def carved_torch(i):
        with sm_carveout(carveout):
            proj.gemm(i)

    summary = {
        "target": target.name, "tokens": num_tokens, "carveout": carveout, "sm_count": num_sms - carveout,
        "torch_full_us": round(median_us(proj.gemm, device, args.reps), 2),
        "torch_carved_us": round(median_us(carved_torch, device, args.reps), 2),
    }  # fmt: skip
    for n, meta in metas.items():
        summary[f"torch_beside_{n}_us"] = round(median_us(lambda i, meta=meta: proj.beside_gemm(lambda: lora(meta, i), i), device, args.reps), 2)
    timed = []  # (row, algo)
    for query, cand in cublaslt.pooled_candidates(runner, queries, args.candidates):
        source = query.sm_count
        try:
            runner(x, weights[0], y, cand.algo)
            torch.cuda.synchronize(device)
        except cublaslt.CublasLtError as exc:
            print(json.dumps({"target": target.name, "tokens": num_tokens, "source_sms": source, "index": cand.index, "error": str(exc)}), flush=True)
            continue
        err = (y.float() - reference.float()).abs().max().item()
        row = {
            "target": target.name, "tokens": num_tokens, "source_sms": source, "index": cand.index, "config": cand.config,
            "waves": round(cand.waves, 3), "workspace": cand.workspace, "max_abs_diff": err, "wrong": err > 2e-2 * scale + 1e-6,
            "alone_us": round(median_us(lambda i, a=cand.algo: runner(x, weights[i % len(weights)], y, a), device, args.reps), 2),
        }  # fmt: skip
        timed.append((row, cand.algo))
    ok = sorted((t for t in timed if not t[0]["wrong"]), key=lambda t: t[0]["alone_us"])
    first = [t for t in ok if t[0]["source_sms"] == runner.sm_count and t[0]["index"] == 0]
    for row, algo in {id(t): t for t in ok[: args.beside] + first}.values():
        for n, meta in metas.items():

            def step(i, meta=meta, algo=algo):
                proj.beside_gemm(lambda: lora(meta, i), i, gemm=lambda i: runner(x, weights[i % len(weights)], y, algo))

            row[f"beside_{n}_us"] = round(median_us(step, device, args.reps), 2)
    for n in metas:
        besides = [t[0][f"beside_{n}_us"] for t in ok if f"beside_{n}_us" in t[0]]
        summary[f"best_beside_{n}_us"] = min(besides) if besides else None
    summary["best_alone_us"] = ok[0][0]["alone_us"] if ok else None
    summary["candidates"], summary["wrong"] = len(timed), sum(t[0]["wrong"] for t in timed)
    for row, _ in timed:
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(json.dumps(summary), flush=True)
    rows.append(summary)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_projection_arguments(parser, adapters=[8, 32])
    parser.add_argument("--candidates", type=int, default=16, help="algorithms asked of each heuristic")
    parser.add_argument("--query-sms", type=int, nargs="*", default=[0], help="other SM-count targets whose heuristics add candidates (0: every SM)")
    parser.add_argument("--beside", type=int, default=4, help="the fastest alone also timed with the chain beside")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    if device.type != "cuda":
        parser.error("carve_algos.py measures cuBLASLt: it needs a CUDA device")
    torch.cuda.set_device(device)
    torch.backends.cuda.preferred_blas_library("cublaslt")  # as the engine's workers
    num_sms = _num_sms(device)
    carveout = usable_sm_carveout(args.lora_sm_carveout, num_sms)
    pdl.set_lora_enabled(True)  # the engine's default
    rows = []
    for proj, metas in decode_projections(args, device, carveout):
        rows.extend(measure(store_in_out(proj), metas, args, carveout, num_sms))
    pdl.set_lora_enabled(False)
    return rows


if __name__ == "__main__":
    main()
