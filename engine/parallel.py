"""Tensor parallelism: the rank's place in the group, its collectives, and the parallel linears.

A linear is column-parallel (each rank holds a slice of the output features: q/k/v, gate/up) or
row-parallel (each rank holds a slice of the input features: o, down). A row-parallel output is a
partial sum: the caller adds its LoRA delta to it and then `all_reduce`s (exact by linearity).
With one rank every collective is the identity and no process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; the identity with one rank."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def shard(self, size: int, what: str) -> int:
        """This rank's share of `size` (heads, KV heads, features); refuses what does not divide."""
        if size % self.size:
            raise ValueError(f"--tensor-parallel-size {self.size} does not divide {what} ({size})")
        return size // self.size

    def part(self, size: int) -> slice:
        """This rank's slice of a dimension of `size` split in equal parts."""
        share = size // self.size
        return slice(self.rank * share, (self.rank + 1) * share)


SINGLE = TensorParallel()


class ColumnParallelLinear(nn.Module):
    """y[T, sum(out_i) / N] = x[T, in] @ W_rank^T + b_rank: each fused part's output features split
    across ranks, this rank's slices of every part stacked (e.g. q_r, k_r, v_r)."""

    def __init__(self, in_features: int, out_parts: tuple[int, ...], bias: bool, tp: TensorParallel = SINGLE, **factory):
        super().__init__()
        self.tp, self.out_parts = tp, out_parts
        local = sum(tp.shard(size, "a projection's output features") for size in out_parts)
        self.weight = nn.Parameter(torch.empty(local, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(local, **factory)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    def shard_full(self, full: torch.Tensor) -> torch.Tensor:
        """The full fused tensor [sum(out_parts), ...] (parts stacked) -> this rank's rows."""
        parts = full.split(list(self.out_parts), dim=0)
        return torch.cat([p[self.tp.part(p.shape[0])] for p in parts])


class RowParallelLinear(nn.Module):
    """Partial y[T, out] = x[T, in / N] @ W_rank^T (+ b on rank 0 only, so the sum holds it once);
    the caller all-reduces after adding any LoRA delta."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE, **factory):
        super().__init__()
        self.tp = tp
        local_in = tp.shard(in_features, "a projection's input features")
        self.weight = nn.Parameter(torch.empty(out_features, local_in, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp.rank == 0 else None
        return nn.functional.linear(x, self.weight, bias)

    def shard_full(self, full: torch.Tensor) -> torch.Tensor:
        """The full weight [out, in] -> this rank's columns; a bias [out] stays whole."""
        return full if full.dim() == 1 else full[:, self.tp.part(full.shape[1])]


def local_config(config, tp: TensorParallel):
    """The rank's view of a model config: heads, KV heads and MLP features divided by the group size.

    Refuses, with the number that does not divide, a size that does not split heads, KV heads or the
    MLP evenly (KV heads are not replicated: a group larger than the KV heads is refused too).
    """
    from dataclasses import replace

    if tp.size == 1:
        return config
    return replace(
        config,
        num_heads=tp.shard(config.num_heads, "the attention heads"),
        num_kv_heads=tp.shard(config.num_kv_heads, "the KV heads (replicating KV heads is not supported)"),
        intermediate_size=tp.shard(config.intermediate_size, "the MLP's intermediate size"),
    )
