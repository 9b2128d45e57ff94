"""SiLU of the gate times the up projection, read straight from the fused gate_up output, in Triton.

Semantics, rounding where `F.silu(gate) * up` rounds in PyTorch (engine/models/blocks.py's MLP):

    g = round(gate_up + delta)                   delta given (a LoRA delta still to add); else g = gate_up
    gate, up = g[:, :I], g[:, I:]
    out = round(round(silu(gate)) * up)          silu(g) = g / (1 + exp(-g)) in fp32

    gate_up, delta [T, 2 * I] fp16/bf16/fp32 (rows contiguous); out [T, I] gate_up.dtype

Grid (T, cdiv(I, BLOCK)): one row slice per program; the PyTorch version reads gate_up, writes silu(gate),
reads it back with up and writes the product, three passes where this is one.

`silu_mul_expand` is the same with a prefill-sized step's LoRA expand of gate/up done as the tiles are
loaded, instead of `sgmv_expand` reading and writing all of gate_up first (at 8k tokens of Llama-3-8B
that is 0.94 GB a layer):

    g[seg, :] = round(gate_up[seg, :] + scalings[w] * v[seg, k*R : k*R + r] @ B[w, :, :r]^T)   k = gate, up

rounded once, as `sgmv_expand` rounds y (lorakernels/sgmv.py); the SiLU-mul of g then as above. Its grid
walks segment-aligned row blocks (lorakernels/sgmv.py's `row_block`, found on the device, so one launch
covers any segmentation and CUDA graphs replay it) and then the rows past the last segment (a graph's
padding), which get no LoRA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorakernels import pdl
from lorakernels.pdl import wait_for_producer
from lorakernels.pending_delta import load_plus_delta, output_like
from lorakernels.sgmv import (
    SEGMENT_CHUNK,
    block_m_for,
    check_expand_args,
    seg_and_tail_blocks,
    segment_or_tail_block,
)
from lorakernels.sgmv_ref import SgmvMeta

BLOCK = 1024
# silu_mul_expand loads a row block's whole v and a column block's whole B (no loop over the rank): up to
# this rank capacity (the default max LoRA rank); larger pools expand first (engine/lora_inputs.py)
FUSED_MAX_RANK = 64


@triton.jit
def _silu_mul_kernel(
    # pointers
    gate_up_ptr,  # [T, 2 * I]
    delta_ptr,  # [T, 2 * I] (unused without HAS_DELTA)
    out_ptr,  # [T, I]
    # sizes
    I,  # noqa: E741 (the intermediate size)
    # strides
    stride_g, stride_d, stride_o,
    # meta-parameters
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # lorakernels/pdl.py: wait for the previous grid first
):  # fmt: skip
    if USE_PDL:
        wait_for_producer()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    src, d = gate_up_ptr + row * stride_g, delta_ptr + row * stride_d
    gate = load_plus_delta(src, d, offs, mask, HAS_DELTA).to(tl.float32)
    up = load_plus_delta(src + I, d + I, offs, mask, HAS_DELTA).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    tl.store(
        out_ptr + row * stride_o + offs, (silu.to(tl.float32) * up).to(out_ptr.dtype.element_ty), mask=mask
    )


def silu_mul(
    gate_up: torch.Tensor, delta: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
    """silu(g[:, :I]) * g[:, I:] of g = gate_up (+ delta, a LoRA delta still to add); see the module doc.
    out: [T, I] with contiguous rows (another tensor's columns, say), or None: a new tensor."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"want gate_up [T, 2 * I] with contiguous rows, got {tuple(gate_up.shape)}")
    if delta is not None and (delta.shape != gate_up.shape or delta.dtype != gate_up.dtype or delta.stride(1) != 1):
        raise ValueError(f"delta {tuple(delta.shape)} {delta.dtype} is not gate_up's {tuple(gate_up.shape)} {gate_up.dtype} with contiguous rows")
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = output_like(gate_up[:, :inter], out)
    if num_tokens == 0 or inter == 0:
        return out
    d = gate_up if delta is None else delta
    grid = (num_tokens, triton.cdiv(inter, BLOCK))
    _silu_mul_kernel[grid](
        gate_up, d, out, inter, gate_up.stride(0), d.stride(0), out.stride(0),
        HAS_DELTA=delta is not None, BLOCK=BLOCK, num_warps=4, **pdl.launch(gate_up.device),
    )  # fmt: skip
    return out


@triton.jit
def _silu_mul_expand_kernel(
    # pointers
    gate_up_ptr,  # [T, 2 * I]
    v_ptr,  # [T, 2 * R]: gate's shrink, then up's
    b_ptr,  # [num_slots, 2 * I, R]: gate's rows, then up's
    out_ptr,  # [T, I]
    seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, scalings_ptr,
    # sizes
    num_tokens,
    I,  # noqa: E741 (the intermediate size)
    max_rank,  # R
    num_segments,
    seg_blocks,  # row programs for the segments; the rest take the rows after the last segment
    # strides
    stride_g, stride_v, stride_bw, stride_bn, stride_bk, stride_o,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # lorakernels/pdl.py: wait for the previous grid first
):  # fmt: skip
    if USE_PDL:
        wait_for_producer()
    pid_n = tl.program_id(1)
    # a segment's row block, or rows no segment covers (a graph's padding): the SiLU-mul alone
    slot, rank, m_start, m_end = segment_or_tail_block(
        seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, num_segments, num_tokens, tl.program_id(0), seg_blocks, BLOCK_M, BLOCK_S
    )  # fmt: skip
    if m_start >= m_end:
        return
    offs_m = (m_start + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < m_end
    mask_n = offs_n < I
    mask = mask_m[:, None] & mask_n[None, :]
    g_ptrs = gate_up_ptr + offs_m[:, None] * stride_g + offs_n[None, :]
    gate = tl.load(g_ptrs, mask=mask, other=0.0)
    up = tl.load(g_ptrs + I, mask=mask, other=0.0)
    if rank > 0:
        scaling = tl.load(scalings_ptr + slot)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank  # v past the rank is not written by the shrink
        v_ptrs = v_ptr + offs_m[:, None] * stride_v + offs_r[None, :]
        v_mask = mask_m[:, None] & mask_r[None, :]
        b_ptrs = b_ptr + slot.to(tl.int64) * stride_bw + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_bk
        b_mask = mask_r[:, None] & mask_n[None, :]
        v_gate = tl.load(v_ptrs, mask=v_mask, other=0.0)
        v_up = tl.load(v_ptrs + max_rank, mask=v_mask, other=0.0)
        b_gate = tl.load(b_ptrs, mask=b_mask, other=0.0)  # [BLOCK_R, BLOCK_N]: B^T
        b_up = tl.load(b_ptrs + I * stride_bn, mask=b_mask, other=0.0)
        if UPCAST_DOT:
            v_gate, v_up = v_gate.to(tl.float32), v_up.to(tl.float32)
            b_gate, b_up = b_gate.to(tl.float32), b_up.to(tl.float32)
        d_gate = tl.dot(v_gate, b_gate, input_precision=INPUT_PRECISION)
        d_up = tl.dot(v_up, b_up, input_precision=INPUT_PRECISION)
        gate = (gate.to(tl.float32) + scaling * d_gate).to(out_ptr.dtype.element_ty)
        up = (up.to(tl.float32) + scaling * d_up).to(out_ptr.dtype.element_ty)
    gate32 = gate.to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(out_ptr.dtype.element_ty)
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None] * stride_o + offs_n[None, :], out, mask=mask)


def silu_mul_expand(
    gate_up: torch.Tensor,  # [T, 2 * I]
    v: torch.Tensor,  # [T, 2 * R], the gate/up shrink's output
    B: torch.Tensor,  # [num_slots, 2 * I, R], v.dtype
    meta: SgmvMeta,
    *,
    output_slices: tuple[tuple[int, int], ...] | None = None,  # the projection's; must be gate's, then up's
    out: torch.Tensor | None = None,  # as silu_mul's
) -> torch.Tensor:  # [T, I]
    """silu_mul(gate_up after `sgmv_expand(v, B, meta, gate_up, output_slices=((0, I), (I, I)))`), in one
    kernel that leaves gate_up as it was; see the module doc. Ranks up to FUSED_MAX_RANK."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"want gate_up [T, 2 * I] with contiguous rows, got {tuple(gate_up.shape)}")
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    slices = ((0, inter), (inter, inter))
    if output_slices is not None and tuple(output_slices) != slices:
        raise ValueError(f"output_slices {output_slices} are not gate's then up's halves {slices}")
    check_expand_args(v, B, meta, gate_up, slices)
    if B.shape[2] > FUSED_MAX_RANK:
        raise ValueError(f"rank capacity {B.shape[2]} > {FUSED_MAX_RANK}: expand first, then silu_mul")
    if v.stride(1) != 1 or B.dtype != gate_up.dtype:
        raise ValueError(f"want v with contiguous rows and B in gate_up's dtype {gate_up.dtype}, got {B.dtype}")
    out = output_like(gate_up[:, :inter], out)
    if num_tokens and inter:
        launch_silu_mul_expand(gate_up, v, B, meta, out, block_m=block_m_for(meta.max_seg_len))
    return out


def launch_silu_mul_expand(
    gate_up: torch.Tensor, v: torch.Tensor, B: torch.Tensor, meta: SgmvMeta, out: torch.Tensor,
    *, block_m: int, block_n: int = 64, num_warps: int = 4,
) -> None:  # fmt: skip
    """The kernel's launch over checked, non-empty inputs (`silu_mul_expand`; the tile sizes are the
    benchmark's to vary, benchmarks/silu_mul_expand.py)."""
    num_tokens, inter = out.shape
    seg_blocks, tail_blocks = seg_and_tail_blocks(meta, num_tokens, block_m)
    grid = (seg_blocks + tail_blocks, triton.cdiv(inter, block_n))
    _silu_mul_expand_kernel[grid](
        gate_up, v, B, out,
        meta.seg_indptr, meta.weight_indices, meta.lora_ranks, meta.scalings,
        num_tokens, inter, B.shape[2], meta.num_segments, seg_blocks,
        gate_up.stride(0), v.stride(0), B.stride(0), B.stride(1), B.stride(2), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(B.shape[2])),
        BLOCK_S=SEGMENT_CHUNK,
        INPUT_PRECISION="ieee",  # as lorakernels/sgmv.py: fp32 operands exact, no TF32
        UPCAST_DOT=gate_up.device.type == "cpu" and gate_up.dtype == torch.bfloat16,
        num_warps=num_warps, **pdl.launch(gate_up.device),
    )  # fmt: skip


def silu_mul_ref(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
    """The same in PyTorch (the CPU path): what the MLP computes today."""
    if delta is not None:
        gate_up = gate_up + delta
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
