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

With `expand` = (v, B, meta) instead of a delta, the kernel computes the delta itself, a decode step's
q/k/v LoRA expand (engine/lora_inputs.py, --lora-decode-fused-expand), each head from its own columns:

    delta[t, o_k + c] = round(scalings[w] * v[t, k*R : k*R + r] @ B[w, o_k + c, :r]^T)   k = q, k, v

    w, r: the slot of row t's segment (found in meta.seg_indptr on the device) and its rank; rows past
    the last segment (a graph's padding) get none; v [T, 3 R], B [num_slots, (H + 2 Hkv) D, R]

rounded as the decode expand rounds the delta it writes (lorakernels/sgmv_decode.py), so the sum is what the
delta path gives up to the order of the rank's fp32 sum.

Grid (T, H + Hkv): program (t, h) rotates query head h, or (h >= H) key head h - H and copies its value
head; prompt-sized steps without an expand take HEADS_PER_PROGRAM heads a program
(`_rope_kv_heads_kernel`). The unfused path reads q and k in fp32 copies, concatenates, casts, then
scatters k and v: five passes over the heads where this is one. The fp32 products may contract into FMAs, so a rotated value
can differ from PyTorch's by an ulp of fp32 before rounding to the model dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorakernels import pdl
from lorakernels.pdl import wait_for_producer
from lorakernels.pending_delta import load_plus_delta
from lorakernels.sgmv import SEGMENT_CHUNK, check_expand_args, row_adapter
from lorakernels.sgmv_ref import SgmvMeta, sgmv_expand_ref

# A prefill step's rotation: 81920 one-head programs for 2048 tokens of Llama-3-8B took 51 us a layer on an
# H100, about 3x its bytes (BENCHMARKS.md, 2026-12-06); 8 heads a program launch 10240. Decode steps keep
# one head a program (their few tokens need the programs).
HEADS_PER_PROGRAM = 8
GROUP_MIN_TOKENS = 256


@triton.jit
def _load_plus_expand(src_ptr, offs, mask, v_ptr, b_ptr, stride_bn, offs_r, mask_r, scaling):
    """src[offs] plus its LoRA delta, scaling * v[:r] @ B[offs, :r]^T rounded to src's dtype, the sum
    rounded once more (what the delta path gives); v_ptr: the row's v of this target, b_ptr: the slot's
    B at this head's first column."""
    u = tl.load(src_ptr + offs, mask=mask, other=0.0)
    vv = tl.load(v_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)  # [BLOCK_R]
    b = tl.load(b_ptr + offs[:, None] * stride_bn + offs_r[None, :], mask=mask[:, None] & mask_r[None, :], other=0.0)
    d = (tl.sum(b.to(tl.float32) * vv[None, :], axis=1) * scaling).to(src_ptr.dtype.element_ty)
    return (u.to(tl.float32) + d.to(tl.float32)).to(src_ptr.dtype.element_ty)


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
    v_ptr,  # [T, 3 R] (unused without HAS_EXPAND)
    b_ptr,  # [num_slots, (H + 2 Hkv) * D, R], rank columns contiguous
    seg_indptr_ptr,  # [num_segments + 1] int32
    weight_indices_ptr,  # [num_segments] int32
    lora_ranks_ptr,  # [num_slots] int32
    scalings_ptr,  # [num_slots] fp32
    # sizes
    num_heads,
    num_kv_heads,
    num_segments,
    max_rank,  # R: v's columns a target
    # strides
    stride_qkv, stride_d, stride_cs,
    stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head,
    stride_qo_tok, stride_qo_head,
    stride_v, stride_bw, stride_bn,
    # meta-parameters
    HAS_DELTA: tl.constexpr,
    HAS_EXPAND: tl.constexpr,
    HALF: tl.constexpr,  # D // 2
    BLOCK_HALF: tl.constexpr,  # next power of two >= HALF
    BLOCK_R: tl.constexpr,  # >= R
    BLOCK_S: tl.constexpr,  # segments a step of the row's segment search reads
    USE_PDL: tl.constexpr = False,  # lorakernels/pdl.py: wait for the previous grid first
):  # fmt: skip
    if USE_PDL:
        wait_for_producer()
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
    if HAS_EXPAND:  # this row's adapter: its slot, rank (0: none, or a row past the segments) and scaling
        slot, rank = row_adapter(seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, num_segments, t, BLOCK_S)
        scaling = tl.load(scalings_ptr + slot)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        v_row = v_ptr + t * stride_v + tl.where(h < num_heads, 0, max_rank)  # q's columns of v, or k's
        b_col = b_ptr + slot.to(tl.int64) * stride_bw + (h * 2 * HALF) * stride_bn
        u1 = _load_plus_expand(row_ptr, offs, mask, v_row, b_col, stride_bn, offs_r, mask_r, scaling).to(tl.float32)
        b_half = b_col + HALF * stride_bn
        u2 = _load_plus_expand(row_ptr + HALF, offs, mask, v_row, b_half, stride_bn, offs_r, mask_r, scaling).to(tl.float32)
    else:
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
        v_dst = v_cache_ptr + loc * stride_vc_slot + j * stride_vc_head
        if HAS_EXPAND:
            vv_row = v_ptr + t * stride_v + 2 * max_rank  # v's columns of the value target
            b_v = b_ptr + slot.to(tl.int64) * stride_bw + ((h + num_kv_heads) * 2 * HALF) * stride_bn
            first = _load_plus_expand(v_src, offs, mask, vv_row, b_v, stride_bn, offs_r, mask_r, scaling)
            second = _load_plus_expand(v_src + HALF, offs, mask, vv_row, b_v + HALF * stride_bn, stride_bn, offs_r, mask_r, scaling)
        else:
            v_d = d_ptr + num_kv_heads * 2 * HALF
            first = load_plus_delta(v_src, v_d, offs, mask, HAS_DELTA)
            second = load_plus_delta(v_src + HALF, v_d + HALF, offs, mask, HAS_DELTA)
        tl.store(v_dst + offs, first, mask=mask)
        tl.store(v_dst + HALF + offs, second, mask=mask)


@triton.jit
def _rope_kv_heads_kernel(
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
    HEADS: tl.constexpr,  # heads a program rotates (a power of two)
    USE_PDL: tl.constexpr = False,  # lorakernels/pdl.py: wait for the previous grid first
):  # fmt: skip
    if USE_PDL:
        wait_for_producer()
    """`_rope_kv_kernel` without an expand for HEADS heads of one token a program (grid (T, cdiv(H + Hkv,
    HEADS))): a prefill step's thousands of tokens then launch H + Hkv / HEADS times fewer programs, each
    loading its token's cos and sin once. Query heads and key heads (with their value heads) may share a
    program: each store is masked to its kind."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # [HEADS]
    offs = tl.arange(0, BLOCK_HALF)
    mask_d = offs < HALF
    live = heads < num_heads + num_kv_heads
    is_q = heads < num_heads
    pos = tl.load(positions_ptr + t).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs, mask=mask_d, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs, mask=mask_d, other=0.0)[None, :]
    cols = heads[:, None] * 2 * HALF + offs[None, :]  # [HEADS, BLOCK_HALF]: each head's first half
    mask = live[:, None] & mask_d[None, :]
    row_ptr = qkv_ptr + t * stride_qkv
    d_ptr = delta_ptr + t * stride_d
    u1 = load_plus_delta(row_ptr, d_ptr, cols, mask, HAS_DELTA).to(tl.float32)
    u2 = load_plus_delta(row_ptr + HALF, d_ptr + HALF, cols, mask, HAS_DELTA).to(tl.float32)
    r1 = (u1 * cos - u2 * sin).to(q_out_ptr.dtype.element_ty)
    r2 = (u2 * cos + u1 * sin).to(q_out_ptr.dtype.element_ty)
    # query heads: q_out[t, h]
    q_mask = mask & is_q[:, None]
    q_dst = q_out_ptr + t * stride_qo_tok + heads[:, None] * stride_qo_head + offs[None, :]
    tl.store(q_dst, r1, mask=q_mask)
    tl.store(q_dst + HALF, r2, mask=q_mask)
    # key heads j = h - H: k_cache[loc, j] rotated, v_cache[loc, j] the value head Hkv heads on
    k_mask = mask & (~is_q)[:, None]
    j = tl.where(is_q, 0, heads - num_heads)[:, None]
    loc = tl.load(out_cache_loc_ptr + t).to(tl.int64)
    k_dst = k_cache_ptr + loc * stride_kc_slot + j * stride_kc_head + offs[None, :]
    tl.store(k_dst, r1.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    tl.store(k_dst + HALF, r2.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    v_cols = cols + num_kv_heads * 2 * HALF
    first = load_plus_delta(row_ptr, d_ptr, v_cols, k_mask, HAS_DELTA)
    second = load_plus_delta(row_ptr + HALF, d_ptr + HALF, v_cols, k_mask, HAS_DELTA)
    v_dst = v_cache_ptr + loc * stride_vc_slot + j * stride_vc_head + offs[None, :]
    tl.store(v_dst, first, mask=k_mask)
    tl.store(v_dst + HALF, second, mask=k_mask)


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
    expand: tuple[torch.Tensor, torch.Tensor, SgmvMeta] | None = None,  # (v, B, meta): the delta's expand, done here
    heads_per_program: int | None = None,  # without an expand: None = HEADS_PER_PROGRAM from GROUP_MIN_TOKENS tokens, else 1
) -> torch.Tensor:  # q [T, H, D], rotated
    """Rotate q and k by their positions, write k and v into the paged cache, return q; see the module doc.
    Steps of GROUP_MIN_TOKENS tokens or more without an expand rotate HEADS_PER_PROGRAM heads a program
    (`_rope_kv_heads_kernel`); decode-sized ones one head a program."""
    _check(qkv, positions, cos_sin, k_cache, v_cache, out_cache_loc, num_heads, num_kv_heads, head_dim, delta)
    if expand is not None:
        _check_expand(qkv, expand, delta, _qkv_slices(num_heads, num_kv_heads, head_dim))
    num_tokens = qkv.shape[0]
    q_out = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    d = qkv if delta is None else delta
    if heads_per_program is None:
        heads_per_program = HEADS_PER_PROGRAM if num_tokens >= GROUP_MIN_TOKENS else 1
    if expand is None and heads_per_program > 1:
        heads = triton.next_power_of_2(heads_per_program)
        _rope_kv_heads_kernel[(num_tokens, triton.cdiv(num_heads + num_kv_heads, heads))](
            qkv, d, positions, cos_sin, k_cache, v_cache, out_cache_loc, q_out,
            num_heads, num_kv_heads,
            qkv.stride(0), d.stride(0), cos_sin.stride(0),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            q_out.stride(0), q_out.stride(1),
            HAS_DELTA=delta is not None, HALF=half, BLOCK_HALF=triton.next_power_of_2(half), HEADS=heads,
            num_warps=4, **pdl.launch(qkv.device),
        )  # fmt: skip
        return q_out
    if expand is None:  # the expand's arguments unused: any tensors of the right kinds
        lora_args, max_rank = (qkv, qkv, positions, positions, positions, cos_sin), 1
        num_segments, strides = 0, (0, 0, 0)
    else:
        v, B, meta = expand
        lora_args, max_rank = (v, B, meta.seg_indptr, meta.weight_indices, meta.lora_ranks, meta.scalings), B.shape[2]
        num_segments, strides = meta.num_segments, (v.stride(0), B.stride(0), B.stride(1))
    _rope_kv_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv, d, positions, cos_sin, k_cache, v_cache, out_cache_loc, q_out, *lora_args,
        num_heads, num_kv_heads, num_segments, max_rank,
        qkv.stride(0), d.stride(0), cos_sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        q_out.stride(0), q_out.stride(1), *strides,
        HAS_DELTA=delta is not None,
        HAS_EXPAND=expand is not None,
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_R=max(16, triton.next_power_of_2(max_rank)),
        BLOCK_S=min(max(16, triton.next_power_of_2(max(num_segments, 1))), SEGMENT_CHUNK),
        num_warps=4 if expand is not None else 1 if half <= 64 else 2,  # an expand's [D/2, R] fp32 tiles
        **pdl.launch(qkv.device),
    )  # fmt: skip
    return q_out


def _qkv_slices(num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[tuple[int, int], ...]:
    """The (offset, size) of q, k and v in the fused projection's columns."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    return ((0, q_size), (q_size, kv_size), (q_size + kv_size, kv_size))


def _check_expand(qkv: torch.Tensor, expand, delta, slices: tuple[tuple[int, int], ...]) -> None:
    """(v [T, 3 R], B [num_slots, (H + 2 Hkv) D, R], meta): what every expand takes (lorakernels/sgmv.py
    `check_expand_args`), in qkv's dtype, with contiguous rank columns."""
    if delta is not None:
        raise ValueError("give a LoRA delta or its expand, not both")
    v, B, meta = expand
    check_expand_args(v, B, meta, qkv, slices)
    if B.dtype != qkv.dtype or B.stride(2) != 1:
        raise ValueError(f"B {tuple(B.shape)} {B.dtype} is not [slots, {qkv.shape[1]}, R] {qkv.dtype} with contiguous ranks")
    if v.stride(1) != 1:
        raise ValueError(f"v {tuple(v.shape)} has columns that are not contiguous")
    if meta.lora_ranks.shape[0] != B.shape[0]:
        raise ValueError(f"meta has {meta.lora_ranks.shape[0]} slots' ranks, B {B.shape[0]} slots")


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
    expand: tuple[torch.Tensor, torch.Tensor, SgmvMeta] | None = None,
) -> torch.Tensor:  # q [T, H, D], rotated
    """The same in PyTorch, rounding as engine/rope.py's apply_rope and the model's cache write do."""
    if expand is not None:  # the delta the decode expand writes: rounded to qkv's dtype, 0 where no LoRA
        v, B, meta = expand
        delta = torch.zeros_like(qkv)
        sgmv_expand_ref(v, B, meta, delta, output_slices=_qkv_slices(num_heads, num_kv_heads, head_dim))
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
