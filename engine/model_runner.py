"""A model worker's step: a StepPlan -> tensors -> forward -> sampled tokens.

Reads nothing but the plan and what the worker owns: the model (shard), the KV buffers, its device copy
of the request-to-token table, the LoRA slot pool, the attention backends and the sampling generators.
Per-step metadata is built on the CPU from the plan's lists (no device sync). `launch` returns as soon
as the step is queued on the device; its `SampledTokens` wait for the tokens only when asked, so the
front can plan the next step meanwhile. The last sampled tokens stay on the device for a chained plan
(engine/step_plan.py) to read; under tensor parallelism rank 0 broadcasts them to the other ranks.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping

import torch

from engine.attention import AttentionBackend, DecodeKernelBackend
from engine.forward_inputs import AttentionInputs, KVBuffers, resolve_previous
from engine.lora_inputs import (
    DECODE_RUN,
    LoraInputs,
    SgmvMetaBuffers,
    decode_fused_targets,
    fused_delta_targets,
    lora_segments,
    prefill_fused_targets,
    sgmv_ops,
    usable_sm_carveout,
)
from engine.lora_pool import LoraSlotPool, PackedAdapter
from engine.lora_tail import MIN_TOKENS as TAIL_MIN_TOKENS
from engine.lora_tail import GemmTail
from engine.models.blocks import DecoderModel
from engine.sampling import make_generator, sample
from engine.step_plan import StepPlan

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        kv: KVBuffers,
        req_to_token: torch.Tensor,  # [max_reqs, max_context] int64 on the device: this worker's copy
        attention: AttentionBackend,
        lora_pool: LoraSlotPool | None = None,
        lora_backend: str = "ref",  # SGMV ops: "ref" (PyTorch), "triton" or "chunked"
        samples: bool = True,  # False on tensor-parallel ranks > 0: rank 0's tokens are the step's
        lora_sm_carveout: int = 0,  # CUDA decode steps: SMs the base GEMMs leave to the LoRA kernels
        lora_sm_carveout_targets: Mapping[str, int] | None = None,  # the same for some fused targets' GEMMs
        lora_decode_fused_expand: tuple[str, ...] = (),  # CUDA decode steps: targets whose expand the next kernel does
        lora_decode_fused_delta: tuple[str, ...] = (),  # CUDA decode steps: targets whose delta is one fused pass
        lora_prefill_fused_expand: tuple[str, ...] = ("gate_up",),  # CUDA prefill-sized steps: targets whose expand the next kernel does
        lora_gemm_tail: GemmTail | None = None,  # prefill-sized steps: the LoRA in the base GEMMs (engine/lora_tail.py)
        lora_decode_norm_shrink: tuple[str, ...] = (),  # CUDA decode steps: targets shrunk by their input's norm
        tune_decode_gemms: bool = False,  # CUDA graphs: the decode GEMMs' cuBLASLt algorithms tuned (engine/carved_gemms.py)
        lora_graph_segments: tuple[int, ...] = (),  # CUDA graphs: LoRA decode graphs also for these segment counts
    ):
        self.model = model
        self.kv = kv
        self.req_to_token = req_to_token
        self.device = req_to_token.device
        self.attention = attention
        self.lora_pool = lora_pool
        self.lora_ops = sgmv_ops(lora_backend)
        self._lora_graph_segments = tuple(lora_graph_segments)
        # Prefill-sized steps leave these targets' expand to the kernel that reads the projection next
        # (gate/up: SiLU-mul; o, down: the residual add + RMSNorm): the Triton ops on CUDA
        self._fused_expand = prefill_fused_targets(lora_prefill_fused_expand, self.device, lora_backend)
        # Prefill-sized steps of at most gemm_tail.blocks adapters add their LoRA in the base GEMMs instead
        self.gemm_tail = lora_gemm_tail if lora_pool is not None else None
        # Decode steps compute LoRA deltas on this stream beside their base GEMMs (LoraInputs.side)
        self.lora_side = torch.cuda.Stream(self.device) if lora_pool is not None and self.device.type == "cuda" else None
        self.lora_sm_carveout = lora_sm_carveout  # LoraInputs.sm_carveout of those steps
        self.lora_sm_carveout_targets = dict(lora_sm_carveout_targets or {})  # LoraInputs.sm_carveout_targets
        if self.device.type == "cuda" and lora_pool is not None:
            num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self.lora_sm_carveout = self._usable_carveout("--lora-sm-carveout ", lora_sm_carveout, num_sms)
            self.lora_sm_carveout_targets = {
                target: self._usable_carveout(f"--lora-sm-carveout-target {target}=", n, num_sms)
                for target, n in self.lora_sm_carveout_targets.items()
            }
        # Decode steps leave these targets' expand to the kernel that reads the projection next
        self._decode_fused_expand = (
            decode_fused_targets(lora_decode_fused_expand, self.device, lora_backend, lora_pool.max_rank) if lora_pool is not None else frozenset()
        )  # fmt: skip
        # ... and compute these targets' delta beside the GEMM in one fused pass from x
        self._decode_fused_delta = fused_delta_targets(lora_decode_fused_delta, self.device, lora_backend, lora_pool.max_rank) if lora_pool is not None else frozenset()
        # ... and run these targets' LoRA on the main stream: the shrink in the norm before, the expand after
        self._decode_norm_shrink = (
            decode_fused_targets(lora_decode_norm_shrink, self.device, lora_backend, lora_pool.max_rank) if lora_pool is not None else frozenset()
        )  # fmt: skip
        self._shrink_counters = None
        if self._decode_norm_shrink:
            # Triton: only where the option is on, on CUDA
            from lorakernels.norm_shrink import shrink_counters

            self._shrink_counters = shrink_counters(self.device)
        # The decode GEMMs' cuBLASLt algorithms, under the carve-out and on every SM, tuned when the decode
        # graphs are captured
        self.carved_gemms = None
        self._tune_decode_gemms = tune_decode_gemms
        self.samples = samples
        self.graphs = None  # engine.cuda_graphs.DecodeGraphs once enable_cuda_graphs ran
        self.step_graphs = None  # engine.step_graphs.StepGraphs: the other steps, once enable_cuda_graphs ran
        self.lora_meta = None
        if lora_pool is not None:  # one segment per request at most (lora_segments merges, never splits)
            self.lora_meta = SgmvMetaBuffers(
                req_to_token.shape[0], lora_pool.num_slots + 1, self.device, tuple(lora_pool.targets), pad_slot=lora_pool.base_slot
            )
        self.generators: dict[int, torch.Generator] = {}  # request uid -> its sampling generator
        # The latest step's sampled tokens, by sampling row (rank 0 fills it; a chained plan reads it).
        self.last_tokens = torch.zeros(req_to_token.shape[0], dtype=torch.int64, device=self.device)
        self._num_last = 0
        # Seconds of each slot load (zeroing and issuing the copies; on CUDA they run on a side stream),
        # drained by the front's metrics sampler (rank 0 lives in the front's process).
        self.recent_load_seconds: deque[float] = deque(maxlen=1024)

    @property
    def attention_backend(self) -> str:
        return self.attention.name

    def enable_cuda_graphs(self, max_batch: int, buckets: tuple[int, ...] | None = None, max_tokens: int = 0) -> None:
        """Capture decode steps of up to max_batch requests (0: none), and any other step of up to
        max_tokens tokens (0: none); later steps of those shapes replay them."""
        from engine.cuda_graphs import DecodeGraphs  # imports Triton kernels: CUDA only
        from engine.step_graphs import StepGraphs

        # The chunked backend re-segments on the host per step and the reference one reads the segments
        # back to the host, which a captured graph cannot follow; the plain Triton ops compute the same.
        ops = sgmv_ops("triton") if self.lora_ops in (sgmv_ops("chunked"), sgmv_ops("ref")) else self.lora_ops
        pool = None
        if max_tokens > 0:  # the largest activations first: the decode graphs then reuse their memory
            self.step_graphs = StepGraphs(
                self.model, self.kv, self.req_to_token, max_tokens, self.lora_pool, ops, fused_expand=self._fused_expand,
                gemm_tail=self.gemm_tail,
            )
            self.step_graphs.capture()
            pool = self.step_graphs.pool
        if max_batch > 0:
            c = self.model.config
            decode = DecodeKernelBackend(self.req_to_token, c.num_heads, c.num_kv_heads, c.head_dim)
            if self._tune_decode_gemms and self.device.type == "cuda":
                self._tune_carved(DecodeGraphs.bucket_sizes(max_batch, buckets))
            self.graphs = DecodeGraphs(
                self.model, self.kv, decode, max_batch, self.lora_pool, ops, buckets, self.lora_side, sm_carveout=self.lora_sm_carveout,
                sm_carveout_targets=self.lora_sm_carveout_targets,
                fused_expand=self._decode_fused_expand, fused_delta=self._decode_fused_delta,
                norm_shrink=self._decode_norm_shrink, shrink_counters=self._shrink_counters,
                segment_buckets=self._lora_graph_segments,
            )  # fmt: skip
            self.graphs.pool = pool
            self.graphs.capture()

    def _tune_carved(self, row_counts: list[int]) -> None:
        """CarvedGemms for the decode GEMMs at these row counts: under their carve-outs (LoRA steps, where
        there is a side stream) and on every SM (the projections without LoRA work), which each layer's
        projections then take (`tuned_gemms`); the first layers' projections stand for every layer's: they
        share their shapes."""
        from engine.carved_gemms import GRAPH_CALLS, CarvedGemms  # only where the option is on (CUDA)

        def projections(layer) -> dict:
            attn, mlp = layer.self_attn, layer.mlp
            return {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}

        linears = {t: [projections(layer)[t] for layer in self.model.layers[:GRAPH_CALLS]] for t in ("qkv", "o", "gate_up", "down")}
        self.carved_gemms = CarvedGemms(self.device)
        if self.lora_side is not None:
            targets = [t for t in linears if t in self.lora_pool.targets]
            carveouts = {t: self.lora_sm_carveout_targets.get(t, self.lora_sm_carveout) for t in targets}
            self.carved_gemms.tune({t: linears[t] for t in targets}, row_counts, carveouts)
        self.carved_gemms.tune(linears, row_counts, dict.fromkeys(linears, 0))
        for layer in self.model.layers:
            for linear in projections(layer).values():
                linear.tuned_gemms = self.carved_gemms

    @staticmethod
    def _usable_carveout(flag: str, asked: int, num_sms: int) -> int:
        usable = usable_sm_carveout(asked, num_sms)
        if usable != asked:
            log.warning("%s%d is more than half of %d SMs: using %d", flag, asked, num_sms, usable)
        return usable

    @torch.inference_mode()
    def launch(self, plan: StepPlan, adapters: Mapping[str, PackedAdapter] | None = None) -> SampledTokens:
        """Apply the plan's slot loads and table writes, queue the forward of its tokens and the sampling;
        the result holds one sampled token per sampling row, in order (none on a worker that does not
        sample)."""
        self._load_adapters(plan, adapters or {})
        self._write_table(plan.table_writes)
        for uid in plan.released:
            self.generators.pop(uid, None)
        if not plan.num_requests:
            return SampledTokens(None)
        if plan.chained and self.model.tp.size > 1:
            self.model.tp.broadcast_from_first(self.last_tokens[: self._num_last])
        if self.graphs is not None and plan.is_decode and self.graphs.can_run(plan.num_requests):
            logits = self._run_graph(plan)
        elif self.step_graphs is not None and self.step_graphs.can_run(plan.num_tokens, plan.num_requests):
            logits = self._run_step_graph(plan)
        else:
            logits = self._run_eager(plan)
        rows = [s for s in plan.samples if s is not None]
        self._num_last = len(rows)  # what a chained plan after this one may name (rank 0 samples them)
        if logits is None or not self.samples:
            return SampledTokens(None)
        generators = [None if s.params.is_greedy else self._generator(s.uid, s.params.seed) for s in rows]
        tokens = sample(logits, [s.params for s in rows], generators)
        self.last_tokens[: len(rows)].copy_(tokens)
        return SampledTokens(tokens)

    def _input_ids(self, plan: StepPlan) -> torch.Tensor:
        ids = self._tensor(plan.input_ids)
        return resolve_previous(ids, self.last_tokens) if plan.chained else ids

    def _run_eager(self, plan: StepPlan) -> torch.Tensor | None:
        metadata = self.attention.prepare(list(plan.req_rows), list(plan.prefix_lens), list(plan.extend_lens))
        attn = AttentionInputs(self._tensor(plan.out_cache_loc), metadata)
        hidden = self.model(self._input_ids(plan), self._tensor(plan.positions), attn, self.kv, self._lora_inputs(plan))
        rows = plan.sample_rows
        if not rows:
            return None
        return self.model.compute_logits(hidden[self._tensor(rows)])  # [N, vocab]

    def _run_graph(self, plan: StepPlan) -> torch.Tensor:
        lora_slots = None
        if self.lora_pool is not None and plan.lora_slots is not None:
            lora_slots = self._slots(plan.lora_slots)  # DecodeGraphs.run waits for their loads
        previous = self.last_tokens if plan.chained else None
        return self.graphs.run(list(plan.input_ids), list(plan.positions), list(plan.out_cache_loc), list(plan.req_rows), lora_slots, previous)

    def _run_step_graph(self, plan: StepPlan) -> torch.Tensor | None:
        rows = plan.sample_rows
        lora_slots = None
        if self.lora_pool is not None and plan.lora_slots is not None:
            lora_slots = self._slots(plan.lora_slots)  # StepGraphs.run waits for their loads
        previous = self.last_tokens if plan.chained else None
        logits = self.step_graphs.run(
            list(plan.input_ids), list(plan.positions), list(plan.out_cache_loc), list(plan.req_rows),
            list(plan.prefix_lens), list(plan.extend_lens), rows, lora_slots, previous,
        )  # fmt: skip
        return logits if rows else None

    def _lora_inputs(self, plan: StepPlan) -> LoraInputs | None:
        """One segment per request (its tokens are contiguous); None when no request uses an adapter."""
        pool = self.lora_pool
        if pool is None or plan.lora_slots is None:
            return None
        slots = self._slots(plan.lora_slots)
        pool.wait_for_loads(slots)  # only this step's slots: loads ahead for waiting requests run on
        seg_lens, seg_slots = lora_segments(list(plan.extend_lens), slots, DECODE_RUN if plan.is_decode else 0)
        meta = self.lora_meta.fill(seg_lens, seg_slots, pool.ranks, pool.scalings, pool.target_ranks)
        side = self.lora_side if plan.is_decode else None
        idle = pool.idle_targets(seg_slots)
        tail_blocks = 0
        if self.gemm_tail is not None and not plan.is_decode and plan.num_tokens >= TAIL_MIN_TOKENS:
            tail_blocks = self.gemm_tail.assign(pool, seg_slots) or 0  # None (more adapters than blocks): in line
        return LoraInputs(
            pool, meta, *self.lora_ops, side=side, by_target=self.lora_meta.by_target(meta), idle=idle,
            fused_expand=self._fused_expand, sm_carveout=self.lora_sm_carveout if side is not None else 0,
            sm_carveout_targets=self.lora_sm_carveout_targets if side is not None else {},
            decode_fused_expand=self._decode_fused_expand if side is not None else frozenset(),
            decode_fused_delta=self._decode_fused_delta if side is not None else frozenset(),
            decode_norm_shrink=self._decode_norm_shrink if side is not None else frozenset(),
            shrink_counters=self._shrink_counters, tail=self.gemm_tail, tail_blocks=tail_blocks,
        )  # fmt: skip

    def _slots(self, lora_slots: tuple[int, ...]) -> list[int]:
        base = self.lora_pool.base_slot
        return [slot if slot >= 0 else base for slot in lora_slots]

    def _load_adapters(self, plan: StepPlan, adapters: Mapping[str, PackedAdapter]) -> None:
        for load in plan.loads:
            if load.digest not in adapters:
                raise LookupError(f"the plan loads adapter {load.digest[:12]} into slot {load.slot} without its packed copy")
            started = time.perf_counter()
            self.lora_pool.load(load.slot, adapters[load.digest])
            self.recent_load_seconds.append(time.perf_counter() - started)

    def _write_table(self, writes: tuple[tuple[int, int, tuple[int, ...]], ...]) -> None:
        """Record the plan's KV slots in this worker's table: one host tensor of (flat cell, slot) pairs,
        one copy and one scatter (this runs on the loop thread every step, a decode step writing a cell
        a request)."""
        if not writes:
            return
        width = self.req_to_token.shape[1]
        cells: dict[int, int] = {}  # the last write of a cell wins, as in the front's table
        for row, start, slots in writes:
            first = row * width + start
            cells.update(zip(range(first, first + len(slots)), slots, strict=True))
        pairs = self._tensor((list(cells), list(cells.values())))  # [2, cells]: no cell twice
        self.req_to_token.view(-1).index_copy_(0, pairs[0], pairs[1])

    def _generator(self, uid: int, seed: int | None) -> torch.Generator:
        generator = self.generators.get(uid)
        if generator is None:
            generator = self.generators[uid] = make_generator(seed, self.device)
        return generator

    def _tensor(self, values) -> torch.Tensor:
        # made in pinned memory on CUDA: a copy out of pageable memory may wait for the stream to drain,
        # which would stall the planning of the next step behind this one
        host = torch.tensor(values, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        return host.to(self.device, non_blocking=True)


class SampledTokens:
    """A launched step's sampled tokens: copied to pinned host memory behind the step's work on the
    stream; `result` waits for that copy alone."""

    def __init__(self, tokens: torch.Tensor | None):
        self._event = None
        if tokens is not None and tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            tokens = host
        self._tokens = tokens

    def result(self) -> list[int]:
        if self._tokens is None:
            return []
        if self._event is not None:
            self._event.synchronize()
        return self._tokens.tolist()
