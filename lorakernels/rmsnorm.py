"""Residual add fused with RMSNorm in Triton: one read of x and the residual, one write of each result.

Semantics, row by row (t < T), rounding exactly where the PyTorch model rounds (engine/models/blocks.py):

    x[t]   = round(x[t] + delta[t])                             delta given (a LoRA delta still to add)
    s[t]   = round(x[t] + residual[t])                          residual given; else s[t] = x[t]
    n[t]   = round(s[t] * rsqrt(mean(s[t]^2) + eps))            normalise in fp32, round to x.dtype
    out[t] = round(weight * n[t])                               scale in the model dtype

    x, residual, delta [T, N] fp16/bf16/fp32; weight [N] x.dtype; out, s [T, N] x.dtype.

Returns (out, s): s is the new residual stream (the input of the next add). A decoder layer then reads

    h, res = add_rmsnorm(x, None, w_in)      # first layer: res = x
    h, res = add_rmsnorm(attn(h), res, w_post)
    h, res = add_rmsnorm(mlp(h), res, w_in_next)   ...

which computes what `x = x + attn(norm(x)); x = x + mlp(norm(x))` computes. One program per row with the
whole row in registers (N up to 16k); the sum of squares is a tree reduction, so the fp32 mean may differ
from PyTorch's by an ulp, which the rounding to x.dtype almost always absorbs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorakernels import pdl
from lorakernels.pdl import wait_for_producer
from lorakernels.pending_delta import load_plus_delta, output_like
from lorakernels.sgmv import SEGMENT_CHUNK, check_expand_args, seg_and_tail_blocks, segment_or_tail_block
from lorakernels.sgmv_ref import SgmvMeta
from lorakernels.silu_mul import FUSED_MAX_RANK

MAX_HIDDEN = 16384


@triton.jit
def residual_sum(x_row, residual_row, delta_row, offs, mask, HAS_RESIDUAL: tl.constexpr, HAS_DELTA: tl.constexpr):
    """(x + delta) + residual at columns offs of one row, each add rounded once to x's dtype (what `x + d`
    and `x + r` in PyTorch do); x_row, residual_row, delta_row point at the row's first column."""
    x = load_plus_delta(x_row, delta_row, offs, mask, HAS_DELTA)
    if HAS_RESIDUAL:
        r = tl.load(residual_row + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_row.dtype.element_ty)
    return x


@triton.jit
def _add_rmsnorm_kernel(
    # pointers
    x_ptr,  # [T, N]
    residual_ptr,  # [T, N] (unused without HAS_RESIDUAL)
    delta_ptr,  # [T, N] (unused without HAS_DELTA)
    weight_ptr,  # [N]
    out_ptr,  # [T, N]
    residual_out_ptr,  # [T, N] (unused without HAS_RESIDUAL)
    # sizes
    N,
    eps,
    # strides
    stride_x, stride_r, stride_d, stride_o, stride_ro,
    # meta-parameters
    HAS_RESIDUAL: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # lorakernels/pdl.py: wait for the previous grid first
):  # fmt: skip
    if USE_PDL:
        wait_for_producer()
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    mask = offs_n < N
    # -- the adds, each rounded once to the model dtype ------------------------------------------------
    x = residual_sum(x_ptr + row * stride_x, residual_ptr + row * stride_r, delta_ptr + row * stride_d, offs_n, mask, HAS_RESIDUAL, HAS_DELTA)
    if HAS_RESIDUAL or HAS_DELTA:
        tl.store(residual_out_ptr + row * stride_ro + offs_n, x, mask=mask)

    # -- normalise in fp32, round, scale in the model dtype ------------------------------------------
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=0) / N
    normed = (x32 * tl.rsqrt(mean_sq + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + offs_n, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)  # exact for 16-bit operands: one rounding below
    tl.store(out_ptr + row * stride_o + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, delta: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"want x [T, N], weight [N]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight is {weight.dtype} on {weight.device}, x is {x.dtype} on {x.device}")
    for name, t in (("residual", residual), ("delta", delta)):
        if t is not None and (t.shape != x.shape or t.dtype != x.dtype):
            raise ValueError(f"{name} is {tuple(t.shape)} {t.dtype}, x is {tuple(x.shape)} {x.dtype}")
        if t is not None and t.stride(1) != 1:
            raise ValueError(f"{name} rows must be contiguous")
    if x.shape[1] > MAX_HIDDEN:
        raise ValueError(f"rows of {x.shape[1]} exceed the one-program-per-row limit {MAX_HIDDEN}")
    if x.stride(1) != 1:
        raise ValueError("x rows must be contiguous")


def add_rmsnorm(
    x: torch.Tensor,  # [T, N]
    residual: torch.Tensor | None,  # [T, N] or None (no add: the first layer)
    weight: torch.Tensor,  # [N]
    eps: float,
    delta: torch.Tensor | None = None,  # [T, N]: a LoRA delta still to add to x, first
    out: torch.Tensor | None = None,  # [T, N] with contiguous rows (another tensor's columns, say) or None: new
) -> tuple[torch.Tensor, torch.Tensor]:  # (out [T, N], new residual [T, N]); the residual is x when both None
    """out = weight * rmsnorm((x + delta) + residual), residual_out = (x + delta) + residual; see the
    module doc."""
    _check(x, residual, weight, delta)
    out = output_like(x, out)
    residual_out = x if residual is None and delta is None else torch.empty_like(x)
    if x.shape[0] == 0:
        return out, residual_out
    block_n = triton.next_power_of_2(x.shape[1])
    r = x if residual is None else residual
    d = x if delta is None else delta
    _add_rmsnorm_kernel[(x.shape[0],)](
        x, r, d, weight, out, residual_out,
        x.shape[1], eps,
        x.stride(0), r.stride(0), d.stride(0), out.stride(0), residual_out.stride(0),
        HAS_RESIDUAL=residual is not None,
        HAS_DELTA=delta is not None,
        BLOCK_N=block_n,
        num_warps=min(max(block_n // 512, 1), 16),
        **pdl.launch(x.device),
    )  # fmt: skip
    return out, residual_out


@triton.jit
def _add_rmsnorm_expand_kernel(
    # pointers
    x_ptr,  # [T, N]
    residual_ptr,  # [T, N] (unused without HAS_RESIDUAL)
    v_ptr,  # [T, R]: the projection's shrink
    b_ptr,  # [num_slots, N, R]
    weight_ptr,  # [N]
    out_ptr,  # [T, N]
    residual_out_ptr,  # [T, N]
    seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, scalings_ptr,
    # sizes
    num_tokens,
    N,
    eps,
    num_segments,
    seg_blocks,  # row programs for the segments; the rest take the rows after the last segment
    # strides
    stride_x, stride_r, stride_v, stride_bw, stride_bn, stride_bk, stride_o, stride_ro,
    # meta-parameters
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    # a segment's row block, or rows no segment covers (a graph's padding): the add and the norm alone
    slot, rank, m_start, m_end = segment_or_tail_block(
        seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, num_segments, num_tokens, tl.program_id(0), seg_blocks, BLOCK_M, BLOCK_S
    )  # fmt: skip
    if m_start >= m_end:
        return
    offs_m = (m_start + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = offs_m < m_end
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank  # v past the rank is not written by the shrink
    scaling = tl.load(scalings_ptr + slot)
    vt = tl.load(v_ptr + offs_m[:, None] * stride_v + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    if UPCAST_DOT:
        vt = vt.to(tl.float32)
    b_base = b_ptr + slot.to(tl.int64) * stride_bw
    # -- pass 1: x + its expand, + the residual (each sum rounded once), stored; the rows' sums of squares
    sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask = mask_m[:, None] & (offs_n < N)[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_n[None, :], mask=mask, other=0.0)
        if rank > 0:
            b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_bk,
                        mask=mask_r[:, None] & (offs_n < N)[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]: B^T  # fmt: skip
            if UPCAST_DOT:
                b = b.to(tl.float32)
            d = tl.dot(vt, b, input_precision=INPUT_PRECISION)
            x = (x.to(tl.float32) + scaling * d).to(x_ptr.dtype.element_ty)  # what sgmv_expand stores in y
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + offs_m[:, None] * stride_r + offs_n[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + offs_m[:, None] * stride_ro + offs_n[None, :], x, mask=mask)
        x32 = x.to(tl.float32)
        sum_sq += tl.sum(x32 * x32, axis=1)
    rstd = tl.rsqrt(sum_sq / N + eps)
    tl.debug_barrier()  # pass 2 reads what other threads of the program stored in pass 1
    # -- pass 2: normalise in fp32, round, scale in the model dtype -----------------------------------
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask = mask_m[:, None] & (offs_n < N)[None, :]
        s32 = tl.load(residual_out_ptr + offs_m[:, None] * stride_ro + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        normed = (s32 * rstd[:, None]).to(x_ptr.dtype.element_ty)
        w = tl.load(weight_ptr + offs_n, mask=offs_n < N, other=0.0)
        out = w.to(tl.float32)[None, :] * normed.to(tl.float32)
        tl.store(out_ptr + offs_m[:, None] * stride_o + offs_n[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm_expand(
    x: torch.Tensor,  # [T, N]
    residual: torch.Tensor | None,  # [T, N] or None
    weight: torch.Tensor,  # [N]
    eps: float,
    v: torch.Tensor,  # [T, R]: the projection's shrink
    B: torch.Tensor,  # [num_slots, N, R], x.dtype
    meta: SgmvMeta,
    *,
    block_m: int = 16,
    block_n: int = 256,
    num_warps: int = 4,
    out: torch.Tensor | None = None,  # as add_rmsnorm's
) -> tuple[torch.Tensor, torch.Tensor]:  # (out [T, N], new residual [T, N]); x is left as it was
    """add_rmsnorm(x after `sgmv_expand(v, B, meta, x, output_slices=((0, N),))`, residual, weight, eps)
    in one kernel: a prefill-sized step's o or down expand added as x is loaded, instead of the expand
    reading and writing x first (engine/lora_inputs.py PendingExpand). Row blocks of block_m rows follow
    the segments (lorakernels/sgmv.py `row_block`); each walks its rows twice in block_n columns, the
    second pass normalising what the first stored. Rows past the last segment (a graph's padding) get
    the add and the norm alone. Ranks up to FUSED_MAX_RANK."""
    _check(x, residual, weight, None)
    check_expand_args(v, B, meta, x, ((0, x.shape[1]),))
    if B.shape[2] > FUSED_MAX_RANK:
        raise ValueError(f"rank capacity {B.shape[2]} > {FUSED_MAX_RANK}: expand first, then add_rmsnorm")
    if v.stride(1) != 1 or B.dtype != x.dtype:
        raise ValueError(f"want v with contiguous rows and B in x's dtype {x.dtype}, got {B.dtype}")
    out, residual_out = output_like(x, out), torch.empty_like(x)
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return out, residual_out
    seg_blocks, tail_blocks = seg_and_tail_blocks(meta, num_tokens, block_m)
    r = x if residual is None else residual
    _add_rmsnorm_expand_kernel[(seg_blocks + tail_blocks,)](
        x, r, v, B, weight, out, residual_out,
        meta.seg_indptr, meta.weight_indices, meta.lora_ranks, meta.scalings,
        num_tokens, x.shape[1], eps, meta.num_segments, seg_blocks,
        x.stride(0), r.stride(0), v.stride(0), B.stride(0), B.stride(1), B.stride(2), out.stride(0), residual_out.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(B.shape[2])), BLOCK_S=SEGMENT_CHUNK,
        INPUT_PRECISION="ieee",  # as lorakernels/sgmv.py: fp32 operands exact, no TF32
        UPCAST_DOT=x.device.type == "cpu" and x.dtype == torch.bfloat16,
        num_warps=num_warps,
    )  # fmt: skip
    return out, residual_out


def add_rmsnorm_ref(
    x: torch.Tensor,  # [T, N]
    residual: torch.Tensor | None,  # [T, N] or None
    weight: torch.Tensor,  # [N]
    eps: float,
    delta: torch.Tensor | None = None,  # [T, N] or None
) -> tuple[torch.Tensor, torch.Tensor]:  # (out [T, N], new residual [T, N])
    """The same in PyTorch, in the order engine/models/blocks.py's RMSNorm rounds (the CPU path)."""
    x = x if delta is None else x + delta
    s = x if residual is None else x + residual
    s32 = s.float()
    normed = (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype)
    return weight * normed, s
