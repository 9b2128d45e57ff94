"""Adapter residency for the scheduler: which digest sits in which slot, and the host cache, keyed by digest.

Composes the slot assignment (AdapterSlots) and the host cache; the scheduler asks `can_acquire` before
admitting a request, `acquire`/`release` around its run, and after admission `load_ahead` for the
requests still waiting. It only decides: the slot loads it decides leave through `take_loads` in the
next step plan, and the workers copy them. Every packed adapter comes from one path,
`EngineCore.prepare` (local file or registry fetch -> pack -> host cache), before its request is
submitted or its pin applied; here a missing host copy is a bug, not a reason to fetch.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from engine.adapter_cache import HostAdapterCache
from engine.adapter_slots import AdapterSlots
from engine.lora_pool import PackedAdapter
from engine.step_plan import LoadSlot


class LoraManager:
    def __init__(self, slots: AdapterSlots, host_cache: HostAdapterCache):
        self.slots = slots
        self.host_cache = host_cache
        # a slot's adapter keeps its host copy: requests for it need no fetch (see HostAdapterCache)
        host_cache.resident = lambda digest: slots.slot_of(digest) is not None
        self._retired: set[str] = set()  # deleted in the registry: dropped once no request uses them

    @property
    def num_slots(self) -> int:
        return self.slots.num_slots

    @property
    def base_slot(self) -> int:
        """The slot index of base-model rows in SGMV metadata: rank 0 forever (see LoraSlotPool)."""
        return self.slots.num_slots

    def can_acquire(self, digest: str) -> bool:
        return self.slots.can_acquire(digest)

    def acquire(self, digest: str, packed: PackedAdapter | None = None, wanted: Collection[str] = ()) -> int:
        """The slot of digest for one more running request; `packed` is the request's host copy. An
        eviction spares the adapters in `wanted` (those of waiting requests) while another is idle."""
        self._retired.discard(digest)  # the same content may come back under another name
        return self.slots.acquire(digest, lambda: self._host_copy(digest, packed), wanted)

    def release(self, digest: str) -> None:
        self.slots.release(digest)
        if digest in self._retired and self.slots.evict(digest):
            self._retired.discard(digest)

    def load_ahead(self, waiting: Sequence[tuple[str, PackedAdapter | None]], max_loads: int) -> int:
        """Load the adapters of waiting requests ((digest, host copy) in queue order) that no slot holds,
        at most max_loads, so that their copies overlap the steps before their turn. A slot taken ahead
        stays evictable (admission may still take it); it never evicts what a waiting request needs.
        A request without a host copy (admission fetches before it submits) is left to admission. Returns
        the number of loads decided."""
        wanted: dict[str, PackedAdapter | None] = {}  # digest -> a host copy, in queue order
        for digest, packed in waiting:
            wanted[digest] = wanted.get(digest) or packed
        num_loads = 0
        for digest, packed in wanted.items():
            if num_loads >= max_loads:
                break
            if packed is None or self.slots.slot_of(digest) is not None:
                continue
            if self.slots.load_ahead(digest, lambda d=digest, p=packed: self._host_copy(d, p), wanted) is None:
                break  # no slot is empty or evictable outside `wanted`: none for later adapters either
            num_loads += 1
        return num_loads

    def pin(self, digest: str, packed: PackedAdapter | None = None) -> int:
        return self.slots.pin(digest, lambda: self._host_copy(digest, packed))

    def unpin(self, digest: str) -> None:
        self.slots.unpin(digest)

    def retire(self, digest: str) -> bool:
        """Forget digest (deleted in the registry) now, or when its last running request ends;
        returns whether it is gone already."""
        self.host_cache.discard(digest)
        self.slots.unpin(digest)
        if self.slots.evict(digest):
            return True
        self._retired.add(digest)
        return False

    def take_loads(self) -> tuple[tuple[LoadSlot, ...], dict[str, PackedAdapter]]:
        return self.slots.take_loads()

    def _host_copy(self, digest: str, packed: PackedAdapter | None) -> PackedAdapter:
        """The copy a slot is about to take, kept in the host cache while the slot holds it."""
        packed = packed or self.host_cache.get(digest)
        if packed is None:
            raise LookupError(f"adapter {digest[:12]} has no packed host copy (EngineCore.prepare it first)")
        self.host_cache.adopt(packed)
        return packed
