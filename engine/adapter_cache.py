"""The host cache of adapters: packed, LRU-evicted, in pinned memory when a GPU is present.

It sits between the adapter source (local files now, the registry later) and the GPU slots; entries
are keyed by digest, never by name.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from engine.lora_pool import FusedTarget, PackedAdapter
from engine.pinned_arena import HostReads, PinnedArena
from loraformat.peft_compile import CanonicalAdapter
from loraformat.safetensors_io import TensorViews

ARENA_ALIGN = 256  # bytes between a packed adapter's tensors in an arena block


def pack_adapter(
    digest: str, adapter: CanonicalAdapter, targets: dict[str, FusedTarget], dtype: torch.dtype, pin: bool, share: bool = False,
    arena: PinnedArena | None = None,
) -> PackedAdapter:
    """Lay a canonical adapter out per fused target (full, unsharded dims); projections it lacks become
    zeros, and a target none of whose projections it adapts is left out (PackedAdapter). pin:
    page-locked (async copies to one GPU), in a block of `arena` when one is given and has room (the
    block goes back when the PackedAdapter is collected), else freshly pinned; share: in shared memory,
    so that tensor-parallel worker processes read this one copy.

    The tensors are allocated where they will live (the arena block, or pinned memory; shared memory is
    made by moving a fresh tensor there, one copy of uninitialized bytes) and each layer's projection is
    written into them once: no zero fill beneath the copies, no second copy into pinned memory. Packing
    runs beside the engine loop's launches (EngineCore's prep thread), so each pass over the adapter's
    bytes is time the launches may wait for the GIL or a core."""
    rank, num_layers = adapter.rank, adapter.num_layers

    def adapted() -> tuple[str, ...]:
        return tuple(n for n, t in targets.items() if any(adapter.adapts(layer, m) for layer in range(num_layers) for m in t.modules))

    if isinstance(adapter.tensors, TensorViews):  # which targets it adapts: once per distinct header
        names = adapter.tensors.header.derive(("adapted", tuple(targets.items())), adapted)
    else:
        names = adapted()
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # adapted target -> (A shape, B shape)
    for name in names:
        target = targets[name]
        shapes[name] = ((num_layers, target.num_stack * rank, target.in_dim), (num_layers, target.out_dim, rank))
    itemsize = dtype.itemsize
    nbytes = {shape: math.prod(shape) * itemsize for pair in shapes.values() for shape in pair}
    total = _block_bytes(shapes.values(), itemsize)
    block = arena.take(total) if arena is not None and pin and not share else None
    reads = HostReads()
    try:
        a, b = {}, {}
        offset = block[0] if block is not None else 0
        for name, (a_shape, b_shape) in shapes.items():
            for tensors, shape in ((a, a_shape), (b, b_shape)):
                if block is None:
                    tensors[name] = _empty(shape, dtype, pin, share)
                else:
                    tensors[name] = arena.view(offset, nbytes[shape], dtype, shape)
                    offset += _aligned(nbytes[shape])
            _fill(adapter, targets[name], a[name], b[name])
        result = PackedAdapter(digest=digest, rank=rank, scaling=adapter.scaling, a=a, b=b, reads=reads)
    except BaseException:
        if block is not None:
            arena.give_back(*block, reads)
        raise
    if block is not None:
        weakref.finalize(result, arena.give_back, *block, reads)
    return result


def _fill(adapter: CanonicalAdapter, target: FusedTarget, a: torch.Tensor, b: torch.Tensor) -> None:
    """Write every layer's projections of `target` into a [L, stack * rank, in] and b [L, out, rank],
    zeros where the adapter lacks one; every element is written once (the stacked A rows and the B
    output slices tile the tensors, layer by layer and projection by projection in order).

    Packing runs on the prep threads beside the engine loop, so it makes a handful of calls whatever the
    adapter's size. Each torch call lets go of the GIL and must take it back, a wait of up to a switch
    interval (5 ms) while the loop holds it; and a CPU copy of over 32768 elements runs as an OpenMP
    region over torch's threads (one a core), which stalls whenever a core is busy elsewhere (the loop's
    device waits, the event loop, the fetches). A copy per layer and projection, about 200 for a q/v
    adapter of a 32-layer model, was both. A read artifact whose tensors share one dtype is gathered from
    its bytes (_gather_bytes, by a plan made once per distinct artifact header); other adapters (tensors
    in memory, mixed dtypes) copy their tensors in one `torch._foreach_copy_` and zero the rest in one
    `torch._foreach_zero_`."""
    if isinstance(adapter.tensors, TensorViews):
        views = adapter.tensors
        # the plan depends on the header alone (the adapter's fields and tensors come from it)
        plan = views.header.derive(("gather", target, MIN_GATHER_ROW), lambda: _gather_plan(views, adapter, target))
        if plan is not None:
            _gather_bytes(views, plan, a, b)
            return
    rank = adapter.rank
    dst, src, zeros = [], [], []
    for layer in range(adapter.num_layers):
        for k, module in enumerate(target.modules):
            offset, size = target.output_slices[k]
            a_rows, b_rows = a[layer, k * rank : (k + 1) * rank], b[layer, offset : offset + size]
            if adapter.adapts(layer, module):
                dst += (a_rows, b_rows)
                src += adapter.module_weights(layer, module)  # lora_A [rank, in], lora_B [out, rank]
            else:
                zeros += (a_rows, b_rows)
    if dst:
        torch._foreach_copy_(dst, src)
    if zeros:
        torch._foreach_zero_(zeros)


MIN_GATHER_ROW = 256  # bytes; a finer grain gathers through index arrays as large as the adapter


@dataclass(frozen=True, eq=False)
class GatherPlan:
    """How one artifact header's bytes gather into one target's packed A and B: rows of `row` bytes;
    per part, the source row of each packed row (`rows`) and the packed rows to zero (None: none)."""

    dtype: torch.dtype  # the artifact's tensors' one dtype
    row: int
    rows: dict[str, np.ndarray]
    zero: dict[str, np.ndarray | None]


def _gather_plan(views: TensorViews, adapter: CanonicalAdapter, target: FusedTarget) -> GatherPlan | None:
    """The GatherPlan of `target` for this header: each packed tensor is the concatenation, layer by
    layer and projection by projection, of the projections' lora_A (lora_B) bytes, zeros where one is
    missing, cut into rows of R bytes (the largest size that divides every piece and offset). None when
    the tensors are of several dtypes or the pieces only line up on rows under MIN_GATHER_ROW bytes."""
    rank = adapter.rank
    infos = {part: [] for part in "AB"}  # part -> [(TensorInfo or None for zeros, elements)] in packed order
    for layer in range(adapter.num_layers):
        for k, module in enumerate(target.modules):
            present = adapter.adapts(layer, module)
            for part, numel in (("A", rank * target.in_dim), ("B", target.output_slices[k][1] * rank)):
                infos[part].append((views.info(_name(layer, module, part)) if present else None, numel))
    dtypes = {info.torch_dtype for part in infos.values() for info, _ in part if info is not None}
    if len(dtypes) != 1:
        return None
    (dtype,) = dtypes
    if [offset for offset, _ in target.output_slices] != [sum(n for _, n in target.output_slices[:k]) for k in range(target.num_stack)]:
        raise ValueError(f"target {target.name}: its output slices do not tile its output in order")
    pieces = {part: [] for part in "AB"}  # part -> [(source start or -1 for zeros, bytes)] in packed order
    for part, part_infos in infos.items():
        for info, numel in part_infos:
            nbytes = numel * dtype.itemsize
            if info is not None and info.end - info.start != nbytes:
                raise ValueError(f"{info.name}: {info.end - info.start} bytes where target {target.name} holds {nbytes}")
            pieces[part].append((-1 if info is None else info.start, nbytes))
    row = math.gcd(*(n for part in pieces.values() for start, n in part), *(start for part in pieces.values() for start, _ in part if start > 0))
    if row < MIN_GATHER_ROW:
        return None
    num_rows = len(views.data_region()) // row
    if any(start + n > num_rows * row for part in pieces.values() for start, n in part if start >= 0):
        raise ValueError(f"target {target.name}: a piece of the artifact lies past its data region")
    rows, zero = {}, {}
    for part, part_pieces in pieces.items():
        starts = np.array([max(start, 0) // row for start, _ in part_pieces])
        counts = np.array([n // row for _, n in part_pieces])
        first = np.cumsum(counts) - counts  # each piece's first row in the packed tensor
        # Present pieces lie within the region (checked above). A missing piece's rows start at row 0
        # and may run past the end, which "clip" caps in the take; they are zeroed after it.
        rows[part] = np.arange(int(counts.sum())) + np.repeat(starts - first, counts)
        missing = np.array([start < 0 for start, _ in part_pieces])
        zero[part] = np.repeat(missing, counts) if missing.any() else None
        for array in (rows[part], zero[part]):
            if array is not None:
                array.setflags(write=False)  # shared by every artifact of the header, on any thread
    return GatherPlan(dtype, row, rows, zero)


def _gather_bytes(views: TensorViews, plan: GatherPlan, a: torch.Tensor, b: torch.Tensor) -> None:
    """_fill from the artifact's bytes by `plan`, in numpy: one `np.take` of whole rows a part (on this
    thread, with the GIL let go once) and one assignment that zeroes the missing pieces. An artifact of
    another dtype than the packed tensors is gathered into a staging buffer that one torch copy converts."""
    region = views.data_region()
    rows = region[: len(region) // plan.row * plan.row].reshape(-1, plan.row)
    for part, packed in (("A", a), ("B", b)):
        out = packed if packed.dtype == plan.dtype else torch.empty(packed.shape, dtype=plan.dtype)
        out_rows = out.view(torch.uint8).numpy().reshape(-1, plan.row)
        if len(out_rows) != len(plan.rows[part]):
            raise ValueError(f"packed {part} holds {len(out_rows)} rows of {plan.row} bytes, its plan {len(plan.rows[part])}")
        # "clip": no buffered copy of `out` (unlike "raise"); a missing piece's clipped rows are zeroed
        np.take(rows, plan.rows[part], axis=0, out=out_rows, mode="clip")
        if plan.zero[part] is not None:
            out_rows[plan.zero[part]] = 0
        if out is not packed:
            packed.copy_(out)


def _name(layer: int, module: str, part: str) -> str:
    return f"layers.{layer}.{module}.lora_{part}"


def packed_bytes(targets: Iterable[FusedTarget], num_layers: int, rank: int, dtype: torch.dtype) -> int:
    """The arena bytes `pack_adapter` asks for an adapter of `rank` on every one of `targets`: the most
    any adapter of at most that rank packs to."""
    shapes = [((num_layers, t.num_stack * rank, t.in_dim), (num_layers, t.out_dim, rank)) for t in targets]
    return _block_bytes(shapes, dtype.itemsize)


def _block_bytes(shapes: Iterable[tuple[tuple[int, ...], tuple[int, ...]]], itemsize: int) -> int:
    """A packed adapter's arena bytes: each target's A and B, aligned."""
    return sum(_aligned(math.prod(shape) * itemsize) for pair in shapes for shape in pair)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN


def _empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool, share: bool) -> torch.Tensor:
    """Uninitialized host memory for a packed tensor: shared (tensor-parallel ranks read it), pinned
    (one rank copies from it asynchronously) or plain."""
    if share:
        return torch.empty(shape, dtype=dtype).share_memory_()
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


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
        self.version = 0  # bumped whenever an entry comes or goes (the metrics sampler's cue)

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
            self.version += 1

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
            if self._entries.pop(digest, None) is not None:
                self.version += 1
