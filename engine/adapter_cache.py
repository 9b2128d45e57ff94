"""The host cache of adapters: packed, LRU-evicted, in pinned memory when a GPU is present.

It sits between the adapter source (local files now, the registry later) and the GPU slots; entries
are keyed by digest, never by name.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch

from engine.lora_pool import FusedTarget, PackedAdapter
from engine.pinned_arena import HostReads, PinnedArena
from loraformat.peft_compile import CanonicalAdapter

ARENA_ALIGN = 256  # bytes between a packed adapter's tensors in an arena block


def pack_adapter(
    digest: str, adapter: CanonicalAdapter, targets: dict[str, FusedTarget], dtype: torch.dtype, pin: bool, share: bool = False,
    arena: PinnedArena | None = None,
) -> PackedAdapter:
    """Lay a canonical adapter out per fused target (full, unsharded dims); projections it lacks become
    zeros, and a target none of whose projections it adapts is left out (PackedAdapter). pin:
    page-locked (async copies to one GPU), in a block of `arena` when one is given and has room (the
    block goes back when the PackedAdapter is collected), else freshly pinned; share: in shared memory,
    so that tensor-parallel worker processes read this one copy."""
    rank, num_layers = adapter.rank, adapter.num_layers
    a, b = {}, {}
    for name, target in targets.items():
        if all(adapter.module_weights(layer, m) is None for layer in range(num_layers) for m in target.modules):
            continue
        a_t = torch.zeros(num_layers, target.num_stack * rank, target.in_dim, dtype=dtype)
        b_t = torch.zeros(num_layers, target.out_dim, rank, dtype=dtype)
        for layer in range(num_layers):
            for k, module in enumerate(target.modules):
                weights = adapter.module_weights(layer, module)
                if weights is None:
                    continue
                lora_a, lora_b = weights  # [rank, in], [out, rank]
                offset, size = target.output_slices[k]
                a_t[layer, k * rank : (k + 1) * rank] = lora_a
                b_t[layer, offset : offset + size] = lora_b
        a[name], b[name] = a_t, b_t
    packed = (*a.values(), *b.values())
    block = arena.take(sum(_aligned(t.nbytes) for t in packed)) if arena is not None and pin and not share else None
    if block is None:
        a, b = ({name: _place(t, pin, share) for name, t in tensors.items()} for tensors in (a, b))
    else:
        reads = HostReads()
        try:
            a, b = _into_arena(arena, block[0], (a, b))
            result = PackedAdapter(digest=digest, rank=rank, scaling=adapter.scaling, a=a, b=b, reads=reads)
        except BaseException:
            arena.give_back(*block, reads)
            raise
        weakref.finalize(result, arena.give_back, *block, reads)
        return result
    return PackedAdapter(digest=digest, rank=rank, scaling=adapter.scaling, a=a, b=b)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN


def _into_arena(arena: PinnedArena, offset: int, groups: tuple[dict[str, torch.Tensor], ...]) -> list[dict[str, torch.Tensor]]:
    """Each tensor copied into the arena from `offset` on, one after another (aligned)."""
    placed = []
    for tensors in groups:
        views = {}
        for name, t in tensors.items():
            views[name] = arena.view(offset, t.nbytes, t.dtype, tuple(t.shape)).copy_(t)
            offset += _aligned(t.nbytes)
        placed.append(views)
    return placed


def _place(t: torch.Tensor, pin: bool, share: bool) -> torch.Tensor:
    if share:
        return t.share_memory_()
    return t.pin_memory() if pin else t


class HostAdapterCache:
    """Packed adapters by digest: every adapter a GPU slot holds, plus at most `max_adapters` others,
    the least recently used of those evicted first.

    An adapter in a slot keeps its host copy (`resident`, set by LoraManager): a request for it must not
    fetch it again, and a slot reload after its eviction reads this copy. So the cache holds at most
    max_adapters + the number of slots entries, and max_adapters below the slot count never makes the
    engine refetch what it is serving.

    Thread-safe: request handlers fill it before submitting, the engine loop reads it. An evicted
    entry stays alive while a queued request still holds it (Request.packed_adapter).

    Lookup counters, one per request that looks an adapter up (hits + misses + joined = lookups): a hit
    found it here; a miss started the one fetch of its digest (so misses = fetches); a joined lookup
    found that fetch in flight and waited for it without fetching. `get` counts hits; whoever fetches
    (EngineCore.prepare) counts misses and joined lookups, since it alone knows which fetches are shared.
    """

    def __init__(self, max_adapters: int):
        if max_adapters < 1:
            raise ValueError("max_adapters must be >= 1")
        self.max_adapters = max_adapters
        self._entries: OrderedDict[str, PackedAdapter] = OrderedDict()
        self._lock = threading.Lock()
        # digest -> whether a GPU slot holds it (LoraManager sets it); read under the lock, never written
        self.resident: Callable[[str], bool] = lambda digest: False
        self.num_hits = 0
        self.num_misses = 0
        self.num_joined = 0

    def __contains__(self, digest: str) -> bool:
        with self._lock:
            return digest in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get(self, digest: str) -> PackedAdapter | None:
        """The cached entry (a hit, now most recently used), or None (counted by the caller)."""
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                return None
            self.num_hits += 1
            self._entries.move_to_end(digest)
            return entry

    def count_miss(self, joined: bool = False) -> None:
        """A lookup that missed: it starts the digest's fetch, or (joined) waits for the one in flight."""
        with self._lock:
            if joined:
                self.num_joined += 1
            else:
                self.num_misses += 1

    def put(self, adapter: PackedAdapter) -> None:
        """Insert (or refresh) as the most recently used, then evict the least recently used entries no
        slot holds while more than max_adapters of those remain."""
        with self._lock:
            self._entries[adapter.digest] = adapter
            self._entries.move_to_end(adapter.digest)
            evictable = [digest for digest in self._entries if not self.resident(digest)]  # oldest first
            for digest in evictable[: max(0, len(evictable) - self.max_adapters)]:
                del self._entries[digest]

    def adopt(self, adapter: PackedAdapter) -> None:
        """Keep the host copy a slot just took (a request's, which the cache may have evicted since its
        fetch) so that later requests for it find it; no lookup is counted."""
        with self._lock:
            present = adapter.digest in self._entries
        if not present:
            self.put(adapter)

    def ranks(self) -> dict[str, int]:
        """digest -> rank of every cached adapter (a snapshot)."""
        with self._lock:
            return {digest: adapter.rank for digest, adapter in self._entries.items()}

    def discard(self, digest: str) -> None:
        with self._lock:
            self._entries.pop(digest, None)
