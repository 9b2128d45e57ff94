"""A step's LoRA inputs for the model: the slot pool's buffers, this step's segments, the SGMV ops.

Each fused projection adds its LoRA delta in place, with one shrink per input for all its stacked
targets and one expand:

    y[T, out] += scalings[slot] * (x[T, in] @ A[slot]^T) @ B[slot]^T     per segment of tokens
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.lora_pool import LoraSlotPool
from kernels.sgmv_ref import SgmvMeta, sgmv_expand_ref, sgmv_shrink_ref


def sgmv_ops(backend: str) -> tuple[Callable, Callable]:
    """(shrink, expand) of a backend: 'ref' (PyTorch, the CPU default), 'triton', or 'chunked'."""
    if backend == "ref":
        return sgmv_shrink_ref, sgmv_expand_ref
    if backend == "triton":
        from kernels.sgmv import sgmv_expand, sgmv_shrink

        return sgmv_shrink, sgmv_expand
    if backend == "chunked":
        from kernels.sgmv_chunked import sgmv_expand_chunked, sgmv_shrink_chunked

        return sgmv_shrink_chunked, sgmv_expand_chunked
    raise ValueError(f"lora backend must be 'ref', 'triton' or 'chunked', not {backend!r}")


@dataclass
class LoraInputs:
    pool: LoraSlotPool
    meta: SgmvMeta
    shrink: Callable
    expand: Callable

    def add(self, target: str, layer: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += the LoRA delta of fused target `target` in `layer` for input x (x: [T, in], y: [T, out])."""
        t = self.pool.targets[target]
        v = self.shrink(x, self.pool.a[target][layer], self.meta, num_stack=t.num_stack)  # [T, stack * R]
        self.expand(v, self.pool.b[target][layer], self.meta, y, output_slices=t.output_slices)
