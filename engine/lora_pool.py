"""The GPU memory of LoRA adapters: per fused target, A and B buffers for a fixed number of slots.

Allocated once at start; addresses never change (CUDA graphs capture them). Per fused target t with
`stack` projections sharing one input:

    A[t]: [num_layers, num_slots + 1, stack * max_rank, in_dim]     rows k*max_rank .. k*max_rank+r: A of projection k
    B[t]: [num_layers, num_slots + 1, out_dim_total, max_rank]      columns 0 .. r of projection k's output rows

Under tensor parallelism each rank holds its shard of every slot, the S-LoRA way: for a column-parallel
target (qkv, gate_up) A is whole and B holds this rank's output rows of each projection; for a
row-parallel target (o, down) A holds this rank's input columns and B is whole, so the rank's delta is a
partial sum that the layer's all-reduce completes. The dims above are then the rank's (`local_config`).

With --lora-target-modules (`modules`) only the fused targets holding one of those projections get
buffers: a q/v pool (q/k/v alone) takes 23% of an all-target pool's bytes a slot at Llama-3-8B's widths,
so the same memory holds about 4.4x the slots. The other projections then run no LoRA kernels, and an
adapter that adapts one of them is refused before it reaches a slot (engine/adapters.py).

Slot index `num_slots` is the base-model slot: rank 0 forever, so base-model tokens take the same
kernels and contribute exactly nothing. An EMPTY slot (no adapter) is a different thing: rank 0 until
an adapter is loaded into it. `ranks[s]` / `scalings[s]` hold each slot's rank and scaling, and
`target_ranks[t][s]` its rank in fused target t: 0 where the adapter adapts none of t's projections (a
q/v adapter has rank 0 in o, gate_up and down), so the kernels of t skip that slot's rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import torch

from engine.model_config import ModelConfig
from engine.parallel import SINGLE, TensorParallel, local_config
from engine.pinned_arena import HostReads
from loraformat.architectures import FusedTarget as FusedTargetSpec
from loraformat.architectures import Split


@dataclass(frozen=True)
class FusedTarget:
    name: str  # qkv | o | gate_up | down
    modules: tuple[str, ...]  # the PEFT projections stacked in this target, in order
    in_dim: int
    output_slices: tuple[tuple[int, int], ...]  # (offset, size) of each projection in the fused output
    split: Split  # how tensor parallelism shards it (column: by output, row: by input)

    @property
    def num_stack(self) -> int:
        return len(self.modules)

    @property
    def out_dim(self) -> int:
        offset, size = self.output_slices[-1]
        return offset + size


def fused_targets(config: ModelConfig, modules: Collection[str] = ()) -> tuple[FusedTarget, ...]:
    """The family spec's fused targets with this model's widths; with `modules` (projection names, the
    engine's --lora-target-modules), only the targets holding one of them: q_proj alone keeps the whole
    q/k/v target, since its projections share one buffer. Raises ValueError for a name that is no
    projection of the family."""
    known = [m for target in config.arch.fused for m in target.modules]
    unknown = sorted(set(modules) - set(known))
    if unknown:
        raise ValueError(f"LoRA target modules {unknown} are not projections of {config.arch.family} models ({', '.join(known)})")
    return tuple(_sized(t, config) for t in config.arch.fused if not modules or set(t.modules) & set(modules))


def served_modules(config: ModelConfig, modules: Collection[str] = ()) -> frozenset[str]:
    """The projections whose LoRA the slots of `fused_targets(config, modules)` hold."""
    return frozenset(m for target in fused_targets(config, modules) for m in target.modules)


def _sized(target: FusedTargetSpec, config: ModelConfig) -> FusedTarget:
    dims = [config.arch.projection(m).dims(config) for m in target.modules]  # (in, out) per projection
    offsets = [sum(out for _, out in dims[:k]) for k in range(len(dims))]
    slices = tuple((offset, out) for offset, (_, out) in zip(offsets, dims, strict=True))
    return FusedTarget(target.name, target.modules, dims[0][0], slices, target.split)


@dataclass
class PackedAdapter:
    """An adapter laid out per fused target on the host, ready for one copy per target into a slot.

    a[t]: [num_layers, stack * rank, in_dim]; b[t]: [num_layers, out_dim, rank] for each fused target t
    the adapter adapts; projections of t it lacks are zeros, and a target it lacks entirely is absent (its
    rank there is 0). Loading a packed adapter zeroes every target of the slot first, so nothing of the
    previous tenant is left.
    """

    digest: str
    rank: int
    scaling: float
    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]
    # the latest queued copy out of these tensors (LoraSlotPool.load notes it): pinned arena memory
    # (engine/pinned_arena.py) is lent again only after it
    reads: HostReads = field(default_factory=HostReads)


class LoraSlotPool:
    """Owns the slot buffers and each slot's rank/scaling; knows nothing of which adapter is where."""

    def __init__(
        self, config: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device | str, tp: TensorParallel = SINGLE,
        modules: Collection[str] = (),  # --lora-target-modules: buffers only for the targets holding these (all when empty)
    ):  # fmt: skip
        self.num_slots = num_slots
        self.base_slot = num_slots
        self.max_rank = max_rank
        self.device = torch.device(device)
        self.tp = tp
        self.targets = {t.name: t for t in fused_targets(local_config(config, tp), modules)}  # this rank's dims
        total = num_slots + 1
        layers = config.num_layers
        self.a = {t.name: torch.zeros(layers, total, t.num_stack * max_rank, t.in_dim, dtype=dtype, device=device) for t in self.targets.values()}
        self.b = {t.name: torch.zeros(layers, total, t.out_dim, max_rank, dtype=dtype, device=device) for t in self.targets.values()}
        self.ranks = [0] * total  # host copies: batch metadata is built from these, never from the device
        self.scalings = [0.0] * total
        self.target_ranks = {name: [0] * total for name in self.targets}
        # loads into each slot so far: a copy of a slot's weights elsewhere (engine/lora_tail.py) is
        # current while the count it was made at is
        self.generations = [0] * total
        is_cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if is_cuda else None
        self._pending: dict[int, torch.cuda.Event] = {}  # slot -> end of its latest load, not yet waited for
        self._views: dict[tuple[str, int], tuple[int, tuple]] = {}  # (target, slot) -> (rank, _slot_views), the latest

    def load(self, slot: int, adapter: PackedAdapter) -> None:
        """Copy the adapter into every target of `slot` and zero what it leaves (asynchronously on CUDA,
        on the copy stream: the transfer from the host at once, beside the work already queued on the
        compute stream; the slot's copies and zeroing after that work, which may still read the slot's
        previous tenant; `wait_for_loads` makes a later forward wait for them)."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not an adapter slot (0..{self.num_slots - 1})")
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter rank {adapter.rank} is over the pool's max rank {self.max_rank}")
        if not set(adapter.a) <= set(self.targets):
            raise ValueError(f"adapter adapts {sorted(set(adapter.a) - set(self.targets))}: the pool holds {sorted(self.targets)} only")
        stream = self._copy_stream
        compute = torch.cuda.current_stream(self.device) if stream is not None else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            # to the device first: these copies touch no slot, so they run beside the queued work
            staged = {name: (self._on_device(adapter.a[name]), self._on_device(adapter.b[name])) for name in adapter.a}
            if stream is not None:
                stream.wait_stream(compute)
            for name, target in self.targets.items():
                self._copy_target(slot, target, *staged.get(name, (None, None)), adapter.rank)
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
                self._pending[slot] = event  # one stream runs in order: the latest load covers the earlier
                adapter.reads.event = event  # its host memory is read until then
        self.ranks[slot] = adapter.rank
        self.scalings[slot] = adapter.scaling
        self.generations[slot] += 1
        for name, ranks in self.target_ranks.items():
            ranks[slot] = adapter.rank if name in adapter.a else 0

    def idle_targets(self, slots: Iterable[int]) -> frozenset[str]:
        """The fused targets none of `slots` adapts (rank 0 there in each): a step over those slots
        skips their LoRA kernels."""
        used = set(slots)
        return frozenset(name for name, ranks in self.target_ranks.items() if not any(ranks[s] for s in used))

    def clear(self, slot: int) -> None:
        """Mark a slot empty (rank 0); its buffers are zeroed again by the next load."""
        self.ranks[slot] = 0
        self.scalings[slot] = 0.0
        for ranks in self.target_ranks.values():
            ranks[slot] = 0

    def wait_for_loads(self, slots: Iterable[int] | None = None) -> None:
        """Make the compute stream wait for the loads of `slots` (None: every slot) issued so far; call
        before a forward with the slots it reads. Loads of other slots (loaded ahead for waiting requests)
        keep running beside it."""
        if not self._pending:
            return
        current = torch.cuda.current_stream(self.device)
        for slot in list(self._pending) if slots is None else set(slots):
            event = self._pending.pop(slot, None)
            if event is not None:
                current.wait_event(event)

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        """A packed tensor in pinned host memory, whole, in one asynchronous copy to this pool's GPU (the
        copy stream's memory, one adapter's packed bytes in all, which the allocator keeps for the copy
        stream's next load), whose pieces then go to the slot on the device; any other tensor itself.

        Copied straight from the host, a strided piece (projection k's rows of a stacked A) is first
        gathered by PyTorch into new pageable host memory, and a copy from pageable memory waits for
        everything queued before it on the copy stream, which waits for the compute stream: the load
        held the host until the running step ended, and the step after it waited (BENCHMARKS.md: a load
        beside a batch-32 decode step added its whole 5 ms to the step). Tensor-parallel workers read
        the host cache from shared, unpinned memory: their loads still copy from pageable memory, the
        rank's shard only."""
        if self._copy_stream is None or not t.is_pinned():
            return t
        return t.to(self.device, non_blocking=True)

    def _shard(self, target: FusedTarget, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed (full) target -> this rank's A and B; see the module doc."""
        # a: [L, stack * rank, in_full]; b: [L, out_full, rank]
        if self.tp.size == 1:
            return a, b
        if target.split is Split.ROW:
            return a[:, :, self.tp.part(a.shape[2])], b
        rows = [b[:, offset : offset + size][:, self.tp.part(size)] for offset, size in _full_slices(target, self.tp)]
        return a, torch.cat(rows, dim=1)

    def _copy_target(self, slot: int, target: FusedTarget, a: torch.Tensor | None, b: torch.Tensor | None, rank: int) -> None:
        """Copy the adapter's A and B into the slot's buffers of `target` and zero the rest of them (the
        rows and columns past its rank; all of them when a or b is None: it lacks the target). One copy
        and at most one zero fill per tensor, each stacked projection's rows through a view: slot loads
        are called from the loop thread, whose every torch call lets go of the GIL and takes it back."""
        if a is None or b is None:
            whole_a, whole_b, *_ = self._slot_views(target, slot, self.max_rank)
            whole_a.zero_()
            whole_b.zero_()
            return
        a, b = self._shard(target, a, b)  # [L, stack * rank, in], [L, out, rank]
        a_rows, b_cols, a_rest, b_rest = self._slot_views(target, slot, rank)
        if a_rest is not None:
            a_rest.zero_()
            b_rest.zero_()
        a_rows.copy_(a.unflatten(1, (target.num_stack, rank)), non_blocking=True)
        b_cols.copy_(b, non_blocking=True)

    def _slot_views(self, target: FusedTarget, slot: int, rank: int) -> tuple:
        """Views of `slot`'s buffers of `target`: each stacked projection's A rows below `rank`
        [L, stack, rank, in] and B's columns below it [L, out, rank], then the rows and columns past
        it (None at max_rank). Kept per (target, slot) for the latest rank asked: made once, they spare
        a load five indexing calls a target, each a GIL round trip on the loop thread."""
        key = (target.name, slot)
        cached = self._views.get(key)
        if cached is not None and cached[0] == rank:
            return cached[1]
        stacked = self.a[target.name][:, slot].unflatten(1, (target.num_stack, self.max_rank))  # [L, stack, max_rank, in]
        dst_b = self.b[target.name][:, slot]  # [L, out, max_rank]
        rest = (stacked[:, :, rank:], dst_b[:, :, rank:]) if rank < self.max_rank else (None, None)
        views = (stacked[:, :, :rank], dst_b[:, :, :rank], *rest)
        self._views[key] = (rank, views)
        return views


def _full_slices(target: FusedTarget, tp: TensorParallel) -> list[tuple[int, int]]:
    """The (offset, size) of each projection in the full (unsharded) fused output of a column target."""
    slices, offset = [], 0
    for _, size in target.output_slices:
        slices.append((offset, size * tp.size))
        offset += size * tp.size
    return slices
