"""The load every fused kernel that takes a pending LoRA delta shares (lorakernels/rope_kv.py, silu_mul.py,
rmsnorm.py): a CUDA decode step computes each projection's delta beside its base GEMM and hands it to
the kernel that reads the projection's output next (engine/lora_inputs.py, `project_deferred`); and
the output those kernels write, which may be a view into a wider tensor (`output_like`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def load_plus_delta(src_ptr, delta_ptr, offs, mask, HAS_DELTA: tl.constexpr):
    """src[offs], plus delta[offs] rounded once to src's dtype (what `y + delta` in PyTorch gives)."""
    u = tl.load(src_ptr + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + offs, mask=mask, other=0.0)
        u = (u.to(tl.float32) + d.to(tl.float32)).to(src_ptr.dtype.element_ty)
    return u


def output_like(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`out`, checked to take x's shape and dtype with contiguous rows (it may be a view into a wider
    tensor: the LoRA tail's x_aug, lorakernels/gemm_tail.py), or a new tensor like x."""
    if out is None:
        return torch.empty_like(x)
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or (out.numel() and out.stride(-1) != 1):
        raise ValueError(f"out must be {tuple(x.shape)} {x.dtype} with contiguous rows, got {tuple(out.shape)} {out.dtype}")
    return out
