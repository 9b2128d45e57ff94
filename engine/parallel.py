"""Tensor parallelism: the rank's place in the group, its collectives, and the parallel linears.

A linear is column-parallel (each rank holds a slice of the output features: q/k/v, gate/up) or
row-parallel (each rank holds a slice of the input features: o, down). A row-parallel output is a
partial sum: the caller adds its LoRA delta to it and then `all_reduce`s (exact by linearity).
With one rank every collective is the identity and no process group exists. On CUDA, decode-size
all-reduces take a one-shot path over peer memory (`PeerAllReduce`), and a row-parallel linear writes its
partial sum straight into that path's staging buffer; the rest go to NCCL.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # Set by a CUDA worker once its group exists (never pickled to a rank: each builds its own).
    peer: PeerAllReduce | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks and return the sum: in place, or (x in the peer path's staging buffer, see
        `partial_sum_out`) a new tensor; the identity with one rank. Every rank takes the same path for
        the same tensor (the choice depends only on its shape and dtype, which the ranks share)."""
        if self.size > 1:
            if self.peer is not None and self.peer.fits(x):
                return self.peer(x)
            dist.all_reduce(x)
        return x

    def partial_sum_out(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Where a row-parallel linear writes a [rows, cols] partial sum that `all_reduce` will take next:
        the peer path's staging buffer when the sum takes that path (which then copies nothing into it),
        else None (the linear allocates its output). Nothing may all-reduce in between."""
        return self.peer.staging(rows, cols, dtype) if self.size > 1 and self.peer is not None else None

    def agree_on_min(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's value (collective: every rank calls it at the same point)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place; the identity with one rank."""
        if self.size > 1:
            dist.broadcast(x, src=0)
        return x

    def with_peer_all_reduce(self, device: torch.device) -> TensorParallel:
        """This group with the one-shot peer all-reduce on, where every rank can run it; else unchanged.

        Collective: every rank calls it at the same point after the group exists. The ranks first agree
        that all of them have the op (a rank without it would wait in NCCL while the others wait on
        its signal pads), then map one buffer each into every peer's address space."""
        if self.size == 1 or device.type != "cuda":
            return self
        if not self.agree_on_min(int(PeerAllReduce.available(device)), device):
            log.warning("the one-shot peer all-reduce is not available on every rank; all-reduces go to NCCL")
            return self
        return replace(self, peer=PeerAllReduce(device))

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


class PeerAllReduce:
    """A one-shot all-reduce for decode-size tensors over NVLink, without NCCL's ring.

    Each rank owns a buffer in symmetric memory (mapped into every peer's address space). To reduce x,
    a rank copies x into its buffer (unless x was computed there: `staging`); then one kernel
    (PyTorch's `symm_mem.one_shot_all_reduce_out`) waits on a barrier of signal pads until every rank
    has done so, reads the same range of every peer's buffer, sums and writes the result over x (or,
    for x in the buffer, into a new tensor), and passes a second barrier before any rank may refill
    its buffer. It needs no multicast (NVLS) and is captured into CUDA graphs like any kernel:
    the barrier's flags return to zero on every pass. Tensors larger than the buffer (prefill) go to
    NCCL, whose ring is faster once the transfer, not the latency, dominates.
    """

    MAX_BYTES = 8 << 20  # 512 tokens of an 8192-wide bf16 hidden state
    DTYPES = (torch.bfloat16, torch.float32)  # what the kernel is built for

    def __init__(self, device: torch.device, max_bytes: int = MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        self.group = dist.group.WORLD.group_name
        with warnings.catch_warnings():  # required by older PyTorch; deprecated (a no-op) in newer ones
            warnings.simplefilter("ignore")
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(self.group)
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group)

    @staticmethod
    def available(device: torch.device) -> bool:
        return hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out") and torch.cuda.get_device_capability(device) >= (8, 0)

    def fits(self, x: torch.Tensor) -> bool:
        return x.is_contiguous() and self._holds(x.numel(), x.dtype)

    def staging(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The first rows * cols elements of this rank's buffer as a [rows, cols] tensor, where they fit."""
        if not self._holds(rows * cols, dtype):
            return None
        return self.buffer.view(dtype)[: rows * cols].view(rows, cols)

    def _holds(self, numel: int, dtype: torch.dtype) -> bool:
        return dtype in self.DTYPES and numel * dtype.itemsize <= self.buffer.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks: over x itself, or a new tensor when x already lies in the buffer (the
        sum must not be written there while peers read it)."""
        flat = x.view(-1)
        staged = self.buffer.view(x.dtype)[: flat.numel()]
        if x.data_ptr() == staged.data_ptr():
            out = torch.empty_like(x)
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group, out=out.view(-1))
            return out
        staged.copy_(flat)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group, out=flat)
        return x


class ColumnParallelLinear(nn.Module):
    """y[T, sum(out_i) / N] = x[T, in] @ W_rank^T + b_rank: each fused part's output features split
    across ranks, this rank's slices of every part stacked (e.g. q_r, k_r, v_r)."""

    tuned_gemms = None  # engine/carved_gemms.py CarvedGemms, where the model runner tuned the decode GEMMs

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

    tuned_gemms = None  # engine/carved_gemms.py CarvedGemms, where the model runner tuned the decode GEMMs

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE, **factory):
        super().__init__()
        self.tp = tp
        local_in = tp.shard(in_features, "a projection's input features")
        self.weight = nn.Parameter(torch.empty(out_features, local_in, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in / N]
        bias = self.bias if self.tp.rank == 0 else None
        out = self.tp.partial_sum_out(x.shape[0], self.weight.shape[0], x.dtype) if x.dim() == 2 else None
        if out is None:
            return nn.functional.linear(x, self.weight, bias)
        if bias is None:  # straight into the peer all-reduce's buffer: no copy there before the sum
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(bias, x, self.weight.t(), out=out)

    def shard_full(self, full: torch.Tensor) -> torch.Tensor:
        """The full weight [out, in] -> this rank's columns; a bias [out] stays whole."""
        return full if full.dim() == 1 else full[:, self.tp.part(full.shape[1])]


def local_config(config, tp: TensorParallel):
    """The rank's view of a model config: heads, KV heads and MLP features divided by the group size.

    Refuses, with the number that does not divide, a size that does not split heads, KV heads or the
    MLP evenly (KV heads are not replicated: a group larger than the KV heads is refused too).
    """
    if tp.size == 1:
        return config
    return replace(
        config,
        num_heads=tp.shard(config.num_heads, "the attention heads"),
        num_kv_heads=tp.shard(config.num_kv_heads, "the KV heads (replicating KV heads is not supported)"),
        intermediate_size=tp.shard(config.intermediate_size, "the MLP's intermediate size"),
    )
