"""A decode-specialised SGMV shrink in Triton: split-K over in_dim, several segments per program, and
work that follows each adapter's rank rather than the slot capacity R.

Semantics and the contract on v are those of `sgmv_shrink` (kernels/sgmv_ref.py; `sgmv_shrink_ref` is
the reference of both):

    v[seg, k*R : k*R + r] = x[seg] @ A[w, k*R : k*R + r, :]^T          r = lora_ranks[w], fp32 accumulate

    x [T, in_dim] fp16/bf16/fp32, A [num_slots, num_stack * R, in_dim] x.dtype, v [T, num_stack * R] x.dtype

Why another shrink: a decode step is many segments of one token each. `sgmv_shrink` gives each segment
one program that walks all of in_dim (the 14336-wide down projection: 112 serial tiles) through a
16-row tensor-core tile of which one row is real, and its tile is R wide whatever the rank. Here:

    stage 1, grid (num_splits, cdiv(num_segments, SEGS), num_stack): program (s, g, k) takes segments
        g*SEGS .. g*SEGS+SEGS-1 and, for each of their rows and each BLOCK_R-wide tile of ranks below r
        (a loop bounded by the slot's rank: a rank-16 adapter in a rank-64 slot costs 16 rows of A),
        the dot products over in_dim columns s*SPLIT_K .. (s+1)*SPLIT_K as vector multiply-adds:
            partial[s, row, k*R + n] = x[row, chunk s] . A[w, k*R + n, chunk s]     (fp32)
        With SEGS > 1, neighbouring segments of one adapter re-read their A chunk from L1; the default
        is SEGS = 1, faster on an H200 (BENCHMARKS.md): a program's segments run one after another.
    stage 2, grid (num_segments, num_stack): v[row, k*R + n] = round(sum_s partial[s, row, k*R + n])
        for the rows and ranks stage 1 wrote, all splits in one [splits, R] load and a tree sum
        (deterministic; no atomics).

Both grids are fixed by host ints (num_segments, in_dim, the device's SM count), so launching never
syncs and a captured CUDA graph serves every step of its batch size. Rows are visited one at a time, so
long (prefill) segments are slow here: `sgmv_shrink_auto` sends steps with segments longer than
DECODE_MAX_SEG_LEN tokens to `sgmv_shrink`.

The decode expand, `sgmv_expand_decode` (semantics of `sgmv_expand`):

    y[seg, o_k : o_k + n_k] += scaling[w] * v[seg, k*R : k*R + r] @ B[w, o_k : o_k + n_k, :r]^T

    grid (num_segments, cdiv(max n_k, BLOCK_N), num_stack): program (g, j, k) loads its segment's
        [BLOCK_N, r] tile of B once (columns past the slot's rank are masked, so they are never read)
        and, for each row of the segment, adds the fp32 sum over r of B * v[row] into y's BLOCK_N
        columns. No tensor-core tile of 16 rows with one real row, no atomics: every (row, column) of y
        has one writer. A base-model segment (rank 0) returns at once.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.sgmv import MAX_GRID_YZ, MAX_STACK, check_expand_args, sgmv_expand, sgmv_shrink, shrink_output
from kernels.sgmv_ref import SgmvMeta

DECODE_MAX_SEG_LEN = 4
DEFAULT_SEGS = 1  # measured on an H200: 1 beats 4 by up to 1.6x (o, gate_up), ties on down
MAX_SPLITS = 128
BLOCK_R = 16
PROGRAMS_PER_SM = 4  # enough resident programs to keep each SM's loads in flight


@triton.jit
def _shrink_split_kernel(
    # pointers
    x_ptr,  # [T, K]
    a_ptr,  # [num_slots, num_stack * R, K]
    partial_ptr,  # [num_splits, T, num_stack * R] fp32
    seg_indptr_ptr,  # [num_segments + 1] int32
    weight_indices_ptr,  # [num_segments] int32
    lora_ranks_ptr,  # [num_slots] int32
    # sizes
    K,
    max_rank,  # R
    num_segments,
    # strides
    stride_xm, stride_xk,
    stride_aw, stride_an, stride_ak,
    stride_ps, stride_pm, stride_pn,
    # meta-parameters
    SEGS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_s = tl.program_id(0)
    pid_g = tl.program_id(1)
    pid_k = tl.program_id(2)  # stacked target
    k_start = pid_s * SPLIT_K
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    for i in tl.static_range(SEGS):
        seg = pid_g * SEGS + i
        if seg < num_segments:
            # -- this segment's slot, rank and rows --------------------------------------------------
            slot = tl.load(weight_indices_ptr + seg)
            rank = tl.load(lora_ranks_ptr + slot)
            row_end = tl.load(seg_indptr_ptr + seg + 1)
            a_base = a_ptr + slot.to(tl.int64) * stride_aw + (pid_k * max_rank) * stride_an
            for row in range(tl.load(seg_indptr_ptr + seg), row_end):
                x_row = x_ptr + row * stride_xm  # T * in_dim < 2**31 for any decode step
                # -- rank tiles below this slot's rank: rank 0 (base model, empty slot) runs none -----
                for n0 in range(0, rank, BLOCK_R):
                    cols = n0 + offs_r
                    mask_r = cols < rank
                    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
                    for kk in tl.static_range(0, SPLIT_K, BLOCK_K):
                        offs = k_start + kk + offs_k
                        mask_k = offs < K
                        xv = tl.load(x_row + offs * stride_xk, mask=mask_k, other=0.0).to(tl.float32)
                        a_ptrs = a_base + cols[:, None] * stride_an + offs[None, :] * stride_ak
                        av = tl.load(a_ptrs, mask=mask_r[:, None] & mask_k[None, :], other=0.0)
                        acc += tl.sum(av.to(tl.float32) * xv[None, :], axis=1)
                    p_ptrs = (
                        partial_ptr
                        + pid_s * stride_ps
                        + row * stride_pm
                        + (pid_k * max_rank + cols) * stride_pn
                    )
                    tl.store(p_ptrs, acc, mask=mask_r)


@triton.jit
def _shrink_reduce_kernel(
    # pointers
    partial_ptr,  # [num_splits, T, num_stack * R] fp32
    v_ptr,  # [T, num_stack * R]
    seg_indptr_ptr,  # [num_segments + 1] int32
    weight_indices_ptr,  # [num_segments] int32
    lora_ranks_ptr,  # [num_slots] int32
    # sizes
    max_rank,
    num_splits,
    # strides
    stride_ps, stride_pm, stride_pn,
    stride_vm, stride_vn,
    # meta-parameters
    BLOCK_S: tl.constexpr,  # >= num_splits: every split's partial in one load
    BLOCK_RR: tl.constexpr,  # >= R
):  # fmt: skip
    seg = tl.program_id(0)
    pid_k = tl.program_id(1)
    rank = tl.load(lora_ranks_ptr + tl.load(weight_indices_ptr + seg))
    offs_s = tl.arange(0, BLOCK_S)
    offs_r = tl.arange(0, BLOCK_RR)
    mask = (offs_s[:, None] < num_splits) & (offs_r[None, :] < rank)
    cols = pid_k * max_rank + offs_r
    for row in range(tl.load(seg_indptr_ptr + seg), tl.load(seg_indptr_ptr + seg + 1)):
        p_ptrs = partial_ptr + offs_s[:, None] * stride_ps + row * stride_pm + cols[None, :] * stride_pn
        acc = tl.sum(tl.load(p_ptrs, mask=mask, other=0.0), axis=0)  # [BLOCK_RR]
        tl.store(
            v_ptr + row * stride_vm + cols * stride_vn, acc.to(v_ptr.dtype.element_ty), mask=offs_r < rank
        )


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 32  # the interpreter: enough to exercise several splits on small test shapes


def decode_config(
    in_dim: int, num_segments: int, num_stack: int, device: torch.device, segs: int | None = None
) -> dict:
    """Segments per program, split length and split count: about PROGRAMS_PER_SM programs per SM.

    Example (H200, 132 SMs; down projection in_dim 14336, 32 segments, one target, SEGS 4): 8 groups;
    528 / 8 = 66 splits wanted -> SPLIT_K 256 (a power-of-two number of BLOCK_K tiles) -> 56 splits.
    A program walks its SEGS segments one after another, each behind a chain of dependent loads (slot,
    rank, rows, then x and A), so SEGS trades that latency against fewer, fuller programs.
    """
    block_k = 128 if in_dim <= 2048 else 256
    segs = segs or DEFAULT_SEGS
    groups = triton.cdiv(num_segments, segs)
    wanted = max(1, PROGRAMS_PER_SM * _num_sms(device) // (groups * num_stack))
    tiles = triton.next_power_of_2(triton.cdiv(triton.cdiv(in_dim, wanted), block_k))
    split_k = max(tiles * block_k, triton.next_power_of_2(triton.cdiv(in_dim, MAX_SPLITS)))
    return {"SEGS": segs, "SPLIT_K": split_k, "BLOCK_K": block_k, "num_splits": triton.cdiv(in_dim, split_k)}


def sgmv_shrink_decode(
    x: torch.Tensor,  # [T, in_dim]
    A: torch.Tensor,  # [num_slots, num_stack * R, in_dim], x.dtype
    meta: SgmvMeta,
    *,
    num_stack: int,
    out: torch.Tensor | None = None,  # [T, num_stack * R], x.dtype
    segs: int | None = None,  # segments per program (default DEFAULT_SEGS; benchmarks compare others)
) -> torch.Tensor:  # v [T, num_stack * R], x.dtype; entries outside the LoRA rows/ranks left as they were
    """v[seg, k*R : k*R + r] = x[seg] @ A[w, k*R : k*R + r, :]^T, split over in_dim; see the module doc."""
    out = shrink_output(x, A, meta, num_stack, out)
    num_tokens, in_dim, max_rank = x.shape[0], x.shape[1], A.shape[1] // num_stack
    if meta.num_segments == 0 or num_tokens == 0 or in_dim == 0:
        return out
    config = decode_config(in_dim, meta.num_segments, num_stack, x.device, segs)
    num_splits = config.pop("num_splits")
    groups = triton.cdiv(meta.num_segments, config["SEGS"])
    if groups > MAX_GRID_YZ:
        raise ValueError(f"{meta.num_segments} segments exceed the grid limit")
    partial = torch.empty(num_splits, num_tokens, A.shape[1], dtype=torch.float32, device=x.device)
    _shrink_split_kernel[(num_splits, groups, num_stack)](
        x, A, partial, meta.seg_indptr, meta.weight_indices, meta.lora_ranks,
        in_dim, max_rank, meta.num_segments,
        x.stride(0), x.stride(1),
        A.stride(0), A.stride(1), A.stride(2),
        partial.stride(0), partial.stride(1), partial.stride(2),
        BLOCK_R=BLOCK_R, num_warps=4, **config,
    )  # fmt: skip
    _shrink_reduce_kernel[(meta.num_segments, num_stack)](
        partial, out, meta.seg_indptr, meta.weight_indices, meta.lora_ranks,
        max_rank, num_splits,
        partial.stride(0), partial.stride(1), partial.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_RR=max(triton.next_power_of_2(max_rank), 16),
        num_warps=1 if num_splits * max_rank <= 1024 else 4,
    )  # fmt: skip
    return out


def sgmv_shrink_auto(
    x: torch.Tensor,  # [T, in_dim]
    A: torch.Tensor,  # [num_slots, num_stack * R, in_dim], x.dtype
    meta: SgmvMeta,
    *,
    num_stack: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # v [T, num_stack * R]
    """The decode shrink for steps whose segments hold at most DECODE_MAX_SEG_LEN tokens (a host int,
    so a graph captured for a decode batch keeps the decode kernel), `sgmv_shrink` otherwise."""
    shrink = sgmv_shrink_decode if meta.max_seg_len <= DECODE_MAX_SEG_LEN else sgmv_shrink
    return shrink(x, A, meta, num_stack=num_stack, out=out)


@triton.jit
def _expand_decode_kernel(
    # pointers
    v_ptr,  # [T, num_stack * R]
    b_ptr,  # [num_slots, out_dim, R]
    y_ptr,  # [T, out_dim]
    seg_indptr_ptr,  # [num_segments + 1] int32
    weight_indices_ptr,  # [num_segments] int32
    lora_ranks_ptr,  # [num_slots] int32
    scalings_ptr,  # [num_slots] fp32
    # sizes
    max_rank,
    off0, size0, off1, size1, off2, size2,  # output slices (offset, size) of up to MAX_STACK targets
    # strides
    stride_vm, stride_vn,
    stride_bw, stride_bn, stride_br,
    stride_ym, stride_yn,
    # meta-parameters
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,  # >= R
):  # fmt: skip
    seg = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)  # stacked target
    slot = tl.load(weight_indices_ptr + seg)
    rank = tl.load(lora_ranks_ptr + slot)
    offset = tl.where(pid_k == 0, off0, tl.where(pid_k == 1, off1, off2))
    size = tl.where(pid_k == 0, size0, tl.where(pid_k == 1, size1, size2))
    if rank > 0 and pid_n * BLOCK_N < size:
        scaling = tl.load(scalings_ptr + slot)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        mask_n = offs_n < size
        mask_r = offs_r < rank
        b_ptrs = b_ptr + slot.to(tl.int64) * stride_bw + (offset + offs_n)[:, None] * stride_bn + offs_r[None, :] * stride_br
        b = tl.load(b_ptrs, mask=mask_n[:, None] & mask_r[None, :], other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_R]
        for row in range(tl.load(seg_indptr_ptr + seg), tl.load(seg_indptr_ptr + seg + 1)):
            vv = tl.load(v_ptr + row * stride_vm + (pid_k * max_rank + offs_r) * stride_vn, mask=mask_r, other=0.0)
            delta = tl.sum(b * vv.to(tl.float32)[None, :], axis=1) * scaling  # [BLOCK_N]
            y_ptrs = y_ptr + row * stride_ym + (offset + offs_n) * stride_yn
            y = tl.load(y_ptrs, mask=mask_n, other=0.0).to(tl.float32)
            tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask_n)


def sgmv_expand_decode(
    v: torch.Tensor,  # [T, num_stack * R]
    B: torch.Tensor,  # [num_slots, out_dim, R], v.dtype
    meta: SgmvMeta,
    y: torch.Tensor,  # [T, out_dim], updated in place
    *,
    output_slices: tuple[tuple[int, int], ...],  # ((offset, size), ...) one per stacked target
    block_n: int = 0,  # 0: chosen from the widest slice
) -> None:
    """y[seg, o_k : o_k + n_k] += scaling[w] * v[seg, k*R : k*R + r] @ B[w, o_k : o_k + n_k, :r]^T, one
    program per (segment, column block, target); see the module doc."""
    check_expand_args(v, B, meta, y, output_slices)
    if meta.num_segments == 0 or v.shape[0] == 0:
        return
    max_rank = B.shape[2]
    widest = max(size for _, size in output_slices)
    if widest == 0:
        return
    block_n = block_n or (256 if widest >= 4096 else 128)
    slices = [x for pair in output_slices for x in pair] + [0, 0] * (MAX_STACK - len(output_slices))
    _expand_decode_kernel[(meta.num_segments, triton.cdiv(widest, block_n), len(output_slices))](
        v, B, y, meta.seg_indptr, meta.weight_indices, meta.lora_ranks, meta.scalings,
        max_rank, *slices,
        v.stride(0), v.stride(1),
        B.stride(0), B.stride(1), B.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_N=block_n, BLOCK_R=max(triton.next_power_of_2(max_rank), 16), num_warps=4,
    )  # fmt: skip


def sgmv_expand_auto(
    v: torch.Tensor,  # [T, num_stack * R]
    B: torch.Tensor,  # [num_slots, out_dim, R], v.dtype
    meta: SgmvMeta,
    y: torch.Tensor,  # [T, out_dim], updated in place
    *,
    output_slices: tuple[tuple[int, int], ...],
) -> None:
    """The decode expand for steps whose segments hold at most DECODE_MAX_SEG_LEN tokens (a host int),
    `sgmv_expand` otherwise."""
    expand = sgmv_expand_decode if meta.max_seg_len <= DECODE_MAX_SEG_LEN else sgmv_expand
    expand(v, B, meta, y, output_slices=output_slices)
