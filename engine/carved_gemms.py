"""The decode GEMMs, under the SM carve-out and on every SM, each run with the cuBLASLt algorithm timed
fastest there.

On CUDA a decode step's base GEMM leaves SMs to the LoRA kernels beside it (engine/lora_inputs.py
`sm_carveout`), and `torch.mm` then runs the first algorithm cuBLASLt's heuristic gives for the SMs left;
that pick is not always the fastest there (the twenty-first session's H100 profile: gate/up 95.5 us a
layer under a 48-SM carve-out against 85.4 us on every SM, with another tile). `CarvedGemms.tune` times,
for each fused target and each row count the decode graphs capture, the heuristic's candidates for the
carved SM count and for every SM, each asked with the workspace and with none (with a large workspace
its picks are often split-Ks slower than torch's), run with the carved SM-count target
(lorakernels/cublaslt.py `pooled_candidates`), against `torch.mm` under the carve-out, each call in a CUDA
graph of GRAPH_CALLS; the fastest is kept where it beats `torch.mm` by MIN_GAIN. `project` then runs it in place of the projection's `linear(x)`.
The projections without LoRA work (base steps, targets no adapter of the step has) run on every SM, and
there too the heuristic's first pick is not always the fastest (an H100: decode steps with adapters at
batch 1, tuned under the carve-out, ran shorter than base steps on torch.mm's pick): each target is tuned
with a carve-out of 0 as well, and every layer's projection takes the plans (`tuned_gemms`, read by
engine/lora_inputs.py `tuned_gemm`).

It covers what the decode GEMMs are in the engine's default layout: no bias, weights stored `in_out`
(engine/weights.py `store_linears_in_out`), one rank (a row-parallel projection under tensor parallelism
writes into the all-reduce's buffer and keeps `torch.mm`). Anything else, and a row count not tuned,
keeps `linear(x)`. The tuning happens when the worker captures its decode graphs (EngineConfig's
tune_decode_gemms, on by default), with the device otherwise idle; the algorithms are those of the cuBLASLt
that PyTorch loaded, so nothing is written to disk. The pick goes by timing, so two starts of one engine
may run different algorithms, whose bf16 rounding differs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from engine.lora_inputs import sm_carveout
from lorakernels import cublaslt
from lorakernels.tuned import graph_median_us

log = logging.getLogger(__name__)
GRAPH_CALLS = 10  # calls a timed graph holds, each on the next of the first layers' weights
REPLAYS = 7  # replays a candidate's median is taken over
CANDIDATES = 16  # algorithms asked of each heuristic
MIN_GAIN = 0.01  # a candidate replaces torch.mm only where it is this much faster


def in_out_weight(linear: nn.Module) -> torch.Tensor | None:
    """linear's weight as the row-major [in, out] matrix cuBLASLt reads (the `in_out` storage), or None
    where the projection is not a plain decode GEMM: a bias, the [out, in] storage, a rank's partial sum
    under tensor parallelism, a dtype cuBLASLt is not asked for here."""
    weight = getattr(linear, "weight", None)
    if weight is None or getattr(linear, "bias", None) is not None or weight.dim() != 2:
        return None
    tp = getattr(linear, "tp", None)
    if tp is not None and tp.size > 1 and not hasattr(linear, "out_parts"):  # RowParallelLinear under TP
        return None
    if weight.dtype not in (torch.float16, torch.bfloat16) or weight.stride() != (1, weight.shape[0]):
        return None
    return weight.t()


class CarvedGemms:
    """(fused target, rows, carve-out) -> the LtGemm and algorithm its decode GEMM runs."""

    def __init__(self, device: torch.device):
        self.device = device
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._plans: dict[tuple[str, int, int], tuple[object, bytes]] = {}
        self.report: list[dict] = []  # one row per tuned (target, rows, carve-out): the times, for logs and benchmarks
        self.tune_seconds = 0.0  # spent in tune, all calls

    def __len__(self) -> int:
        return len(self._plans)

    @torch.inference_mode()
    def tune(self, linears: Mapping[str, Sequence[nn.Module]], row_counts: Iterable[int], carveouts: Mapping[str, int]) -> None:
        """Time each target's candidates at each row count (linears: per fused target, its projections in
        the first layers, which share one shape; a graph's calls read them in turn, as a step reads each
        layer's weights once, not one weight from L2; carveouts: the SMs each target's GEMM leaves, 0 for
        none: the GEMMs of projections without LoRA work, on every SM); a (target, rows, carve-out) tuned
        before is not timed again."""
        gen = torch.Generator(device=self.device).manual_seed(0)
        started = time.perf_counter()
        for target, layers in linears.items():
            carveout = carveouts.get(target, 0)
            weights = [in_out_weight(linear) for linear in layers]
            if carveout < 0 or not weights or any(w is None or w.shape != weights[0].shape for w in weights):
                continue
            linear, weight = layers[0], weights[0]
            in_dim, out_dim = weight.shape
            for rows in sorted(set(row_counts) - {r["rows"] for r in self.report if (r["target"], r["carveout"]) == (target, carveout)}):
                x = torch.randn(rows, in_dim, generator=gen, device=self.device).to(weight.dtype)
                y = torch.empty(rows, out_dim, dtype=weight.dtype, device=self.device)
                runner = cublaslt.LtGemm(rows, in_dim, out_dim, weight.dtype, self.device, sm_count=self.num_sms - carveout)
                others = [cublaslt.LtGemm(rows, in_dim, out_dim, weight.dtype, self.device)] if carveout else []
                algos = [c.algo for _, c in cublaslt.pooled_candidates(runner, others, CANDIDATES, (None, 0))]

                def carved_torch(i, x=x, layers=layers, carveout=carveout):
                    with sm_carveout(carveout):
                        layers[i % len(layers)](x)

                def tuned(i, algo, runner=runner, x=x, y=y, weights=weights):
                    runner(x, weights[i % len(weights)], y, algo)

                torch_us = graph_median_us(carved_torch, self.device, GRAPH_CALLS, REPLAYS)
                want = linear(x).float()
                best_us, best = float("inf"), None
                for algo in algos:
                    try:
                        runner(x, weight, y, algo)
                    except cublaslt.CublasLtError:
                        continue
                    if not torch.allclose(y.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item()):
                        continue
                    us = graph_median_us(lambda i, algo=algo: tuned(i, algo), self.device, GRAPH_CALLS, REPLAYS)
                    if us < best_us:
                        best_us, best = us, algo
                chosen = best is not None and best_us < torch_us * (1.0 - MIN_GAIN)
                if chosen:
                    self._plans[(target, rows, carveout)] = (runner, best)
                self.report.append({
                    "target": target, "rows": rows, "carveout": carveout, "candidates": len(algos), "torch_us": round(torch_us, 2),
                    "best_us": round(best_us, 2) if best is not None else None, "chosen": chosen,
                })  # fmt: skip
        self.tune_seconds += time.perf_counter() - started
        log.info(
            "tuned decode GEMMs: %d of %d (target, rows, carve-out) take a cuBLASLt algorithm of their own (%.1f s of timing)",
            len(self._plans), len(self.report), self.tune_seconds,
        )  # fmt: skip

    def project(self, linear: nn.Module, target: str, x: torch.Tensor, carveout: int) -> torch.Tensor:
        """linear(x) for a decode GEMM under `carveout` SMs (0: every SM): through the tuned algorithm where
        there is one for this target, row count and carve-out and x and the weight are as it was tuned for."""
        plan = self._plans.get((target, x.shape[0], carveout)) if x.dim() == 2 else None
        if plan is None:
            return linear(x)
        weight = in_out_weight(linear)
        runner, algo = plan
        if weight is None or runner.refusal(x, weight) is not None:
            return linear(x)
        return runner(x, weight, None, algo)
