"""CUDA-graph replay of prefill, chunked-prefill and mixed prefill + decode steps, by padded token count.

A step of T tokens from B requests replays the graph captured for the smallest token bucket >= T (and
LoRA on/off). Every input the graph reads lives in static buffers allocated once for the largest
bucket: token ids, positions and KV slots of each new token; the attention plan (lorakernels/
extend_attention.py, `ExtendPlanBuffers`: each request's row, prefix and extend length and the list of
query blocks); the LoRA segments (`SgmvMetaBuffers`); the rows whose logits are sampled. A replay copies
the step's values in and pads the rest:

    tokens T..bucket-1   id 0, position 0, KV slot 0 (the reserved page): in no request and no LoRA
                         segment, so attention and the LoRA kernels skip them; row-wise ops compute
                         garbage there that no real row reads
    query blocks         past the step's: a padding request with no token and no key (no work)
    LoRA segments        past the step's: empty; each kernel launches for any segmentation of its rows
                         (lorakernels/sgmv.py finds a program's segment on the device)
    sample rows          past the step's: row 0, dropped (the LM head runs after the replay, on the
                         sampling rows only)

Decode steps replay the smaller decode graphs (engine/cuda_graphs.py) instead; a step with more tokens
than the largest bucket runs eagerly. The two sets share one memory pool: replays never overlap.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Callable

import torch

from engine.attention import TritonMetadata
from engine.cuda_graphs import capture_steps
from engine.forward_inputs import AttentionInputs, KVBuffers, StagingFence, resolve_previous
from engine.lora_inputs import LoraInputs, SgmvMetaBuffers, lora_segments
from engine.lora_pool import LoraSlotPool
from engine.lora_tail import MIN_TOKENS as TAIL_MIN_TOKENS
from engine.lora_tail import GemmTail, block_variants
from engine.models.blocks import DecoderModel

log = logging.getLogger(__name__)
# Padded step sizes: fine steps for small mixed steps, where launches would dominate an eager step, and
# coarser ones where GEMMs are compute-bound (the scheduler fills its token budget, so full steps fit
# exactly: the budget is always a bucket).
TOKEN_BUCKETS = (16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)


def token_buckets(max_tokens: int, buckets: tuple[int, ...] | None = None) -> list[int]:
    """The padded step sizes captured for steps of up to max_tokens tokens (max_tokens itself included;
    above the table, every 512 tokens)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    table = set(buckets or TOKEN_BUCKETS) | set(range(2048 + 512, max_tokens, 512))
    return sorted({b for b in table if b < max_tokens} | {max_tokens})


class StepGraphs:
    def __init__(
        self,
        model: DecoderModel,
        kv: KVBuffers,
        req_to_token: torch.Tensor,  # [max_reqs, max_context]: the worker's table
        max_tokens: int,
        lora_pool: LoraSlotPool | None,
        lora_ops: tuple,
        buckets: tuple[int, ...] | None = None,  # padded token counts to capture; default TOKEN_BUCKETS
        capture: bool = True,  # False: run the same static-buffer step eagerly (a CPU test of the padding)
        fused_expand: frozenset[str] = frozenset({"gate_up"}),  # LoraInputs.fused_expand of the LoRA graphs
        gemm_tail: GemmTail | None = None,  # LoRA graphs of MIN_TOKENS+ tokens: the LoRA in the GEMMs, every block
    ):
        from lorakernels.extend_attention import ExtendPlanBuffers  # Triton: imported on use

        self.model, self.kv, self.req_to_token = model, kv, req_to_token
        self.lora_pool, self.lora_ops, self.fused_expand = lora_pool, lora_ops, fused_expand
        self.gemm_tail = gemm_tail if lora_pool is not None else None
        self.device = req_to_token.device
        self.max_reqs = req_to_token.shape[0]
        self.buckets = token_buckets(max_tokens, buckets)
        n = self.buckets[-1]
        # input ids, positions, KV slots (padding -> slot 0), then the sample rows: one device block,
        # staged whole from one pinned host block that `run` fills in numpy
        self._inputs = torch.zeros(3 * n + self.max_reqs, dtype=torch.int64, device=self.device)
        self.input_ids, self.positions, self.out_cache_loc = self._inputs[: 3 * n].view(3, n)
        self.sample_rows = self._inputs[3 * n :]
        pin = self.device.type == "cuda"
        self._host = torch.zeros(3 * n + self.max_reqs, dtype=torch.int64, pin_memory=pin)
        self._host_values = self._host.numpy()
        self._fence = StagingFence(self.device)
        c = model.config
        self.plans = ExtendPlanBuffers(n, self.max_reqs, c.num_heads // c.num_kv_heads, self.device)
        slots = lora_pool.num_slots + 1 if lora_pool else 0
        self.lora_meta = SgmvMetaBuffers(
            self.max_reqs, slots, self.device, tuple(lora_pool.targets), pad_slot=lora_pool.base_slot
        ) if lora_pool else None  # fmt: skip
        self.capture_graphs = capture
        # (bucket, with_lora, tail blocks) -> what runs the step: its graph's replay, or the step function
        # uncaptured; a bucket whose LoRA steps add their LoRA in the GEMMs' tail has a LoRA graph per
        # block count (`tail_variants`, 0 in line), the others tail blocks 0
        self.steps: dict[tuple[int, bool, int], Callable[[], torch.Tensor]] = {}
        self.pool = None  # the graphs' memory pool, shared by every capture (replays never overlap)
        self.num_replays = 0

    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its memory)."""
        loras = (False, True) if self.lora_pool else (False,)
        keys = [
            (bucket, with_lora, blocks)
            for bucket in reversed(self.buckets)
            for with_lora in loras
            for blocks in (self.tail_variants(bucket) if with_lora else (0,))
        ]
        self.steps, self.pool = capture_steps(keys, self._step, self.device, self.pool, self.capture_graphs)
        if self.capture_graphs:
            log.info("captured %d step graphs for token counts %s", len(self.steps), self.buckets)

    def can_run(self, num_tokens: int, num_requests: int) -> bool:
        return 0 < num_tokens <= self.buckets[-1] and 0 < num_requests <= self.max_reqs

    def _tailed(self, bucket: int) -> bool:
        """Whether this bucket's LoRA graph adds the LoRA in the GEMMs' tail (engine/lora_tail.py)."""
        return self.gemm_tail is not None and bucket >= TAIL_MIN_TOKENS

    def tail_variants(self, bucket: int) -> tuple[int, ...]:
        """The tail block counts this bucket's LoRA graphs cover: (0,) where it runs in line, else 0 (a
        step of more adapters than blocks, or of none) and powers of two up to the tail's blocks, and its
        blocks (a step replays the smallest that covers the blocks its adapters hold, so a one-adapter
        prompt's GEMMs widen by one block, not by all)."""
        return (0, *block_variants(self.gemm_tail.blocks)) if self._tailed(bucket) else (0,)

    def run(
        self, input_ids: list[int], positions: list[int], out_cache_loc: list[int], req_rows: list[int],
        prefix_lens: list[int], extend_lens: list[int], sample_rows: list[int], lora_slots: list[int] | None,
        previous: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Replay the step of the smallest bucket >= its token count; the logits of sample_rows
        [len(sample_rows), vocab] logits (computed after the replay). previous: the last step's sampled
        tokens (a chained plan)."""
        t, s = len(input_ids), len(sample_rows)
        bucket = self.buckets[bisect.bisect_left(self.buckets, t)]
        n = self.buckets[-1]
        host = self._host_values  # numpy over the pinned block: no torch call a row
        self._fence.refill()
        host[:] = 0
        for row, values in enumerate((input_ids, positions, out_cache_loc)):
            host[row * n : row * n + t] = values
        host[3 * n : 3 * n + s] = sample_rows
        self.plans.fill(req_rows, prefix_lens, extend_lens)
        self._inputs.copy_(self._host, non_blocking=True)  # one copy of the whole block
        with_lora = lora_slots is not None
        tail_blocks = 0
        if with_lora:
            pool = self.lora_pool
            pool.wait_for_loads(lora_slots)  # loads ahead into other slots keep running beside the replay
            seg_lens, seg_slots = lora_segments(list(extend_lens), lora_slots)
            self.lora_meta.fill(seg_lens, seg_slots, pool.ranks, pool.scalings, pool.target_ranks)
            if self._tailed(bucket):
                used = self.gemm_tail.assign(pool, seg_slots)  # None: more adapters than blocks, in line
                tail_blocks = 0 if used is None else min(c for c in self.tail_variants(bucket) if c >= used)
        self._fence.copied()
        if previous is not None:
            self.input_ids[:bucket].copy_(resolve_previous(self.input_ids[:bucket], previous))
        hidden_rows = self.steps[(bucket, with_lora, tail_blocks)]()
        self.num_replays += 1
        # the LM head runs after the replay, on the rows that sample: graphs of every bucket holding
        # [rows, vocab] outputs would pin about a gigabyte at Llama-3's vocabulary
        return self.model.compute_logits(hidden_rows[:s])

    def _step(self, bucket: int, with_lora: bool, tail_blocks: int):
        """The forward of a `bucket`-token step over the static buffers: the final hidden states of
        min(bucket, max_reqs) sample rows (each request has a token, so a step of bucket tokens samples
        at most that many). tail_blocks > 0: the LoRA in the GEMMs' tail, over that many blocks."""
        rows = min(bucket, self.max_reqs)
        # the Triton extend kernel over the static plan (its host lists are then never read)
        metadata = TritonMetadata(self.req_to_token, [], [], [], plan=self.plans.plan(bucket))
        attn = AttentionInputs(self.out_cache_loc[:bucket], metadata)
        lora = None
        if with_lora:
            pool = self.lora_pool
            # every segment a step can have (empty ones included) and any length: the kernels' grids
            # then cover every segmentation a replay brings (lorakernels/sgmv.py)
            meta = self.lora_meta.fill([0] * rows, [pool.base_slot] * rows, pool.ranks, pool.scalings, pool.target_ranks)
            meta = dataclasses.replace(meta, max_seg_len=bucket, host_seg_lens=None, host_slots=None)  # replays differ
            lora = LoraInputs(
                pool, meta, *self.lora_ops, by_target=self.lora_meta.by_target(meta), fused_expand=self.fused_expand,
                tail=self.gemm_tail if tail_blocks else None, tail_blocks=tail_blocks,
            )  # fmt: skip

        def step() -> torch.Tensor:
            hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], attn, self.kv, lora)
            return hidden[self.sample_rows[:rows]]  # [rows, hidden]

        return step
