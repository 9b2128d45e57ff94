"""The plain-data boundary between the front (scheduler, KV and slot bookkeeping) and the model workers.

The front turns a scheduled step into a `StepPlan`: lists of ints and frozen settings, no `Request`, no
tensor, picklable as is (it crosses a process boundary once per step with tensor parallelism). A worker
executes a plan against what it owns (model shard, KV buffers, request-to-token table, LoRA slots,
sampling generators) and returns the sampled tokens. Running example, a step with a decode of request
row 3 (7 tokens cached) and the 4-token first chunk of row 5 with adapter slot 1:

    input_ids  [t7, p0, p1, p2, p3]     positions [7, 0, 1, 2, 3]     out_cache_loc [41, 12, 13, 14, 15]
    req_rows   [3, 5]   prefix_lens [7, 0]   extend_lens [1, 4]
    samples    [SampleRow(uid 9, params), None]      (row 5 still has prompt tokens to compute)
    lora_slots [base, 1]    loads [LoadSlot(1, "ab12...")]    table_writes [(3, 7, (41,)), (5, 0, (12, 13, 14, 15))]

A plan made before the previous step's tokens reached the front (the overlapped schedule: step k+1 is
planned and launched while step k runs) is `chained`: an input id -1 - i stands for the token the
previous step sampled in its sampling row i, which the workers substitute on the device.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from engine.sampling import SamplingParams


@dataclass(frozen=True)
class SampleRow:
    """A request row that samples this step: its settings and the key of its generator on the worker."""

    uid: int  # unique per request for the engine's life (client request ids may repeat)
    params: SamplingParams


@dataclass(frozen=True)
class LoadSlot:
    """Copy the packed adapter `digest` (shared host memory) into adapter slot `slot`: issued before the
    step's forward, which waits for it only if one of its rows reads `slot` (a load ahead for a queued
    request runs beside the forward)."""

    slot: int
    digest: str


@dataclass(frozen=True)
class StepPlan:
    input_ids: tuple[int, ...]  # [T] the step's new tokens, request after request
    positions: tuple[int, ...]  # [T]
    out_cache_loc: tuple[int, ...]  # [T] KV slot each new token's K/V is written to
    req_rows: tuple[int, ...]  # [B] each request's row of the request-to-token table
    prefix_lens: tuple[int, ...]  # [B] tokens already in the KV cache
    extend_lens: tuple[int, ...]  # [B] new tokens this step
    samples: tuple[SampleRow | None, ...]  # [B] None: the row computes KV only (a mid-prefill chunk)
    lora_slots: tuple[int, ...] | None  # [B] adapter slot per request, -1 = base model; None = no adapter
    loads: tuple[LoadSlot, ...] = ()  # slot loads (admission's, then ahead for queued requests), issued first
    table_writes: tuple[tuple[int, int, tuple[int, ...]], ...] = ()  # (row, start, KV slots) to record
    released: tuple[int, ...] = ()  # uids of finished requests: their generators can go
    chained: bool = False  # input ids < 0 name the previous step's sampled tokens (see the module doc)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_requests(self) -> int:
        return len(self.req_rows)

    @property
    def is_decode(self) -> bool:
        """One token per request, every request sampling: the shape a captured decode graph replays."""
        return bool(self.req_rows) and all(e == 1 for e in self.extend_lens) and all(self.samples)

    @property
    def sample_rows(self) -> list[int]:
        """The hidden-state rows (last token of each sampling request) whose logits are sampled."""
        rows, end = [], 0
        for extend_len, sample in zip(self.extend_lens, self.samples, strict=True):
            end += extend_len
            if sample is not None:
                rows.append(end - 1)
        return rows


class PlanEntry(NamedTuple):
    """One scheduled request as the front sees it, reduced to what the plan needs (no Request). A
    NamedTuple: the front makes one for every running request every step, at under half a frozen
    dataclass's cost."""

    uid: int
    input_ids: list[int]  # the ids of tokens [start, start + extend_len)
    kv_slots: list[int]
    req_row: int
    start: int
    extend_len: int
    params: SamplingParams | None  # None: this step does not sample the request
    lora_slot: int  # -1: the base model
    previous_row: int = -1  # >= 0: the one input token is the previous step's sample of this row


def build_plan(
    entries: Iterable[PlanEntry],
    loads: Iterable[LoadSlot] = (),
    table_writes: Iterable[tuple[int, int, tuple[int, ...]]] = (),
    released: Iterable[int] = (),
) -> StepPlan:
    input_ids, positions, out_cache_loc = [], [], []
    rows, prefix_lens, extend_lens, samples, slots = [], [], [], [], []
    chained = False
    for e in entries:
        end = e.start + e.extend_len
        if e.previous_row >= 0:
            input_ids.append(-1 - e.previous_row)
            chained = True
        else:
            input_ids += e.input_ids
        positions += range(e.start, end)
        out_cache_loc += e.kv_slots[e.start : end]
        rows.append(e.req_row)
        prefix_lens.append(e.start)
        extend_lens.append(e.extend_len)
        samples.append(None if e.params is None else SampleRow(e.uid, e.params))
        slots.append(e.lora_slot)
    return StepPlan(
        input_ids=tuple(input_ids),
        positions=tuple(positions),
        out_cache_loc=tuple(out_cache_loc),
        req_rows=tuple(rows),
        prefix_lens=tuple(prefix_lens),
        extend_lens=tuple(extend_lens),
        samples=tuple(samples),
        lora_slots=tuple(slots) if any(s >= 0 for s in slots) else None,
        loads=tuple(loads),
        table_writes=tuple(table_writes),
        released=tuple(released),
        chained=chained,
    )
