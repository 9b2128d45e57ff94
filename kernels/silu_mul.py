"""SiLU of the gate times the up projection, read straight from the fused gate_up output, in Triton.

Semantics, rounding where `F.silu(gate) * up` rounds in PyTorch (engine/models/blocks.py's MLP):

    gate, up = gate_up[:, :I], gate_up[:, I:]
    out = round(round(silu(gate)) * up)          silu(g) = g / (1 + exp(-g)) in fp32

    gate_up [T, 2 * I] fp16/bf16/fp32 (rows contiguous); out [T, I] gate_up.dtype

Grid (T, cdiv(I, BLOCK)): one row slice per program; the PyTorch version reads gate_up, writes silu(gate),
reads it back with up and writes the product, three passes where this is one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(
    # pointers
    gate_up_ptr,  # [T, 2 * I]
    out_ptr,  # [T, I]
    # sizes
    I,  # noqa: E741 (the intermediate size)
    # strides
    stride_g, stride_o,
    # meta-parameters
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(gate_up_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_g + I + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    tl.store(
        out_ptr + row * stride_o + offs, (silu.to(tl.float32) * up).to(out_ptr.dtype.element_ty), mask=mask
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
    """silu(gate_up[:, :I]) * gate_up[:, I:]; see the module doc."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"want gate_up [T, 2 * I] with contiguous rows, got {tuple(gate_up.shape)}")
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0 or inter == 0:
        return out
    grid = (num_tokens, triton.cdiv(inter, BLOCK))
    _silu_mul_kernel[grid](gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4)
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
    """The same in PyTorch (the CPU path): what the MLP computes today."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
