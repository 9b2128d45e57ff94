"""Continuous batching with chunked prefill under a per-step token budget, admission FCFS within a
tenant and by fair share between tenants (engine/fair_share.py), and retraction of running requests
when KV runs out.

A step is a list of `BatchEntry`: running requests (decodes and unfinished prefill chunks, in arrival
order), then newly admitted ones while the token budget, the running cap and KV allow; the step then
lists base-model requests first and each adapter's requests together (`by_adapter`). After
admission, the adapters of requests still waiting may be loaded ahead into free slots (at most
`max_lora_load_ahead` a step, queue order): their copies then run beside this step's forward, not
inside the step that admits them. A slot that admission loads evicts an idle adapter no waiting request
needs while there is one (the eviction policy's choice among the wanted ones otherwise), so it does not
evict what the next admissions or loads ahead would load again.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.drain import StarvationDrain
from engine.errors import Code
from engine.fair_share import FairShare
from engine.kv_pool import num_new_pages
from engine.lora_manager import LoraManager
from engine.request import Failed, Finished, FinishReason, Request
from engine.request_kv import RequestKV


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64
    max_batch_tokens: int = 2048  # tokens computed per step: decodes + prefill chunks
    max_lora_load_ahead: int = 0  # adapters of waiting requests loaded per step before their turn; 0 = off

    def __post_init__(self) -> None:
        if self.max_batch_tokens < self.max_running_requests:
            raise ValueError("max_batch_tokens must be >= max_running_requests (each decode needs a token)")


@dataclass(frozen=True)
class BatchEntry:
    req: Request
    start: int  # kv_len before this step: position of the first computed token
    extend_len: int
    samples: bool  # the step computes the request's last pending token, so it samples the next

    @classmethod
    def grown(cls, req: Request, extend_len: int) -> BatchEntry:
        """The entry of a request whose KV just grew by extend_len slots."""
        start = req.kv_len - extend_len
        return cls(req, start, extend_len, start + extend_len == req.seq_len)


def by_adapter(entries: list[BatchEntry]) -> list[BatchEntry]:
    """The step's entries with each adapter's requests next to each other (stable: arrival order within
    an adapter; base-model requests first): a decode step's LoRA kernels then read each adapter once for
    its run of rows (engine/lora_inputs.py, `lora_segments`)."""
    return sorted(entries, key=lambda e: e.req.lora_slot)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: RequestKV,
        clock: Callable[[], float] = time.monotonic,
        lora: LoraManager | None = None,
        drain: StarvationDrain | None = None,  # None: no starvation drain
        fair_share: FairShare | None = None,  # None: the default weights
    ):
        self.config = config
        self.kv = kv
        self.lora = lora
        self.drain = drain
        self.clock = clock
        self.fair_share = fair_share or FairShare()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_retractions = 0
        self._num_by_tenant: Counter[str] = Counter()  # requests waiting or running, per tenant
        self._counted: set[int] = set()  # id() of the requests _num_by_tenant counts
        self.released: list[int] = []  # uids of requests finished since the last plan

    def take_released(self) -> list[int]:
        released, self.released = self.released, []
        return released

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, req: Request) -> None:
        self.fair_share.on_arrival(req.tenant, self._num_by_tenant)
        self._num_by_tenant[req.tenant] += 1
        self._counted.add(id(req))
        self.waiting.append(req)

    def schedule(self) -> list[BatchEntry]:
        self._reap()
        budget = self.config.max_batch_tokens
        entries: list[BatchEntry] = []
        for req in list(self.running):
            if req not in self.running:  # retracted earlier in this loop
                continue
            extend_len = min(req.num_pending, budget)
            if extend_len and self._grow_or_retract(req, extend_len):
                entries.append(BatchEntry.grown(req, extend_len))
                budget -= extend_len
        for entry in entries:  # charged before admission, so the running tenants' service counts now
            self._charge(entry)
        if self.drain is not None and self.lora is not None:
            self.drain.update(self.waiting, self.running, self.lora)
        entries += self._admit_waiting(budget)
        self._load_ahead()
        return by_adapter(entries)

    def schedule_ahead(self, in_flight: list[Request]) -> list[BatchEntry]:
        """The next decode step of the running batch, planned while the step computing `in_flight`'s
        next tokens still runs (the overlapped schedule): every running request is in that step and
        takes one more token, whose input is the token that step samples. Requests that step brings to
        max_new_tokens are left out (they finish on its tokens); a stop token or string found in them
        later only wastes the request's row of this step.

        Empty, and nothing changed, where only a normal `schedule` may decide: a request to admit
        (a free running place and someone waiting), a cancelled or expired request, a running request
        outside `in_flight` (a prefill in chunks), or KV that would need an eviction or a retraction.
        Requests of `in_flight` that have finished since it was planned (a spare row) are left out."""
        in_flight = [r for r in in_flight if not r.is_finished]
        if len(in_flight) != len(self.running) or (self.waiting and len(self.running) < self.config.max_running_requests):
            return []
        now = self.clock()
        if any(r.is_cancelled or (r.deadline is not None and now > r.deadline) for r in in_flight):
            return []
        continuing = [r for r in in_flight if len(r.output_ids) + 1 < r.params.max_new_tokens]
        page_size = self.kv.page_size
        if sum(num_new_pages(r.kv_len, 1, page_size) for r in continuing) > self.kv.allocator.num_free_pages:
            return []
        entries = []
        for req in continuing:
            self.kv.grow(req, 1)
            entry = BatchEntry(req, req.kv_len - 1, 1, True)
            self._charge(entry)
            entries.append(entry)
        if entries:
            self._load_ahead()
        return entries  # in_flight's order: by adapter already (`schedule` sorted it, slots stay put)

    def finish(self, req: Request, event: Finished | Failed) -> None:
        """End req: cache its KV, free the rest, and send its last event."""
        if id(req) in self._counted:
            self._counted.discard(id(req))
            self._num_by_tenant[req.tenant] -= 1
            if not self._num_by_tenant[req.tenant]:
                del self._num_by_tenant[req.tenant]
        req.is_finished = True
        self.released.append(req.uid)
        self._release(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.emit(event)

    def finished_event(self, req: Request, reason: FinishReason, matched_stop: str = "") -> Finished:
        return Finished(reason, matched_stop, len(req.prompt_ids), len(req.output_ids), max(req.first_cached_len, 0))

    # ---- internals ---------------------------------------------------------------------------

    def _load_ahead(self) -> None:
        if self.lora is not None and self.config.max_lora_load_ahead > 0:
            waiting = [(r.namespace, r.packed_adapter) for r in self.waiting if r.namespace]
            self.lora.load_ahead(waiting, self.config.max_lora_load_ahead)

    def _can_admit_more(self) -> bool:
        return len(self.running) < self.config.max_running_requests and self.kv.can_admit()

    def _admit_waiting(self, budget: int) -> list[BatchEntry]:
        """Admission in fair-share order (FCFS within a tenant); a request whose adapter cannot get a
        slot now (or is being drained) waits without blocking others. A slot load evicts an idle adapter
        no waiting request needs when there is one: `wanted` counts the waiting requests per adapter,
        once per step; a request failed here leaves it (an admitted one's adapter is in use, so never a
        victim in this step either way)."""
        entries, slot_blocked = [], []
        wanted = Counter(r.namespace for r in self.waiting if r.namespace) if self.lora is not None else Counter()
        try:
            while self.waiting and budget > 0 and self._can_admit_more():
                req = self._pop_next()
                no_slot = req.namespace and self.lora is not None and not self.lora.can_acquire(req.namespace)
                if no_slot or (self.drain is not None and self.drain.blocks(req)):
                    slot_blocked.append(req)  # still waiting: its adapter stays wanted
                    continue
                entry = self._admit(req, budget, wanted)
                if entry is None:
                    if self.running:  # KV frees as running requests finish
                        self.waiting.appendleft(req)
                        break
                    _unwant(wanted, req.namespace)
                    self.finish(req, self._too_big())  # nothing will ever free enough KV for it
                    continue
                self.running.append(req)
                entries.append(entry)
                self._charge(entry)
                budget -= entry.extend_len
        finally:  # an admission that raises must not lose the requests set aside above
            self.waiting.extendleft(reversed(slot_blocked))
        return entries

    def _pop_next(self) -> Request:
        index = self.fair_share.pick(self.waiting)
        req = self.waiting[index]
        del self.waiting[index]
        return req

    def _charge(self, entry: BatchEntry) -> None:
        prompt_len = len(entry.req.prompt_ids)
        num_prompt = max(0, min(entry.start + entry.extend_len, prompt_len) - entry.start)
        self.fair_share.charge(entry.req.tenant, num_prompt, entry.extend_len - num_prompt)

    def _admit(self, req: Request, budget: int, wanted: Counter[str]) -> BatchEntry | None:
        self.kv.admit(req)
        extend_len = min(req.num_pending, budget)
        if not self.kv.grow(req, extend_len):
            self.kv.release(req)
            return None
        if req.namespace and self.lora is not None:
            try:
                req.lora_slot = self.lora.acquire(req.namespace, req.packed_adapter, wanted)
            except Exception:
                self.kv.truncate(req, req.cached_len)  # nothing of this step was computed
                self.kv.release(req)
                self.waiting.appendleft(req)  # so the loop's failure path reaches it
                raise
        return BatchEntry.grown(req, extend_len)

    def _release(self, req: Request) -> None:
        self.kv.release(req)
        if req.lora_slot >= 0:
            self.lora.release(req.namespace)
            req.lora_slot = -1

    def _grow_or_retract(self, req: Request, extend_len: int) -> bool:
        """Grow req, retracting the latest-arrived other running requests while KV is short."""
        while not self.kv.grow(req, extend_len):
            victim = self.running[-1]
            if victim is req and len(self.running) == 1:
                self.finish(req, self._too_big())
                return False
            self._retract(victim)
            if victim is req:
                return False
        return True

    def _too_big(self) -> Failed:
        return Failed(Code.RESOURCE_EXHAUSTED, f"the request needs more KV than the pool's {self.kv.allocator.num_slots} slots")

    def _retract(self, req: Request) -> None:
        """Free req's KV (its computed prefix stays cached) and queue it first to re-run later."""
        self._release(req)
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.num_retractions += 1

    def _reap(self) -> None:
        now = self.clock()
        for req in [*self.running, *self.waiting]:
            if req.is_cancelled:
                self.finish(req, self.finished_event(req, FinishReason.CANCELLED))
            elif req.deadline is not None and now > req.deadline:
                self.finish(req, Failed(Code.DEADLINE_EXCEEDED, "the request's deadline passed"))


def _unwant(wanted: Counter[str], namespace: str) -> None:
    """A waiting request of namespace left the queue; an adapter no request waits for leaves `wanted`."""
    wanted[namespace] -= 1
    if wanted[namespace] <= 0:  # (a base request's "" was never counted: -1)
        del wanted[namespace]
