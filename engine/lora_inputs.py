"""A step's LoRA inputs for the model: the slot pool's buffers, this step's segments, the SGMV ops.

Each fused projection adds its LoRA delta, with one shrink per input for all its stacked targets and
one expand (`LoraInputs.project_deferred`; in CUDA decode steps both run on a side stream beside the
base GEMM, and the delta comes back for the next kernel to add; in prefill-sized CUDA steps gate/up's
expand is left to the SiLU-mul kernel, `PendingExpand`, and with `decode_fused_expand` a decode step's
q/k/v or gate/up expand to the RoPE/KV-write or SiLU-mul kernel; with `decode_fused_delta` a decode step's
side stream computes a target's delta in one fused pass from x; with `decode_norm_shrink` a decode step's
q/k/v or gate/up LoRA leaves the side stream: the norm before the GEMM shrinks, the kernel after it expands):

    y[T, out] += scalings[slot] * (x[T, in] @ A[slot]^T) @ B[slot]^T     per segment of tokens
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from engine.forward_inputs import StagingFence
from engine.lora_pool import LoraSlotPool
from lorakernels.sgmv_ref import SgmvMeta, sgmv_expand_ref, sgmv_shrink_ref

if TYPE_CHECKING:
    from engine.lora_tail import GemmTail

# A decode step merges each adapter's neighbouring requests into segments of at most this many rows: the
# decode kernels read the adapter once per segment, and 16-row segments still spread one popular
# adapter's rows over several programs (measured on an H200 against 64: BENCHMARKS.md).
DECODE_RUN = 16


def sgmv_ops(backend: str) -> tuple[Callable, Callable, Callable]:
    """(shrink, expand, delta) of a backend: 'ref' (PyTorch, the CPU default), 'triton', 'chunked', or
    'splitk' (Triton, the CUDA default: the split-K shrink and the decode expand of lorakernels/sgmv_decode.py
    for decode-sized steps, i.e. decode steps, their CUDA graphs and small mixed steps; `sgmv_*` for
    prefill-sized ones). delta(v, B, meta, output_slices=) is the expand into a new tensor."""
    if backend == "ref":
        return sgmv_shrink_ref, sgmv_expand_ref, _delta(sgmv_expand_ref)
    if backend == "triton":
        from lorakernels.sgmv import sgmv_expand, sgmv_shrink

        return sgmv_shrink, sgmv_expand, _delta(sgmv_expand)
    if backend == "chunked":
        from lorakernels.sgmv_chunked import sgmv_expand_chunked, sgmv_shrink_chunked

        return sgmv_shrink_chunked, sgmv_expand_chunked, _delta(sgmv_expand_chunked)
    if backend == "splitk":
        from lorakernels.sgmv_decode import sgmv_delta_auto, sgmv_expand_auto, sgmv_shrink_auto

        return sgmv_shrink_auto, sgmv_expand_auto, sgmv_delta_auto
    raise ValueError(f"lora backend must be 'ref', 'triton', 'chunked' or 'splitk', not {backend!r}")


@functools.cache  # one function per expand, so sgmv_ops(backend) tuples compare equal
def _delta(expand: Callable) -> Callable:
    """An expand into a new zeroed tensor (rows without a LoRA stay 0)."""

    def delta(v: torch.Tensor, B: torch.Tensor, meta: SgmvMeta, *, output_slices: tuple[tuple[int, int], ...]) -> torch.Tensor:
        y = torch.zeros(v.shape[0], B.shape[1], dtype=v.dtype, device=v.device)
        expand(v, B, meta, y, output_slices=output_slices)
        return y

    return delta


def lora_segments(lens: list[int], slots: list[int], max_len: int = 0) -> tuple[list[int], list[int]]:
    """SGMV segments of a step whose requests (lens tokens each, in order) use `slots`: neighbouring
    requests of one slot merge into one segment (the scheduler puts them together), so each adapter is
    read once per run of rows; max_len > 0 caps a merged segment's tokens (a single request stays one
    segment). Returns (segment lengths, segment slots).

        lens [1, 1, 1, 1, 3]  slots [2, 2, 2, 5, 5]  max_len 2  ->  [2, 1, 1, 3], [2, 2, 5, 5]
    """
    seg_lens: list[int] = []
    seg_slots: list[int] = []
    for n, slot in zip(lens, slots, strict=True):
        if seg_slots and seg_slots[-1] == slot and (max_len <= 0 or seg_lens[-1] + n <= max_len):
            seg_lens[-1] += n
        else:
            seg_lens.append(n)
            seg_slots.append(slot)
    return seg_lens, seg_slots


@dataclass(frozen=True)
class PendingExpand:
    """A projection's LoRA expand not yet run: the shrink's v, the slots' B and the step's segments, for
    the kernel that reads the projection's output next to add as it loads it (gate/up: SiLU-mul,
    lorakernels/silu_mul.py `silu_mul_expand`; a decode step's q/k/v: lorakernels/rope_kv.py `rope_kv_write`),
    so the output is not read and written once more first."""

    v: torch.Tensor  # [T, num_stack * R]
    b: torch.Tensor  # [num_slots, out_dim, R]
    meta: SgmvMeta
    output_slices: tuple[tuple[int, int], ...]
    expand: Callable  # the backend's, for a reader that cannot fuse it (`apply`)

    def apply(self, y: torch.Tensor) -> torch.Tensor:
        """y with the expand added in place (what the in-line path does)."""
        self.expand(self.v, self.b, self.meta, y, output_slices=self.output_slices)
        return y


@dataclass
class NormShrink:
    """A fused target's shrink for the residual add + RMSNorm that writes its input (LoraInputs.norm_shrink):
    the slots' A of the layer, the step's metadata with the target's ranks, and, once the norm ran, v."""

    a: torch.Tensor  # [num_slots, num_stack * R, in]
    meta: SgmvMeta
    num_stack: int
    shrink: Callable  # the backend's, for a norm that cannot fuse it (the CPU path)
    counters: torch.Tensor | None  # lorakernels/norm_shrink.py shrink_counters (CUDA)
    v: torch.Tensor | None = None  # [T, num_stack * R]: the norm's output shrunk

    def apply(self, normed: torch.Tensor) -> None:
        """v from the norm's output in a separate shrink (a norm path without the fused kernel)."""
        self.v = self.shrink(normed, self.a, self.meta, num_stack=self.num_stack)


@dataclass
class LoraInputs:
    pool: LoraSlotPool
    meta: SgmvMeta
    shrink: Callable
    expand: Callable
    delta: Callable  # the expand into a new tensor (sgmv_ops)
    # CUDA decode steps: the stream the LoRA delta is computed on, beside the base GEMM that shares its
    # input. A decode step's shrink and expand are latency-bound (microseconds of dependent loads over a
    # few MB), so the GEMM hides most of them; the projection then adds the finished delta to its output.
    side: torch.cuda.Stream | None = None
    # Per fused target, the step's metadata with that target's ranks (SgmvMetaBuffers.by_target); a
    # target not here uses `meta`.
    by_target: Mapping[str, SgmvMeta] = field(default_factory=dict)
    # Fused targets no row of this step adapts (every slot it reads has rank 0 there), whose projections
    # skip the LoRA kernels: an eager step's own; a captured decode graph's variant (engine/cuda_graphs.py)
    # replays only for steps that adapt none of them either.
    idle: frozenset[str] = frozenset()
    # Fused targets whose in-line expand, in a prefill-sized step, the next kernel does (PendingExpand):
    # {"gate_up"} on CUDA with the Triton ops (engine/model_runner.py, step_graphs.py).
    fused_expand: frozenset[str] = frozenset()
    # SMs the base GEMMs beside the side stream's LoRA kernels leave free (`sm_carveout`; EngineConfig's
    # lora_sm_carveout): with every SM, a GEMM's next tile waits for a whole SM the LoRA kernels hold,
    # and they get SMs only between its tiles
    sm_carveout: int = 0
    # Fused targets whose GEMMs take their own carve-out in place of sm_carveout (EngineConfig's
    # lora_sm_carveout_targets): where the LoRA kernels are short against the GEMM, the SMs cost more
    sm_carveout_targets: Mapping[str, int] = field(default_factory=dict)
    # Fused targets whose decode-step expand (side stream) is left to the next kernel as a PendingExpand:
    # the side stream runs the shrink alone beside the GEMM, and the RoPE/KV-write (qkv) or SiLU-mul
    # (gate_up) kernel reads the slots' B as it loads the projection (EngineConfig's
    # lora_decode_fused_expand: `decode_fused_targets`)
    decode_fused_expand: frozenset[str] = frozenset()
    # Fused targets whose decode-step delta (side stream) is one fused pass from x: the split shrink's
    # partials summed by the expand, no reduce kernel and no v (lorakernels/sgmv_decode.py
    # `sgmv_lora_delta_auto`; EngineConfig's lora_decode_fused_delta: `fused_delta_targets`)
    decode_fused_delta: frozenset[str] = frozenset()
    # Prefill-sized steps whose expands the base GEMMs do (engine/lora_tail.py, EngineConfig's
    # lora_gemm_tail_blocks): the weights' tail and the blocks this step's GEMMs cover (0: not this step)
    tail: GemmTail | None = None
    tail_blocks: int = 0
    # Fused targets whose decode-step LoRA runs on the main stream, nothing beside the base GEMM: the
    # shrink in the residual add + RMSNorm kernel that writes the projection's input
    # (lorakernels/norm_shrink.py), the GEMM on every SM, the expand in the kernel that reads its output
    # next (RoPE/KV write for qkv, SiLU-mul for gate_up) (EngineConfig's lora_decode_norm_shrink:
    # `decode_fused_targets`); with the per-row counts the kernel's splits share (`shrink_counters`)
    decode_norm_shrink: frozenset[str] = frozenset()
    shrink_counters: torch.Tensor | None = None
    _tail_x: dict[str, torch.Tensor] = field(default_factory=dict)  # target -> its x_aug, head not yet projected
    _norm_shrunk: dict[str, NormShrink] = field(default_factory=dict)  # target -> its input's shrink, not yet projected

    def norm_shrink(self, target: str, layer: int) -> NormShrink | None:
        """What the norm writing fused target `target`'s input in `layer` needs to shrink it as well
        (RMSNorm.add_forward fills its v, which `project_deferred` then takes), or None where this step's
        `target` runs otherwise."""
        if target not in self.decode_norm_shrink or target in self.idle or target not in self.pool.targets or self.tail_blocks:
            return None
        ns = NormShrink(
            self.pool.a[target][layer], self.by_target.get(target, self.meta), self.pool.targets[target].num_stack,
            self.shrink, self.shrink_counters,
        )  # fmt: skip
        self._norm_shrunk[target] = ns
        return ns

    def tail_head(self, target: str, num_tokens: int, like: torch.Tensor) -> torch.Tensor | None:
        """Where the kernel producing fused target `target`'s input should write it: the head [T, in] of a
        new x_aug = [x | tail] (engine/lora_tail.py), or None where this step's `target` runs in line."""
        if not self.tail_blocks or target in self.idle or self.tail is None or target not in self.tail.width:
            return None
        in_dim = self.tail.in_dim[target]
        x_aug = torch.empty(num_tokens, in_dim + self.tail_blocks * self.tail.width[target], dtype=like.dtype, device=like.device)
        self._tail_x[target] = x_aug
        return x_aug[:, :in_dim]

    def project_deferred(
        self, linear: Callable[[torch.Tensor], torch.Tensor], target: str, layer: int, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | PendingExpand | None]:
        """(linear(x), the LoRA delta of fused target `target` in `layer` still to add to it), or
        (linear(x) with its delta, None); x: [T, in] -> [T, out].

        In line, the expand adds into the GEMM's output and rounds once, or (a prefill-sized step, a
        target in `fused_expand`) comes back as a PendingExpand for the next kernel. On the side stream (CUDA
        decode steps) the delta comes back apart, rounded to x's dtype as peft rounds it, and the main
        stream already waits for it: the kernel that reads y next adds it as it loads y
        (lorakernels/rope_kv.py, silu_mul.py, rmsnorm.py take a `delta`), one kernel launch less per
        projection than `y.add_(delta)` and the same rounding."""
        if target in self.idle or target not in self.pool.targets:  # not adapted here, or no buffers for it
            return tuned_gemm(linear, target, x), None
        x_aug = self._tail_x.pop(target, None)
        if x_aug is not None:
            return self._project_tail(linear, target, layer, x, x_aug), None
        t = self.pool.targets[target]
        a, b = self.pool.a[target][layer], self.pool.b[target][layer]
        ns = self._norm_shrunk.pop(target, None)
        if ns is not None:  # x's norm shrank it: the GEMM alone, on every SM; the next kernel expands
            if ns.v is None or ns.v.shape[0] != x.shape[0]:
                raise RuntimeError(f"{target}'s input norm in layer {layer} was asked for its shrink and did not compute it")
            return tuned_gemm(linear, target, x), PendingExpand(ns.v, b, ns.meta, t.output_slices, self.expand)
        meta = self.by_target.get(target, self.meta)
        if self.side is None:
            y = linear(x)
            v = self.shrink(x, a, meta, num_stack=t.num_stack)  # [T, stack * R]
            if target in self.fused_expand and _fuses_expand(meta, x.shape[0], b.shape[2]):
                return y, PendingExpand(v, b, meta, t.output_slices, self.expand)
            self.expand(v, b, meta, y, output_slices=t.output_slices)
            return y, None
        main = torch.cuda.current_stream(x.device)
        # The GEMM is enqueued first, under the carve-out: it takes its SMs at once and the side stream's
        # kernels, forked from the event before it (x is ready), run on the SMs it leaves. Forked first,
        # the shrink's programs (two an SM) spread over every SM and the GEMM's tiles queue behind them
        # (an H200, Llama-3-8B, rank 16: LoRA/base 0.82-0.84 -> 0.87-0.88 with 8 adapters; BENCHMARKS.md).
        # Memory the side stream allocates and frees here is reused by it only after this fork in a later
        # call, so after main's reader of the delta.
        x_ready = main.record_event()
        carveout = self.sm_carveout_targets.get(target, self.sm_carveout)
        with sm_carveout(carveout):
            y = tuned_gemm(linear, target, x, carveout)
        self.side.wait_event(x_ready)
        with torch.cuda.stream(self.side):
            if target in self.decode_fused_delta:
                v, delta = None, _fused_delta(x, a, b, meta, t.num_stack, t.output_slices)
            else:
                v = self.shrink(x, a, meta, num_stack=t.num_stack)
                delta = None if target in self.decode_fused_expand else self.delta(v, b, meta, output_slices=t.output_slices)
        main.wait_stream(self.side)
        if delta is None:  # v, allocated on the side stream, is read on main: as the delta, see above
            return y, PendingExpand(v, b, meta, t.output_slices, self.expand)
        return y, delta


    def _project_tail(self, linear, target: str, layer: int, x: torch.Tensor, x_aug: torch.Tensor) -> torch.Tensor:
        """linear(x) plus its LoRA in one GEMM over x_aug = [x | tail] (engine/lora_tail.py); x is written
        into x_aug's head first where its producer wrote it elsewhere."""
        from lorakernels.gemm_tail import place_lora_tail  # Triton: imported only where a tail runs

        tail, blocks = self.tail, self.tail_blocks
        in_dim = tail.in_dim[target]
        head = x_aug[:, :in_dim]
        if x.data_ptr() != head.data_ptr() or x.stride() != head.stride():
            head.copy_(x)
        meta = self.by_target.get(target, self.meta)
        v_all = F.linear(head, tail.shrink_weight(target, layer, blocks))  # [T, blocks * W]: every block's shrink
        place_lora_tail(v_all, meta, tail.slot_block, x_aug[:, in_dim:], max_rank=self.pool.max_rank, num_stack=self.pool.targets[target].num_stack)
        return F.linear(x_aug, tail.weight(target, layer, blocks), linear.bias)


@contextlib.contextmanager
def sm_carveout(num_sms: int) -> Iterator[None]:
    """cuBLAS(Lt) GEMMs called inside leave num_sms SMs of the device free (PyTorch's process-wide SM
    carve-out, read when a GEMM is launched or captured; restored after). 0 or a PyTorch without the
    setting: no change."""
    if num_sms <= 0 or not hasattr(torch._C, "_set_sm_carveout_experimental"):
        yield
        return
    before = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(num_sms)  # PyTorch logs once that the setting is experimental
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)


def tuned_gemm(linear: Callable[[torch.Tensor], torch.Tensor], target: str, x: torch.Tensor, carveout: int = 0) -> torch.Tensor:
    """linear(x) for a projection of fused target `target` with `carveout` SMs left to the LoRA kernels
    (0, every SM: a projection without LoRA work this step): through the cuBLASLt algorithm tuned for its
    rows and carve-out (engine/carved_gemms.py; the linear's `tuned_gemms`, set by the model runner) where
    one was chosen, else linear(x)."""
    tuned = getattr(linear, "tuned_gemms", None)
    return linear(x) if tuned is None else tuned.project(linear, target, x, carveout)


def usable_sm_carveout(requested: int, num_sms: int) -> int:
    """The carve-out a device of num_sms SMs takes: at most half of them (PyTorch asks cuBLASLt for the
    device's SMs less the carve-out, which must stay positive, and the GEMMs keep most of the device)."""
    return max(0, min(requested, num_sms // 2))


def decode_fused_targets(targets: Collection[str], device: torch.device, lora_backend: str, max_rank: int) -> frozenset[str]:
    """LoraInputs.decode_fused_expand of an engine: the targets asked for where the kernels that read
    them can take the expand (CUDA, the Triton SGMV ops, a rank capacity the SiLU-mul kernel loads
    whole); none elsewhere."""
    from lorakernels.silu_mul import FUSED_MAX_RANK  # imports Triton: only where a LoRA pool exists

    fits = device.type == "cuda" and lora_backend in ("triton", "splitk") and max_rank <= FUSED_MAX_RANK
    return frozenset(targets) if fits else frozenset()


def prefill_fused_targets(targets: Collection[str], device: torch.device, lora_backend: str) -> frozenset[str]:
    """LoraInputs.fused_expand of an engine: the targets asked for on CUDA with the Triton SGMV ops, whose
    prefill-sized steps' expand the next kernel does (a step checks the rank capacity, `_fuses_expand`);
    none elsewhere (the CPU path adds a PendingExpand in line)."""
    fits = device.type == "cuda" and lora_backend in ("triton", "splitk")
    return frozenset(targets) if fits else frozenset()


def _fused_delta(x, a, b, meta: SgmvMeta, num_stack: int, output_slices: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The delta in one fused pass from x (decode_fused_delta targets; imports Triton only where one asks)."""
    from lorakernels.sgmv_decode import sgmv_lora_delta_auto

    return sgmv_lora_delta_auto(x, a, b, meta, num_stack=num_stack, output_slices=output_slices)


def fused_delta_targets(targets: Collection[str], device: torch.device, lora_backend: str, max_rank: int) -> frozenset[str]:
    """LoraInputs.decode_fused_delta of an engine: the targets asked for where decode steps run the splitk
    kernels on CUDA (the fused delta is theirs) with a rank capacity its expand holds in registers (it
    loads SPLIT_CHUNK splits x 16 rows x the capacity of fp32 partials at once: FUSED_MAX_RANK, as the
    fused expands); none elsewhere."""
    from lorakernels.silu_mul import FUSED_MAX_RANK  # imports Triton: only where a LoRA pool exists

    fits = device.type == "cuda" and lora_backend == "splitk" and max_rank <= FUSED_MAX_RANK
    return frozenset(targets) if fits else frozenset()


def _fuses_expand(meta: SgmvMeta, num_tokens: int, max_rank: int) -> bool:
    """Whether the next kernel takes a fused target's expand: not in a step whose expand is small
    (lorakernels/sgmv_decode.py's rule for decode-sized steps), nor past the fused kernel's rank capacity."""
    from lorakernels.sgmv_decode import is_decode_sized  # Triton: only where fused_expand is set
    from lorakernels.silu_mul import FUSED_MAX_RANK

    return max_rank <= FUSED_MAX_RANK and not is_decode_sized(meta, num_tokens)


class SgmvMetaBuffers:
    """The step's SGMV metadata in device buffers allocated once and refilled in place each step.

    Addresses never change, so a captured CUDA graph that reads them sees every new step's segments.
    Refilling copies from Python lists through one pinned (on CUDA) host staging buffer: no GPU sync.
    """

    def __init__(
        self, max_segments: int, num_slots: int, device: torch.device | str, targets: tuple[str, ...] = (),
        pad_slot: int | None = None,
    ):  # fmt: skip
        """pad_slot: the slot the unused segments' weight indices name after each fill (a rank-0 slot: the
        pool's base slot; None: the last slot, where the engine keeps it). A kernel launched for more
        segments than the step has (a graph captured for one segment a row) then finds rank 0 there, not
        the adapter an earlier step with more segments left, and reads none of its weights."""
        self.device = torch.device(device)
        self.max_segments = max_segments
        self.pad_slot = num_slots - 1 if pad_slot is None else pad_slot
        if not 0 <= self.pad_slot < num_slots:
            raise ValueError(f"pad_slot {pad_slot} is not one of the {num_slots} slots")
        self.targets = targets
        pin = self.device.type == "cuda"
        # staging layout: [seg_indptr (max_segments + 1) | weight_indices (max_segments) | ranks (num_slots)
        #                  | each target's ranks (num_slots each, in `targets` order)]
        ranks_at = 2 * max_segments + 1
        size = ranks_at + num_slots * (1 + len(targets))
        self._ints_host = torch.zeros(size, dtype=torch.int32, pin_memory=pin)
        self._scalings_host = torch.zeros(num_slots, dtype=torch.float32, pin_memory=pin)
        # the same bytes as numpy arrays: `fill` runs on the loop thread every step, in numpy
        self._ints_np, self._scalings_np = self._ints_host.numpy(), self._scalings_host.numpy()
        self._ints = torch.zeros_like(self._ints_host, device=self.device)
        self.scalings = torch.zeros(num_slots, dtype=torch.float32, device=self.device)
        self.seg_indptr = self._ints[: max_segments + 1]
        self.weight_indices = self._ints[max_segments + 1 : 2 * max_segments + 1]
        self.lora_ranks = self._ints[ranks_at : ranks_at + num_slots]
        self.target_ranks = {
            name: self._ints[ranks_at + (i + 1) * num_slots : ranks_at + (i + 2) * num_slots] for i, name in enumerate(targets)
        }
        self._host_target_ranks: dict[str, tuple[int, ...]] = {}
        self._fence = StagingFence(self.device)

    def fill(
        self, seg_lens: list[int], slots: list[int], ranks: list[int], scalings: list[float],
        target_ranks: Mapping[str, list[int]] | None = None,
    ) -> SgmvMeta:  # fmt: skip
        """The step's metadata (lora_ranks: each slot's rank); target_ranks: each slot's rank in each of
        `targets` (0 where its adapter lacks the target; None: the slot's rank), for `by_target`."""
        num_segments = len(seg_lens)
        if num_segments > self.max_segments:
            raise ValueError(f"{num_segments} segments; the buffers hold {self.max_segments}")
        if any(len(target_ranks[name]) != len(ranks) for name in self.targets if target_ranks is not None):
            raise ValueError("target_ranks must give every target one rank per slot")
        host = self._ints_np
        self._fence.refill()
        host[0] = 0
        np.cumsum(seg_lens, dtype=np.int32, out=host[1 : num_segments + 1])
        host[num_segments + 1 : self.max_segments + 1] = host[num_segments]  # unused segments are empty
        host[self.max_segments + 1 : self.max_segments + 1 + num_segments] = slots
        host[self.max_segments + 1 + num_segments : 2 * self.max_segments + 1] = self.pad_slot
        ranks_at, num_slots = 2 * self.max_segments + 1, len(ranks)
        host[ranks_at : ranks_at + num_slots] = ranks
        self._host_target_ranks = {name: tuple(ranks if target_ranks is None else target_ranks[name]) for name in self.targets}
        for i, name in enumerate(self.targets):
            at = ranks_at + (i + 1) * num_slots
            host[at : at + num_slots] = self._host_target_ranks[name]
        self._scalings_np[:] = scalings
        self._ints.copy_(self._ints_host, non_blocking=True)
        self.scalings.copy_(self._scalings_host, non_blocking=True)
        self._fence.copied()
        return SgmvMeta(
            seg_indptr=self.seg_indptr[: num_segments + 1],
            weight_indices=self.weight_indices[:num_segments],
            lora_ranks=self.lora_ranks,
            scalings=self.scalings,
            max_seg_len=max(seg_lens, default=0),
            num_segments=num_segments,
            host_seg_lens=tuple(seg_lens),
            host_slots=tuple(slots),
            host_ranks=tuple(ranks),
        )

    def by_target(self, meta: SgmvMeta) -> dict[str, SgmvMeta]:
        """`meta` (the latest fill's) with each target's ranks: a step's kernels for target t skip the
        rows of slots whose adapter lacks t (a q/v adapter's rows do no work in o, gate/up and down)."""
        return {
            name: dataclasses.replace(meta, lora_ranks=ranks, host_ranks=self._host_target_ranks[name], _chunked={})
            for name, ranks in self.target_ranks.items()
        }
