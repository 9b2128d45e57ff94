"""Chunked SGMV backend: the same ops and signatures as lorakernels/sgmv.py over re-segmented metadata.

Before launching, the batch is re-segmented on the host from Python lists (`SgmvMeta.chunked`, see
`chunk_segments` in lorakernels/sgmv_ref.py): adjacent segments of one slot merge, runs of base-model rows
merge into one skipped gap, and segments longer than `chunk_size` split. Every program then works on at
most chunk_size rows of one adapter, so a skewed batch (one long prompt, many short decodes) keeps the
GPU evenly busy and the grid's M extent is cdiv(chunk_size, BLOCK_M). No GPU sync: the new metadata is
computed once per batch and per chunk size (cached on the SgmvMeta) and copied host-to-device.
"""

from __future__ import annotations

import torch

from lorakernels.sgmv import sgmv_expand, sgmv_shrink
from lorakernels.sgmv_ref import SgmvMeta

DEFAULT_CHUNK_SIZE = 16  # SGLang's default max_lora_chunk_size; one BLOCK_M=16 tile per program


def sgmv_shrink_chunked(
    x: torch.Tensor,  # [T, in_dim]
    A: torch.Tensor,  # [num_slots, num_stack * R, in_dim]
    meta: SgmvMeta,
    *,
    num_stack: int,
    out: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:  # v [T, num_stack * R], x.dtype
    """`sgmv_shrink` over the chunked segments of `meta`."""
    return sgmv_shrink(x, A, meta.chunked(chunk_size), num_stack=num_stack, out=out)


def sgmv_expand_chunked(
    v: torch.Tensor,  # [T, num_stack * R]
    B: torch.Tensor,  # [num_slots, out_dim, R]
    meta: SgmvMeta,
    y: torch.Tensor,  # [T, out_dim], updated in place
    *,
    output_slices: tuple[tuple[int, int], ...],
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> None:
    """`sgmv_expand` over the chunked segments of `meta`."""
    sgmv_expand(v, B, meta.chunked(chunk_size), y, output_slices=output_slices)
