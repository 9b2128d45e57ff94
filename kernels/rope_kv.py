"""Rotary embedding fused with the paged KV-cache write, in Triton, from the fused q/k/v projection.

Semantics (rotate-half layout of Hugging Face Llama; rounding where engine/rope.py rounds), token t,
D = head_dim, c = cos_sin[positions[t], :D/2], s = cos_sin[positions[t], D/2:]:

    qkv      = round(qkv + delta)                                 delta given (a LoRA delta still to add)
    q[t, h]  = qkv[t, h*D : (h+1)*D]                              h < H
    k[t, j]  = qkv[t, H*D + j*D : ...],  v[t, j] = qkv[t, (H+Hkv)*D + j*D : ...]      j < Hkv
    rope(u)  = round(cat(u1 * c - u2 * s, u2 * c + u1 * s))        u1, u2 = halves of u in fp32

    q_out[t, h]                      = rope(q[t, h])               returned
    k_cache[out_cache_loc[t], j]     = rope(k[t, j])               written in place
    v_cache[out_cache_loc[t], j]     = v[t, j]                     written in place

    qkv, delta [T, (H + 2 Hkv) D] fp16/bf16/fp32; positions [T] int; cos_sin [P, D] fp32 (engine/rope.py's table)
    k_cache, v_cache [num_slots, Hkv, D] qkv.dtype; out_cache_loc [T] int; q_out [T, H, D] qkv.dtype

Grid (T, H + Hkv): program (t, h) rotates query head h, or (h >= H) key head h - H and copies its value
head. The unfused path reads q and k in fp32 copies, concatenates, casts, then scatters k and v: five
passes over the heads where this is one. The fp32 products may contract into FMAs, so a rotated value
can differ from PyTorch's by an ulp of fp32 before rounding to the model dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pending_delta import load_plus_delta


@triton.jit
def _rope_kv_kernel(
    # pointers
    qkv_ptr,  # [T, (H + 2 Hkv) * D]
    delta_ptr,  # [T, (H + 2 Hkv) * D] (unused without HAS_DELTA)
    positions_ptr,  # [T] int
    cos_sin_ptr,  # [P, D] fp32
    k_cache_ptr,  # [num_slots, Hkv, D]
    v_cache_ptr,  # [num_slots, Hkv, D]
    out_cache_loc_ptr,  # [T] int
    q_out_ptr,  # [T, H, D]
    # sizes
    num_heads,
    num_kv_heads,
    # strides
    stride_qkv, stride_d, stride_cs,
    stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head,
    stride_qo_tok, stride_qo_head,
    # meta-parameters
    HAS_DELTA: tl.constexpr,
    HALF: tl.constexpr,  # D // 2
    BLOCK_HALF: tl.constexpr,  # next power of two >= HALF
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    pos = tl.load(positions_ptr + t).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs, mask=mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs, mask=mask, other=0.0)

    # -- the head this program rotates: a query head, or a key head (then its value head too) ----------
    row_ptr = qkv_ptr + t * stride_qkv + h * 2 * HALF
    d_ptr = delta_ptr + t * stride_d + h * 2 * HALF
    u1 = load_plus_delta(row_ptr, d_ptr, offs, mask, HAS_DELTA).to(tl.float32)
    u2 = load_plus_delta(row_ptr + HALF, d_ptr + HALF, offs, mask, HAS_DELTA).to(tl.float32)
    r1 = (u1 * cos - u2 * sin).to(q_out_ptr.dtype.element_ty)
    r2 = (u2 * cos + u1 * sin).to(q_out_ptr.dtype.element_ty)
    if h < num_heads:
        dst = q_out_ptr + t * stride_qo_tok + h * stride_qo_head
        tl.store(dst + offs, r1, mask=mask)
        tl.store(dst + HALF + offs, r2, mask=mask)
    else:
        j = h - num_heads
        loc = tl.load(out_cache_loc_ptr + t).to(tl.int64)
        k_dst = k_cache_ptr + loc * stride_kc_slot + j * stride_kc_head
        tl.store(k_dst + offs, r1.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(k_dst + HALF + offs, r2.to(k_cache_ptr.dtype.element_ty), mask=mask)
        v_src = row_ptr + num_kv_heads * 2 * HALF  # the value head sits Hkv heads after its key head
        v_d = d_ptr + num_kv_heads * 2 * HALF
        v_dst = v_cache_ptr + loc * stride_vc_slot + j * stride_vc_head
        tl.store(v_dst + offs, load_plus_delta(v_src, v_d, offs, mask, HAS_DELTA), mask=mask)
        tl.store(v_dst + HALF + offs, load_plus_delta(v_src + HALF, v_d + HALF, offs, mask, HAS_DELTA), mask=mask)


def _check(
    qkv, positions, cos_sin, k_cache, v_cache, out_cache_loc, num_heads, num_kv_heads, head_dim, delta
) -> None:
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [T, (H + 2 Hkv) * D] with contiguous rows")
    if delta is not None and (delta.shape != qkv.shape or delta.dtype != qkv.dtype or delta.stride(1) != 1):
        raise ValueError(f"delta {tuple(delta.shape)} {delta.dtype} is not qkv's {tuple(qkv.shape)} {qkv.dtype} with contiguous rows")
    if head_dim % 2 or cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim or cos_sin.dtype != torch.float32:
        raise ValueError(
            f"want an even head_dim and cos_sin [P, {head_dim}] fp32, got {tuple(cos_sin.shape)} {cos_sin.dtype}"
        )
    want = (num_kv_heads, head_dim)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (
            cache.dim() != 3
            or tuple(cache.shape[1:]) != want
            or cache.stride(2) != 1
            or cache.dtype != qkv.dtype
        ):
            raise ValueError(
                f"{name} {tuple(cache.shape)} {cache.dtype} is not [slots, {num_kv_heads}, {head_dim}] {qkv.dtype}"
            )
    if positions.shape != (qkv.shape[0],) or out_cache_loc.shape != (qkv.shape[0],):
        raise ValueError(
            f"positions {tuple(positions.shape)} and out_cache_loc {tuple(out_cache_loc.shape)} want [{qkv.shape[0]}]"
        )
    if cos_sin.stride(1) != 1:
        raise ValueError("cos_sin rows must be contiguous")


def rope_kv_write(
    qkv: torch.Tensor,  # [T, (H + 2 Hkv) * D]
    positions: torch.Tensor,  # [T] int
    cos_sin: torch.Tensor,  # [P, D] fp32
    k_cache: torch.Tensor,  # [num_slots, Hkv, D], written at out_cache_loc
    v_cache: torch.Tensor,  # [num_slots, Hkv, D], written at out_cache_loc
    out_cache_loc: torch.Tensor,  # [T] int
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    delta: torch.Tensor | None = None,  # [T, (H + 2 Hkv) * D]: a LoRA delta still to add to qkv, first
) -> torch.Tensor:  # q [T, H, D], rotated
    """Rotate q and k by their positions, write k and v into the paged cache, return q; see the module doc."""
    _check(qkv, positions, cos_sin, k_cache, v_cache, out_cache_loc, num_heads, num_kv_heads, head_dim, delta)
    num_tokens = qkv.shape[0]
    q_out = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    d = qkv if delta is None else delta
    _rope_kv_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv, d, positions, cos_sin, k_cache, v_cache, out_cache_loc, q_out,
        num_heads, num_kv_heads,
        qkv.stride(0), d.stride(0), cos_sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        q_out.stride(0), q_out.stride(1),
        HAS_DELTA=delta is not None,
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=1 if half <= 64 else 2,
    )  # fmt: skip
    return q_out


def rope_kv_write_ref(
    qkv: torch.Tensor,  # [T, (H + 2 Hkv) * D]
    positions: torch.Tensor,  # [T] int
    cos_sin: torch.Tensor,  # [P, D] fp32
    k_cache: torch.Tensor,  # [num_slots, Hkv, D], written at out_cache_loc
    v_cache: torch.Tensor,  # [num_slots, Hkv, D], written at out_cache_loc
    out_cache_loc: torch.Tensor,  # [T] int
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    delta: torch.Tensor | None = None,
) -> torch.Tensor:  # q [T, H, D], rotated
    """The same in PyTorch, rounding as engine/rope.py's apply_rope and the model's cache write do."""
    if delta is not None:
        qkv = qkv + delta
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # each [T, D/2]
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(u: torch.Tensor) -> torch.Tensor:  # [T, heads, D]
        u1, u2 = u.float().chunk(2, dim=-1)
        return torch.cat([u1 * cos - u2 * sin, u2 * cos + u1 * sin], dim=-1).to(u.dtype)

    k_cache[out_cache_loc] = rotate(k.view(-1, num_kv_heads, head_dim)).to(k_cache.dtype)
    v_cache[out_cache_loc] = v.reshape(-1, num_kv_heads, head_dim).to(v_cache.dtype)
    return rotate(q.view(-1, num_heads, head_dim))
