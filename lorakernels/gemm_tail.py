"""LoRA expands done by the base GEMM: the shrink's output as extra input columns, B^T as extra weight rows.

For a projection y = x @ W^T with LoRA deltas per segment, the expand `scaling * v @ B^T` is a GEMM over
the rank: appended to the base GEMM's reduction dimension it costs that GEMM rank / in_dim more FLOPs
(16 / 4096 = 0.4% a slot at Llama-3-8B's widths) where a separate expand reads and writes all of y again:

    x_aug = [x | t]             [T, in + n * W]     t: the tail, W = num_stack * R columns a block
    W_aug = [W | B_0^T .. B_n]  [out, in + n * W]   block j: rows k*R .. k*R + R of projection k's B^T
    y     = x_aug @ W_aug^T     one cuBLAS GEMM, fp32 accumulate, one rounding

Tail block j of a row holds `scaling * v` of the row's slot where the slot owns block j (`slot_block`), in
projection k's columns below the slot's rank, and zeros everywhere else: a row of another adapter or of
none multiplies the block's B rows by 0. The weight rows live in the same allocation as W (stored
[in, out] row-major, EngineConfig.linear_weight_layout "in_out"), so W_aug is a view and so is x_aug's
head, which the kernel producing x writes in place (engine/lora_tail.py fills the blocks' B rows).

`place_lora_tail` writes the tail from the shrink's v on the segments' row blocks (lorakernels/sgmv.py
`segment_or_tail_block`, so a captured graph's padding rows get zeros too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorakernels.sgmv import SEGMENT_CHUNK, _check_meta, seg_and_tail_blocks, segment_or_tail_block
from lorakernels.sgmv_ref import SgmvMeta

PLACE_BLOCK_M = 32


@triton.jit
def _place_tail_kernel(
    v_ptr,  # [T, W] the shrink's output, or [T, n_blocks * W] every block's (BLOCKED_V); entries past a rank undefined
    tail_ptr,  # [T, n_blocks * W], row stride stride_t
    seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, scalings_ptr,
    slot_block_ptr,  # [num_slots] int32: the tail block a slot owns, -1 none
    num_segments, num_tokens, seg_blocks, n_blocks,
    stride_v, stride_t,
    R: tl.constexpr, WIDTH: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCKED_V: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    slot, rank, m_start, m_end = segment_or_tail_block(
        seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, num_segments, num_tokens, pid, seg_blocks, BLOCK_M, BLOCK_S
    )
    offs_m = m_start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < m_end
    offs_c = tl.arange(0, BLOCK_C)
    live_c = offs_c < WIDTH
    block = tl.where(rank > 0, tl.load(slot_block_ptr + slot), -1)
    scaling = tl.load(scalings_ptr + slot)
    rank = tl.where(block >= 0, rank, 0)  # a slot without a block contributes nothing
    keep = mask_m[:, None] & (live_c & (offs_c % R < rank))[None, :]
    if BLOCKED_V:  # the row's own block of an every-block shrink
        v_ptr += tl.maximum(block, 0) * WIDTH
    v = tl.load(v_ptr + offs_m[:, None].to(tl.int64) * stride_v + offs_c[None, :], mask=keep, other=0.0)
    val = (v.to(tl.float32) * scaling).to(tail_ptr.dtype.element_ty)
    rows = tail_ptr + offs_m[:, None].to(tl.int64) * stride_t + offs_c[None, :]
    store = mask_m[:, None] & live_c[None, :]
    for j in range(n_blocks):
        tl.store(rows + j * WIDTH, tl.where(j == block, val, 0.0), mask=store)


def place_lora_tail(
    v: torch.Tensor,  # [T, num_stack * R]: the shrink's output; or [T, n_blocks * num_stack * R], every block's
    meta: SgmvMeta,  # the target's ranks (a slot of rank 0 there gets zeros)
    slot_block: torch.Tensor,  # [num_slots] int32: the tail block each slot owns, -1 none
    tail: torch.Tensor,  # [T, n_blocks * num_stack * R], written whole; its rows may be strided (x_aug's)
    *,
    max_rank: int,
    num_stack: int,
) -> None:
    """tail[row, j*W + k*R + c] = scalings[w] * v[row, k*R + c] where the row's slot w owns block j and
    c < ranks[w], else 0, for every row of tail (padding rows past the segments included). A v as wide as
    the tail is every block's shrink (x @ A_j^T for each block's slot, one GEMM): a row takes its own
    block's columns, v[row, j*W + k*R + c]."""
    width = num_stack * max_rank
    num_tokens = v.shape[0]
    if tail.dim() != 2 or tail.shape[0] != num_tokens or width == 0 or tail.shape[1] % width or v.shape[1] not in (width, tail.shape[1]):
        raise ValueError(
            f"want v [T, {width}] or [T, blocks*{width}] and tail [T, blocks*{width}]; got {tuple(v.shape)}, {tuple(tail.shape)}"
        )
    if v.stride(1) != 1 or tail.stride(1) != 1 or slot_block.dtype != torch.int32:
        raise ValueError("v and tail need unit column strides and slot_block int32")
    _check_meta(meta, v.device)
    if num_tokens == 0 or tail.shape[1] == 0:
        return
    seg_blocks, tail_blocks = seg_and_tail_blocks(meta, num_tokens, PLACE_BLOCK_M)
    grid = (seg_blocks + tail_blocks,)
    _place_tail_kernel[grid](
        v, tail, meta.seg_indptr, meta.weight_indices, meta.lora_ranks, meta.scalings, slot_block,
        meta.num_segments, num_tokens, seg_blocks, tail.shape[1] // width, v.stride(0), tail.stride(0),
        R=max_rank, WIDTH=width, BLOCK_C=triton.next_power_of_2(width), BLOCK_M=PLACE_BLOCK_M, BLOCK_S=SEGMENT_CHUNK,
        BLOCKED_V=v.shape[1] != width,
    )  # fmt: skip


def place_lora_tail_ref(
    v: torch.Tensor, meta: SgmvMeta, slot_block: torch.Tensor, tail: torch.Tensor, *, max_rank: int, num_stack: int
) -> None:
    """The reference of `place_lora_tail` (PyTorch, host lists of meta)."""
    width = num_stack * max_rank
    tail.zero_()
    ranks, blocks = meta.lora_ranks.tolist(), slot_block.tolist()
    scalings = meta.scalings.tolist()
    bounds = meta.seg_indptr.tolist()
    for seg, slot in enumerate(meta.weight_indices.tolist()):
        rank, block = ranks[slot], blocks[slot]
        if rank <= 0 or block < 0:
            continue
        rows = slice(bounds[seg], bounds[seg + 1])
        cols = torch.arange(width, device=v.device) % max_rank < rank
        own = v[rows] if v.shape[1] == width else v[rows, block * width : (block + 1) * width]
        val = (own.float() * scalings[slot]).to(tail.dtype) * cols
        tail[rows, block * width : (block + 1) * width] = val
