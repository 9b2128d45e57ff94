"""SiLU of the gate times the up projection, read straight from the fused gate_up output, in Triton.

Semantics, rounding where `F.silu(gate) * up` rounds in PyTorch (engine/models/blocks.py's MLP):

    g = round(gate_up + delta)                   delta given (a LoRA delta still to add); else g = gate_up
    gate, up = g[:, :I], g[:, I:]
    out = round(round(silu(gate)) * up)          silu(g) = g / (1 + exp(-g)) in fp32

    gate_up, delta [T, 2 * I] fp16/bf16/fp32 (rows contiguous); out [T, I] gate_up.dtype

Grid (T, cdiv(I, BLOCK)): one row slice per program; the PyTorch version reads gate_up, writes silu(gate),
reads it back with up and writes the product, three passes where this is one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pending_delta import load_plus_delta

BLOCK = 1024


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
):  # fmt: skip
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


def silu_mul(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
    """silu(g[:, :I]) * g[:, I:] of g = gate_up (+ delta, a LoRA delta still to add); see the module doc."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"want gate_up [T, 2 * I] with contiguous rows, got {tuple(gate_up.shape)}")
    if delta is not None and (delta.shape != gate_up.shape or delta.dtype != gate_up.dtype or delta.stride(1) != 1):
        raise ValueError(f"delta {tuple(delta.shape)} {delta.dtype} is not gate_up's {tuple(gate_up.shape)} {gate_up.dtype} with contiguous rows")
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0 or inter == 0:
        return out
    d = gate_up if delta is None else delta
    grid = (num_tokens, triton.cdiv(inter, BLOCK))
    _silu_mul_kernel[grid](
        gate_up, d, out, inter, gate_up.stride(0), d.stride(0), out.stride(0),
        HAS_DELTA=delta is not None, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
    return out


def silu_mul_ref(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
    """The same in PyTorch (the CPU path): what the MLP computes today."""
    if delta is not None:
        gate_up = gate_up + delta
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
