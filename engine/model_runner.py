"""Turns a scheduled step into tensors, runs the model, and samples the next tokens.

Per-step metadata is built on the CPU from Python lists (no device sync) into one AttentionInputs.
"""

from __future__ import annotations

import itertools

import torch

from engine.forward_inputs import AttentionInputs, KVBuffers
from engine.lora_inputs import LoraInputs, SgmvMetaBuffers, sgmv_ops
from engine.lora_pool import LoraSlotPool
from engine.models.blocks import DecoderModel
from engine.sampling import sample
from engine.scheduler import BatchEntry
from kernels.attention_sdpa import SdpaPlan


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        kv: KVBuffers,
        req_to_token: torch.Tensor,
        device: torch.device | str,
        attention_backend: str = "ref",  # "ref" (kernels/attention_ref.py) or "sdpa" (kernels/attention_sdpa.py)
        lora_pool: LoraSlotPool | None = None,
        lora_backend: str = "ref",  # SGMV ops: "ref" (PyTorch), "triton" or "chunked"
    ):
        if attention_backend not in ("ref", "sdpa"):
            raise ValueError(f"attention_backend must be 'ref' or 'sdpa', not {attention_backend!r}")
        self.model = model
        self.kv = kv
        self.req_to_token = req_to_token  # [max_reqs, max_context]: the ReqToTokenPool's table
        self.device = torch.device(device)
        self.attention_backend = attention_backend
        self.lora_pool = lora_pool
        self.lora_ops = sgmv_ops(lora_backend)
        self.graphs = None  # engine.cuda_graphs.DecodeGraphs once enable_cuda_graphs ran
        self.lora_meta = None
        if lora_pool is not None:  # one segment per request at most
            self.lora_meta = SgmvMetaBuffers(req_to_token.shape[0], lora_pool.num_slots + 1, self.device)

    def enable_cuda_graphs(self, max_batch: int, buckets: tuple[int, ...] | None = None) -> None:
        """Capture decode steps of up to max_batch requests; later all-decode steps replay them."""
        from engine.cuda_graphs import DecodeGraphs  # imports Triton kernels: CUDA only

        # The chunked backend re-segments on the host per step, which a captured graph cannot follow;
        # for decode (one token per segment) it computes what the plain Triton ops compute.
        ops = sgmv_ops("triton") if self.lora_ops == sgmv_ops("chunked") else self.lora_ops
        self.graphs = DecodeGraphs(self.model, self.kv, self.req_to_token, max_batch, self.lora_pool, ops, buckets)
        self.graphs.capture()

    @torch.inference_mode()
    def run(self, entries: list[BatchEntry]) -> list[int]:
        """Forward the step; returns one sampled token per entry whose `samples` is true, in order."""
        if self.graphs is not None and self._is_decode(entries):
            return self._run_graph(entries)
        input_ids, positions, out_cache_loc = [], [], []
        for e in entries:
            input_ids += e.req.all_ids[e.start : e.start + e.extend_len]
            positions += range(e.start, e.start + e.extend_len)
            out_cache_loc += e.req.kv_slots[e.start : e.start + e.extend_len]
        attn = self._attention_inputs(entries, out_cache_loc)
        lora = self._lora_inputs(entries)
        hidden = self.model(self._tensor(input_ids), self._tensor(positions), attn, self.kv, lora)  # [T, hidden]
        ends = list(itertools.accumulate(e.extend_len for e in entries))
        sampling = [(end - 1, e.req) for end, e in zip(ends, entries, strict=True) if e.samples]
        if not sampling:
            return []
        rows = self._tensor([row for row, _ in sampling])
        logits = self.model.compute_logits(hidden[rows])  # [N, vocab] fp32
        reqs = [req for _, req in sampling]
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        return tokens.tolist()

    def _attention_inputs(self, entries: list[BatchEntry], out_cache_loc: list[int]) -> AttentionInputs:
        req_rows = [e.req.req_row for e in entries]
        prefix_lens = [e.start for e in entries]
        extend_lens = [e.extend_len for e in entries]
        plan = None
        if self.attention_backend == "sdpa":
            plan = SdpaPlan.build(req_rows, prefix_lens, extend_lens, self.req_to_token, self.device)
        return AttentionInputs(
            out_cache_loc=self._tensor(out_cache_loc),
            req_to_token=self.req_to_token,
            req_pool_indices=self._tensor(req_rows),
            prefix_lens=self._tensor(prefix_lens),
            extend_lens=self._tensor(extend_lens),
            sdpa_plan=plan,
        )

    def _is_decode(self, entries: list[BatchEntry]) -> bool:
        return self.graphs.can_run(len(entries)) and all(e.extend_len == 1 and e.samples for e in entries)

    def _run_graph(self, entries: list[BatchEntry]) -> list[int]:
        pool = self.lora_pool
        lora_slots = None
        if pool is not None and any(e.req.lora_slot >= 0 for e in entries):
            lora_slots = [e.req.lora_slot if e.req.lora_slot >= 0 else pool.base_slot for e in entries]
        logits = self.graphs.run(
            [e.req.all_ids[e.start] for e in entries],
            [e.start for e in entries],
            [e.req.kv_slots[e.start] for e in entries],
            [e.req.req_row for e in entries],
            lora_slots,
        )
        reqs = [e.req for e in entries]
        return sample(logits, [r.params for r in reqs], [r.generator for r in reqs]).tolist()

    def _lora_inputs(self, entries: list[BatchEntry]) -> LoraInputs | None:
        """One segment per request (its tokens are contiguous); None when no request uses an adapter."""
        pool = self.lora_pool
        if pool is None or all(e.req.lora_slot < 0 for e in entries):
            return None
        pool.wait_for_loads()
        slots = [e.req.lora_slot if e.req.lora_slot >= 0 else pool.base_slot for e in entries]
        meta = self.lora_meta.fill([e.extend_len for e in entries], slots, pool.ranks, pool.scalings)
        return LoraInputs(pool, meta, *self.lora_ops)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)
