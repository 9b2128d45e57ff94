"""Which adapter sits in which GPU slot: acquisition by running requests, eviction, pinning.

Invariants: a slot used by a running request (num_users > 0) or pinned is never evicted; at most
num_slots - 1 slots are pinned, so one slot always stays available to unpinned adapters. The
eviction policy is a named function over the evictable slots (LRU by default, FIFO selectable).
Admission (`acquire`) takes an empty slot, else the policy's victim among the evictable slots whose
adapter no waiting request needs (`wanted`), and only when every evictable slot holds a wanted adapter,
the policy's victim among them all: evicting an adapter that is about to be admitted costs a reload.
A load ahead (`load_ahead`, for a request still waiting) places an adapter without a user: it takes an
empty slot, else the policy's victim among the evictable slots whose adapter no waiting request needs;
it never falls back to a wanted one.

Deciding only: placing an adapter records a `LoadSlot` command (and keeps its packed host copy) for the
next step plan; the model workers perform the copies. An emptied slot needs no command: no segment of
a plan names it until a later load, which zeroes it first.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection
from dataclasses import dataclass

from engine.lora_pool import PackedAdapter
from engine.step_plan import LoadSlot


@dataclass
class SlotState:
    index: int
    digest: str | None = None  # None: empty
    rank: int = 0  # the loaded adapter's rank
    num_users: int = 0  # running requests that use the slot
    is_pinned: bool = False
    last_used: float = 0.0
    loaded_at: float = 0.0

    @property
    def is_evictable(self) -> bool:
        return self.num_users == 0 and not self.is_pinned


def lru_victim(candidates: list[SlotState]) -> SlotState:
    return min(candidates, key=lambda s: s.last_used)


def fifo_victim(candidates: list[SlotState]) -> SlotState:
    return min(candidates, key=lambda s: s.loaded_at)


EVICTION_POLICIES: dict[str, Callable[[list[SlotState]], SlotState]] = {"lru": lru_victim, "fifo": fifo_victim}


class SlotsExhausted(RuntimeError):
    """No slot can take the adapter now (all used by running requests or pinned)."""


class AdapterSlots:
    def __init__(self, num_slots: int, policy: str = "lru", clock: Callable[[], float] | None = None):
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction policy {policy!r} is not one of {sorted(EVICTION_POLICIES)}")
        self.num_slots = num_slots
        self.choose_victim = EVICTION_POLICIES[policy]
        self.clock = clock or itertools.count().__next__
        self.slots = [SlotState(i) for i in range(num_slots)]
        self._by_digest: dict[str, SlotState] = {}
        self._loads: list[LoadSlot] = []  # decided, not yet handed to the workers
        self._packed: dict[str, PackedAdapter] = {}  # the host copies those loads read
        self.num_loads = 0  # loads ahead included
        self.num_loads_ahead = 0
        self.num_evictions = 0
        # bumped whenever a slot's digest, rank or pin changes: the metrics sampler, which runs after
        # every step, recomputes residency only then
        self.version = 0

    def take_loads(self) -> tuple[tuple[LoadSlot, ...], dict[str, PackedAdapter]]:
        """The loads decided since the last call, in order, with the packed adapters they copy."""
        loads, packed = tuple(self._loads), self._packed
        self._loads, self._packed = [], {}
        return loads, packed

    def slot_of(self, digest: str) -> int | None:
        state = self._by_digest.get(digest)
        return None if state is None else state.index

    def can_acquire(self, digest: str) -> bool:
        return digest in self._by_digest or self._free_slot() is not None

    def acquire(self, digest: str, load: Callable[[], PackedAdapter], wanted: Collection[str] = ()) -> int:
        """The slot holding digest for one more running request; loads it when absent, evicting when no
        slot is empty: an idle adapter outside `wanted` (those waiting requests need) when there is one."""
        state = self._by_digest.get(digest) or self._place(digest, load, self._free_slot(spare=wanted))
        state.num_users += 1
        state.last_used = self.clock()
        return state.index

    def load_ahead(self, digest: str, load: Callable[[], PackedAdapter], keep: Collection[str]) -> int | None:
        """Place digest, not yet used, so that its copy runs before its request's turn; never evicts an
        adapter in `keep` (those waiting requests need). Returns its slot, or None: already placed, or
        no slot is empty or evictable outside `keep`."""
        if digest in self._by_digest:
            return None
        state = self._free_slot(keep=keep)
        if state is None:
            return None
        self._place(digest, load, state)
        self.num_loads_ahead += 1
        return state.index

    def release(self, digest: str) -> None:
        state = self._by_digest[digest]
        if state.num_users <= 0:
            raise ValueError(f"adapter {digest[:12]} released more often than acquired")
        state.num_users -= 1
        state.last_used = self.clock()

    def pin(self, digest: str, load: Callable[[], PackedAdapter]) -> int:
        num_pinned = sum(s.is_pinned for s in self.slots)
        state = self._by_digest.get(digest)
        if state is None or not state.is_pinned:
            if num_pinned >= self.num_slots - 1:
                raise SlotsExhausted(f"at most {self.num_slots - 1} of {self.num_slots} slots may be pinned")
            state = state or self._place(digest, load, self._free_slot())
            state.is_pinned = True
            self.version += 1
        return state.index

    def unpin(self, digest: str) -> None:
        state = self._by_digest.get(digest)
        if state is not None and state.is_pinned:
            state.is_pinned = False
            self.version += 1

    def evict(self, digest: str) -> bool:
        """Drop digest from its slot if nothing uses it; returns whether it is gone."""
        state = self._by_digest.get(digest)
        if state is None:
            return True
        if state.num_users or state.is_pinned:
            return False
        self._empty(state)
        return True

    def _free_slot(self, keep: Collection[str] = (), spare: Collection[str] = ()) -> SlotState | None:
        """An empty slot, else the policy's victim among the evictable slots outside `keep`, taken among
        those outside `spare` too while there are any."""
        empty = [s for s in self.slots if s.digest is None]
        if empty:
            return empty[0]
        evictable = [s for s in self.slots if s.is_evictable and s.digest not in keep]
        candidates = [s for s in evictable if s.digest not in spare] or evictable
        return self.choose_victim(candidates) if candidates else None

    def _place(self, digest: str, load: Callable[[], PackedAdapter], state: SlotState | None) -> SlotState:
        """Load digest into state (emptying it first), the slot `_free_slot` chose; None: none could be."""
        if state is None:
            raise SlotsExhausted("every slot is used by running requests or pinned")
        if state.digest is not None:
            self._empty(state)
            self.num_evictions += 1
        packed = self._packed[digest] = load()
        self._loads.append(LoadSlot(state.index, digest))
        state.digest, state.rank = digest, packed.rank
        state.loaded_at = state.last_used = self.clock()
        self._by_digest[digest] = state
        self.num_loads += 1
        self.version += 1
        return state

    def _empty(self, state: SlotState) -> None:
        del self._by_digest[state.digest]
        state.digest = None
        self.version += 1
