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

from lorakernels.pending_delta import load_plus_delta

MAX_HIDDEN = 16384


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
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    mask = offs_n < N
    # -- the adds, each rounded once to the model dtype (what `x + d` and `x + r` in PyTorch do) -------
    x = load_plus_delta(x_ptr + row * stride_x, delta_ptr + row * stride_d, offs_n, mask, HAS_DELTA)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs_n, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
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
) -> tuple[torch.Tensor, torch.Tensor]:  # (out [T, N], new residual [T, N]); the residual is x when both None
    """out = weight * rmsnorm((x + delta) + residual), residual_out = (x + delta) + residual; see the
    module doc."""
    _check(x, residual, weight, delta)
    out = torch.empty_like(x)
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
