"""Residual add + RMSNorm with the next projection's LoRA shrink, in one Triton kernel (decode steps).

Semantics: what `add_rmsnorm` (lorakernels/rmsnorm.py) returns, plus the shrink of its output

    out, s = add_rmsnorm(x, residual, weight, eps, delta)
    v      = sgmv_shrink(out, A, meta, num_stack=num_stack)           (lorakernels/sgmv_ref.py's contract)

    x, residual, delta [T, N]; A [num_slots, num_stack * R, N], x.dtype; v [T, num_stack * R], x.dtype

so the projection's base GEMM can run on every SM with nothing beside it, and the expand is left to the
kernel that reads its output next (RoPE/KV write, SiLU-mul: engine/lora_inputs.py, `norm_shrink`).
v rounds once, as the decode shrink's v: round(sum of fp32 partials). Entries of v past each target's
rank in rows with an adapter are written as zeros; rows without one (a base-model segment, a graph's
padding rows) are not written.

Grid (T, SPLITS): program (t, j) owns columns [j * CHUNK, (j + 1) * CHUNK) of row t. Each program reads
the whole row once for its sum of squares (every split of a row computes the same fp32 mean), stores
its columns of the new residual and of the normed output, and dots its normed columns with its
adapter's A over them: an fp32 partial [num_stack * R] per split. The last split of a row to finish (an
atomic count per row) sums the row's partials in split order, so v does not depend on which finished
first, stores v and puts the count back to zero for the next launch; a captured CUDA graph replays the
same counts. A split reads its A columns once per row: rows of one adapter read the same A, from L2
after the first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorakernels import pdl
from lorakernels.pdl import wait_for_producer
from lorakernels.pending_delta import output_like
from lorakernels.rmsnorm import MAX_HIDDEN, _check, add_rmsnorm_ref, residual_sum
from lorakernels.sgmv import SEGMENT_CHUNK, row_adapter
from lorakernels.sgmv_decode import DECODE_MAX_TOKENS
from lorakernels.sgmv_ref import SgmvMeta, sgmv_shrink_ref

CHUNK = 512  # a split's columns: 8 splits of a 4096-wide row
SUB = 128  # columns a split loads at once ([num_stack * R, SUB] of A)


@triton.jit
def _add_rmsnorm_shrink_kernel(
    # pointers
    x_ptr,  # [T, N]
    residual_ptr,  # [T, N] (unused without HAS_RESIDUAL)
    delta_ptr,  # [T, N] (unused without HAS_DELTA)
    weight_ptr,  # [N]
    out_ptr,  # [T, N]
    residual_out_ptr,  # [T, N] (unused without HAS_RESIDUAL or HAS_DELTA)
    a_ptr,  # [num_slots, num_stack * R, N]
    partial_ptr,  # [SPLITS, T, num_stack * R] fp32 (unused with one split)
    v_ptr,  # [T, num_stack * R]
    count_ptr,  # [>= T] int32, zero between launches
    seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr,
    # sizes
    N,
    eps,
    num_segments,
    max_rank,
    num_cols,  # num_stack * R
    # strides
    stride_x, stride_r, stride_d, stride_o, stride_ro,
    stride_aw, stride_ak, stride_an,
    stride_ps, stride_pm,
    stride_v,
    # meta-parameters
    HAS_RESIDUAL: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_N: tl.constexpr,  # >= N: the whole row at once
    BLOCK_W: tl.constexpr,  # >= num_stack * R
    BLOCK_G: tl.constexpr,  # segments a step of the row's segment search reads
    BLOCK_S: tl.constexpr,  # >= SPLITS
    USE_PDL: tl.constexpr = False,  # lorakernels/pdl.py: wait for the previous grid first
):  # fmt: skip
    if USE_PDL:
        wait_for_producer()
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    # -- the row's sum of squares, over the whole row (each sum rounded once, as add_rmsnorm rounds) -----
    x_row, residual_row, delta_row = x_ptr + row * stride_x, residual_ptr + row * stride_r, delta_ptr + row * stride_d
    offs_n = tl.arange(0, BLOCK_N)
    s32 = residual_sum(x_row, residual_row, delta_row, offs_n, offs_n < N, HAS_RESIDUAL, HAS_DELTA).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(s32 * s32, axis=0) / N + eps)

    # -- the row's adapter (rank 0: in no segment) ---------------------------------------------------
    slot, rank = row_adapter(seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, num_segments, row, BLOCK_G)
    offs_w = tl.arange(0, BLOCK_W)
    in_rank = (offs_w < num_cols) & (offs_w % max_rank < rank)  # A rows past each target's rank: never read
    a_base = a_ptr + slot.to(tl.int64) * stride_aw + offs_w[:, None] * stride_ak

    # -- this split's columns: the add, the norm, and the partial shrink -------------------------------
    acc = tl.zeros((BLOCK_W,), dtype=tl.float32)
    for c0 in range(0, CHUNK, SUB):
        offs = split * CHUNK + c0 + tl.arange(0, SUB)
        mask = offs < N
        u = residual_sum(x_row, residual_row, delta_row, offs, mask, HAS_RESIDUAL, HAS_DELTA)
        if HAS_RESIDUAL or HAS_DELTA:
            tl.store(residual_out_ptr + row * stride_ro + offs, u, mask=mask)
        normed = (u.to(tl.float32) * rstd).to(x_ptr.dtype.element_ty)
        w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
        o = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + offs, o, mask=mask)
        if rank > 0:
            a = tl.load(a_base + offs[None, :] * stride_an, mask=in_rank[:, None] & mask[None, :], other=0.0)
            acc += tl.sum(a.to(tl.float32) * o.to(tl.float32)[None, :], axis=1)

    # -- v: one split stores it; else the last split of the row sums the row's partials ---------------
    if rank > 0:
        if SPLITS == 1:
            tl.store(v_ptr + row * stride_v + offs_w, acc.to(v_ptr.dtype.element_ty), mask=offs_w < num_cols)
        else:
            tl.store(partial_ptr + split * stride_ps + row * stride_pm + offs_w, acc, mask=offs_w < num_cols)
            tl.debug_barrier()  # every thread's partial stored before the count releases them
            done = tl.atomic_add(count_ptr + row, 1, sem="acq_rel")
            if done == SPLITS - 1:
                offs_s = tl.arange(0, BLOCK_S)
                p = tl.load(
                    partial_ptr + offs_s[:, None] * stride_ps + row * stride_pm + offs_w[None, :],
                    mask=(offs_s[:, None] < SPLITS) & (offs_w[None, :] < num_cols), other=0.0,
                    cache_modifier=".cg",  # the other splits' stores, from L2: never a stale L1 line
                )  # fmt: skip
                v = tl.sum(p, axis=0)
                tl.store(v_ptr + row * stride_v + offs_w, v.to(v_ptr.dtype.element_ty), mask=offs_w < num_cols)
                tl.atomic_xchg(count_ptr + row, 0)


def shrink_counters(device: torch.device | str) -> torch.Tensor:
    """The per-row counts one engine's add_rmsnorm_shrink calls share (zero between launches): allocated
    once, outside any graph capture, and passed to every call on that device's compute stream."""
    return torch.zeros(DECODE_MAX_TOKENS, dtype=torch.int32, device=device)  # a decode step's rows at most


def add_rmsnorm_shrink(
    x: torch.Tensor,  # [T, N]
    residual: torch.Tensor | None,  # [T, N] or None (no add: the first layer)
    weight: torch.Tensor,  # [N]
    eps: float,
    A: torch.Tensor,  # [num_slots, num_stack * R, N], x.dtype
    meta: SgmvMeta,
    *,
    num_stack: int,
    counters: torch.Tensor,  # shrink_counters(x.device): zero, [>= T] int32
    delta: torch.Tensor | None = None,  # [T, N]: a LoRA delta still to add to x, first
    out: torch.Tensor | None = None,  # [T, N] with contiguous rows, or None: new
    chunk: int = CHUNK,  # columns a split owns (a power of two, >= SUB); tests pass others
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # (out [T, N], new residual [T, N], v [T, num_stack * R])
    """add_rmsnorm's (out, residual) and v = shrink(out) by A in one kernel; see the module doc."""
    _check(x, residual, weight, delta)
    num_tokens, n = x.shape
    if A.dim() != 3 or A.shape[2] != n or A.shape[1] % num_stack or A.dtype != x.dtype or A.device != x.device:
        raise ValueError(f"want A [num_slots, num_stack * R, {n}] {x.dtype} on {x.device}, got {tuple(A.shape)} {A.dtype}")
    if A.stride(2) != 1:
        raise ValueError("A rows must be contiguous")
    if num_tokens > counters.numel() or counters.dtype != torch.int32 or counters.device != x.device:
        raise ValueError(f"want int32 counters on {x.device} for {num_tokens} rows, got {counters.numel()} {counters.dtype}")
    if chunk < SUB or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= {SUB}, got {chunk}")
    out = output_like(x, out)
    residual_out = x if residual is None and delta is None else torch.empty_like(x)
    num_cols = A.shape[1]
    v = torch.empty(num_tokens, num_cols, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out, residual_out, v
    splits = triton.cdiv(n, chunk)
    partial = torch.empty(splits if splits > 1 else 0, num_tokens, num_cols, dtype=torch.float32, device=x.device)
    r = x if residual is None else residual
    d = x if delta is None else delta
    block_n = triton.next_power_of_2(n)
    _add_rmsnorm_shrink_kernel[(num_tokens, splits)](
        x, r, d, weight, out, residual_out, A, partial, v, counters,
        meta.seg_indptr, meta.weight_indices, meta.lora_ranks,
        n, eps, meta.num_segments, num_cols // num_stack, num_cols,
        x.stride(0), r.stride(0), d.stride(0), out.stride(0), residual_out.stride(0),
        A.stride(0), A.stride(1), A.stride(2),
        partial.stride(0), partial.stride(1),
        v.stride(0),
        HAS_RESIDUAL=residual is not None,
        HAS_DELTA=delta is not None,
        SPLITS=splits, CHUNK=chunk, SUB=SUB, BLOCK_N=block_n,
        BLOCK_W=max(16, triton.next_power_of_2(num_cols)),
        BLOCK_G=min(max(16, triton.next_power_of_2(max(meta.num_segments, 1))), SEGMENT_CHUNK),
        BLOCK_S=triton.next_power_of_2(splits),
        num_warps=min(max(block_n // 512, 1), 16),  # add_rmsnorm's: the same tree for the row's sum
        **pdl.launch(x.device),
    )  # fmt: skip
    return out, residual_out, v


def add_rmsnorm_shrink_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    A: torch.Tensor,
    meta: SgmvMeta,
    *,
    num_stack: int,
    delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same in PyTorch: add_rmsnorm_ref, then sgmv_shrink_ref of its output (the CPU path)."""
    if x.shape[1] > MAX_HIDDEN:
        raise ValueError(f"rows of {x.shape[1]} exceed {MAX_HIDDEN}")
    out, s = add_rmsnorm_ref(x, residual, weight, eps, delta)
    return out, s, sgmv_shrink_ref(out, A, meta, num_stack=num_stack)
