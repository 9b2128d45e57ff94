"""Adapter residency for the scheduler: host cache -> GPU slot, keyed by digest.

Composes the slot assignment (AdapterSlots), the host cache and the adapter source; the scheduler asks
`can_acquire` before admitting a request and `acquire`/`release` around its run.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.adapter_cache import HostAdapterCache
from engine.adapter_slots import AdapterSlots
from engine.lora_pool import LoraSlotPool, PackedAdapter


class LoraManager:
    def __init__(self, pool: LoraSlotPool, slots: AdapterSlots, host_cache: HostAdapterCache, fetch: Callable[[str], PackedAdapter]):
        self.pool = pool
        self.slots = slots
        self.host_cache = host_cache
        self.fetch = fetch  # digest -> packed adapter, on a host-cache miss
        self._retired: set[str] = set()  # deleted in the registry: dropped once no request uses them

    def packed(self, digest: str) -> PackedAdapter:
        adapter = self.host_cache.get(digest)
        if adapter is None:
            adapter = self.fetch(digest)
            self.host_cache.put(adapter)
        return adapter

    def can_acquire(self, digest: str) -> bool:
        return self.slots.can_acquire(digest)

    def acquire(self, digest: str, packed: PackedAdapter | None = None) -> int:
        """The slot of digest for one more running request; `packed` (if given) spares a host lookup."""
        self._retired.discard(digest)  # the same content may come back under another name
        return self.slots.acquire(digest, lambda: packed or self.packed(digest))

    def release(self, digest: str) -> None:
        self.slots.release(digest)
        if digest in self._retired and self.slots.evict(digest):
            self._retired.discard(digest)

    def pin(self, digest: str, packed: PackedAdapter | None = None) -> int:
        return self.slots.pin(digest, lambda: packed or self.packed(digest))

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
