"""CUDA-graph replay of decode steps: one captured graph per padded batch size (and per LoRA on/off; with
LoRA, per variant of skipped targets and, with EngineConfig.lora_graph_segments, per segment count).

Every input the graph reads lives in a static buffer allocated here once: token ids, positions, the
KV slot of each new token, each request's table row and length, and the LoRA segment metadata; the
attention backend builds its own graph metadata over the row and length buffers (`capture_metadata`). A step copies its values into the first n rows, pads the rest (length 0,
KV slot 0 of the reserved page, the base LoRA slot) and replays; logits of the n real rows come out.
"""

from __future__ import annotations

import bisect
import dataclasses
import gc
import logging
from collections.abc import Callable, Mapping

import numpy as np
import torch

from engine.attention import DecodeKernelBackend
from engine.forward_inputs import AttentionInputs, KVBuffers, StagingFence, resolve_previous
from engine.lora_inputs import DECODE_RUN, LoraInputs, SgmvMetaBuffers, lora_segments
from engine.lora_pool import LoraSlotPool
from engine.models.blocks import DecoderModel

log = logging.getLogger(__name__)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


class DecodeGraphs:
    def __init__(
        self,
        model: DecoderModel,
        kv: KVBuffers,
        attention: DecodeKernelBackend,
        max_batch: int,
        lora_pool: LoraSlotPool | None,
        lora_ops: tuple,
        buckets: tuple[int, ...] | None = None,  # padded batch sizes to capture; default BATCH_BUCKETS
        lora_side: torch.cuda.Stream | None = None,  # the LoRA deltas' stream (LoraInputs.side)
        capture: bool = True,  # False: run the same static-buffer step eagerly (a CPU test of the padding)
        sm_carveout: int = 0,  # LoraInputs.sm_carveout of the LoRA graphs
        sm_carveout_targets: Mapping[str, int] | None = None,  # LoraInputs.sm_carveout_targets of the LoRA graphs
        fused_expand: frozenset[str] = frozenset(),  # LoraInputs.decode_fused_expand of the LoRA graphs
        fused_delta: frozenset[str] = frozenset(),  # LoraInputs.decode_fused_delta of the LoRA graphs
        norm_shrink: frozenset[str] = frozenset(),  # LoraInputs.decode_norm_shrink of the LoRA graphs
        shrink_counters: torch.Tensor | None = None,  # LoraInputs.shrink_counters of the LoRA graphs
        segment_buckets: tuple[int, ...] = (),  # LoRA graphs also for steps of at most these many segments
    ):
        self.model, self.kv, self.attention = model, kv, attention
        self.lora_pool, self.lora_ops, self.lora_side = lora_pool, lora_ops, lora_side
        self.sm_carveout, self.fused_expand, self.fused_delta = sm_carveout, fused_expand, fused_delta
        self.sm_carveout_targets = dict(sm_carveout_targets or {})
        self.norm_shrink, self.shrink_counters = norm_shrink, shrink_counters
        self.device = attention.req_to_token.device
        self.buckets = self.bucket_sizes(max_batch, buckets)
        if any(n < 1 for n in segment_buckets):
            raise ValueError(f"segment buckets must be positive, got {segment_buckets}")
        self.segment_buckets = tuple(sorted(set(segment_buckets)))
        self._segment_counts = {batch: self.segment_counts(batch) for batch in self.buckets}  # run() reads them each step
        n = max_batch
        # the int64 inputs, one row each, and seq_lens as int64; staged whole from one pinned host block
        self._inputs = torch.zeros(5, n, dtype=torch.int64, device=self.device)
        self.input_ids, self.positions, self.out_cache_loc, self.req_rows = self._inputs[:4]  # padding -> KV slot 0
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=self.device)
        self._host = torch.zeros(5, n, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._host_rows = self._host.numpy()  # the same bytes: filled in numpy, no torch call a row
        self._fence = StagingFence(self.device)
        self.lora_meta = SgmvMetaBuffers(
            n, lora_pool.num_slots + 1, self.device, tuple(lora_pool.targets), pad_slot=lora_pool.base_slot
        ) if lora_pool else None  # fmt: skip
        self.capture_graphs = capture
        # The LoRA graphs of a batch size: one whose projections all run their LoRA kernels, and one whose
        # o, gate_up and down skip them, for steps whose adapters adapt only q/k/v (PEFT's default q/v);
        # a captured graph launches every kernel it was captured with, its programs exiting at once when
        # no row adapts the target. Each variant is named by the fused targets it skips.
        targets = tuple(lora_pool.targets) if lora_pool else ()
        skip_beyond_qkv = frozenset(t for t in targets if t != "qkv")
        self.lora_variants: tuple[frozenset[str], ...] = (
            (skip_beyond_qkv, frozenset()) if "qkv" in targets and skip_beyond_qkv else (frozenset(),)
        ) if lora_pool else ()  # fmt: skip
        # (batch, skipped targets or None without LoRA, LoRA segments) -> what runs the step: its graph's
        # replay, or the step function uncaptured
        self.steps: dict[tuple[int, frozenset[str] | None, int], Callable[[], torch.Tensor]] = {}
        self.pool = None
        self.num_replays = 0

    @staticmethod
    def bucket_sizes(max_batch: int, buckets: tuple[int, ...] | None = None) -> list[int]:
        """The padded batch sizes captured: the buckets below max_batch, and max_batch."""
        return sorted({b for b in (buckets or BATCH_BUCKETS) if b < max_batch} | {max_batch})

    def segment_counts(self, batch: int) -> list[int]:
        """The segment counts a batch size's LoRA graphs are captured for: `batch` (one segment a row, every
        step fits), and each segment bucket below it that a step can fit (a padded batch of `batch` rows
        is at least cdiv(batch, DECODE_RUN) runs). A graph's LoRA kernels launch programs for its count:
        a step of few adapters replayed in the graph of the fewest segments that hold its own skips the
        programs of the padding segments."""
        least = -(-batch // DECODE_RUN)
        return sorted({n for n in self.segment_buckets if least <= n < batch} | {batch})

    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its memory pool)."""
        keys = [
            key for batch in reversed(self.buckets)
            for key in [(batch, None, batch)] + [
                (batch, skipped, n) for skipped in self.lora_variants for n in reversed(self._segment_counts[batch])
            ]
        ]  # fmt: skip
        self.steps, self.pool = capture_steps(keys, self._step, self.device, self.pool, self.capture_graphs)
        if self.capture_graphs:
            log.info("captured %d decode graphs for batch sizes %s", len(self.steps), self.buckets)

    def can_run(self, num_requests: int) -> bool:
        return 0 < num_requests <= self.buckets[-1]

    def run(
        self, input_ids: list[int], positions: list[int], out_cache_loc: list[int], req_rows: list[int], lora_slots: list[int] | None,
        previous: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Replay the graph of the smallest bucket >= n; returns the logits of the n rows [n, vocab].
        previous: the last step's sampled tokens, which input ids -1 - i name (a chained plan)."""
        n = len(input_ids)
        batch = self.buckets[bisect.bisect_left(self.buckets, n)]
        # This runs on the loop thread every decode step: the rows are written in numpy through the
        # pinned block's array and go to the device in one copy of the whole block (contiguous, a few KB;
        # columns past the bucket are stale and never read), where a torch call a row each way was ~25.
        rows = self._host_rows
        self._fence.refill()
        rows[:, n:batch] = 0
        rows[0, :n], rows[1, :n], rows[2, :n], rows[3, :n] = input_ids, positions, out_cache_loc, req_rows
        np.add(rows[1, :n], 1, out=rows[4, :n])  # seq_len = position of the new token + 1
        self._inputs.copy_(self._host, non_blocking=True)
        self._fence.copied()
        self.seq_lens[:batch].copy_(self._inputs[4, :batch])  # to int32, on the device
        if previous is not None:
            self.input_ids[:batch].copy_(resolve_previous(self.input_ids[:batch], previous))
        skipped, num_segments = None, batch
        if lora_slots is not None:
            pool = self.lora_pool
            pool.wait_for_loads(lora_slots)  # loads ahead into other slots keep running beside the replay
            slots = lora_slots + [pool.base_slot] * (batch - n)
            seg_lens, seg_slots = lora_segments([1] * batch, slots, DECODE_RUN)
            self.lora_meta.fill(seg_lens, seg_slots, pool.ranks, pool.scalings, pool.target_ranks)
            idle = pool.idle_targets(lora_slots)
            skipped = next(v for v in self.lora_variants if v <= idle)  # the most skipped first
            counts = self._segment_counts[batch]
            num_segments = counts[bisect.bisect_left(counts, len(seg_lens))]
        logits = self.steps[(batch, skipped, num_segments)]()
        self.num_replays += 1
        return logits[:n]

    def _step(self, batch: int, skipped: frozenset[str] | None, num_segments: int) -> Callable[[], torch.Tensor]:
        """The decode step of `batch` padded rows over the static buffers, returning [batch, vocab] logits;
        skipped: the fused targets whose LoRA kernels it leaves out (None: no LoRA at all); num_segments:
        the LoRA segments its kernels are launched for (the step's own and empty ones after them)."""
        metadata = self.attention.capture_metadata(self.req_rows[:batch], self.seq_lens[:batch])
        attn = AttentionInputs(out_cache_loc=self.out_cache_loc[:batch], metadata=metadata)
        lora = None
        if skipped is not None:
            pool = self.lora_pool
            seg_lens = [batch // num_segments + (i < batch % num_segments) for i in range(num_segments)]
            meta = self.lora_meta.fill(seg_lens, [pool.base_slot] * num_segments, pool.ranks, pool.scalings, pool.target_ranks)
            # replays merge each adapter's rows into one segment (`lora_segments`): size the grids for that
            meta = dataclasses.replace(meta, max_seg_len=min(batch, DECODE_RUN))
            by_target = self.lora_meta.by_target(meta)  # views of the buffers: replays see each refill
            lora = LoraInputs(
                pool, meta, *self.lora_ops, side=self.lora_side, by_target=by_target, idle=skipped, sm_carveout=self.sm_carveout,
                sm_carveout_targets=self.sm_carveout_targets,
                decode_fused_expand=self.fused_expand, decode_fused_delta=self.fused_delta,
                decode_norm_shrink=self.norm_shrink, shrink_counters=self.shrink_counters,
            )  # fmt: skip

        def step() -> torch.Tensor:
            hidden = self.model(self.input_ids[:batch], self.positions[:batch], attn, self.kv, lora)
            return self.model.compute_logits(hidden)  # [batch, vocab]

        return step


@dataclasses.dataclass
class CapturedStep:
    """A captured step: its graph, the static tensor it returns, and the step function itself, kept
    alive with the graph because it holds what the graph reads outside its pool (an attention
    workspace, LoRA inputs). torch.cuda.graph empties the allocator's cache at every capture, so memory
    a graph still names but nothing holds would be unmapped (an illegal address at the next replay) or
    handed to another tensor."""

    graph: torch.cuda.CUDAGraph
    output: torch.Tensor
    step: Callable[[], torch.Tensor]

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


def capture_steps(
    keys: list, make_step: Callable[..., Callable[[], torch.Tensor]], device: torch.device, pool, capture: bool = True
) -> tuple[dict, object]:
    """{key: what runs the step make_step(*key)}, in the order of keys: its captured graph's replay (the
    bound method keeps the graph and what it reads alive), or the step itself when not capture (a CPU
    test of the static buffers); and the memory pool the captures share."""
    steps = {}
    for key in keys:
        step = make_step(*key)
        if capture:
            captured, pool = capture_graph(step, device, pool)
            step = captured.replay
        steps[key] = step
    return steps, pool


def capture_graph(step: Callable[[], torch.Tensor], device: torch.device, pool) -> tuple[CapturedStep, object]:
    """Capture step() (it returns one tensor) into a graph sharing memory pool `pool` (None: a new
    one); returns the captured step and the pool to pass to the next capture."""
    with torch.inference_mode():
        for _ in range(2):  # compile kernels and settle allocations outside the capture
            step()
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        # No garbage collection inside the capture: collecting another engine's graph there (a cycle
        # that outlived its engine) destroys it mid-capture, which CUDA refuses and the capture fails.
        enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=pool):
                output = step()
        finally:
            if enabled:
                gc.enable()
    return CapturedStep(graph, output, step), graph.pool()
