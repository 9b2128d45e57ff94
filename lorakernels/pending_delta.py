"""The load every fused kernel that takes a pending LoRA delta shares (lorakernels/rope_kv.py, silu_mul.py,
rmsnorm.py): a CUDA decode step computes each projection's delta beside its base GEMM and hands it to
the kernel that reads the projection's output next (engine/lora_inputs.py, `project_deferred`).
"""

from __future__ import annotations

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
