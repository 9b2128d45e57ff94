"""SGMV batch metadata and the pure-PyTorch reference of the two LoRA ops (used on CPU).

Tokens are token-major and grouped into segments; segment s owns rows seg_indptr[s] : seg_indptr[s+1]
(empty segments allowed) and uses slot w = weight_indices[s], whose rank is r = lora_ranks[w] and whose
scaling is scalings[w]. A slot of rank 0 (an empty slot, or the base model) contributes nothing. R is
max_rank, the rank capacity of every slot; stacked target k (q/k/v, gate/up) owns A rows k*R : k*R + r.

    shrink:  v[seg, k*R : k*R + r]   = x[seg] @ A[w, k*R : k*R + r, :]^T                (fp32 accumulate)
    expand:  y[seg, o_k : o_k + n_k] += scalings[w] * v[seg, k*R : k*R + r] @ B[w, o_k : o_k + n_k, :r]^T

    x [T, in_dim]   A [num_slots, num_stack * R, in_dim]   v [T, num_stack * R], dtype of x
    y [T, out_dim]  B [num_slots, out_dim, R]              output_slices ((o_0, n_0), ...) one per target

Contract on v: shrink writes exactly the entries above. Every other entry of v (columns r..R-1 of each
target, rows of rank-0 segments, rows in no segment) is left as it was: unspecified when shrink allocates
v, untouched when the caller passes `out`. expand never reads those entries, so a v filled with NaN there
is harmless. expand rounds once: y = round(y + scaling * acc) with acc in fp32.

Running example: seg_lens [3, 0, 2, 4], slots [1, 2, 0, 2], ranks [0, 8, 16] (slot 0 = base model) give
seg_indptr [0, 3, 3, 5, 9] and weight_indices [1, 2, 0, 2]: rows 0..2 use slot 1 (r = 8), segment 1 is
empty, rows 3..4 are base-model rows (rank 0: skipped), rows 5..8 use slot 2 (r = 16).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SgmvMeta:
    """Per-step LoRA batch metadata (device tensors plus the host facts the grid needs).

    `max_seg_len` and `num_segments` are host ints, so launching never syncs with the GPU. The host
    lists the tensors were built from are kept (when known) so the chunked backend can re-segment on
    the CPU; `chunked()` results are cached per chunk size.
    """

    seg_indptr: torch.Tensor  # [num_segments + 1] int32, non-decreasing, seg_indptr[0] == 0
    weight_indices: torch.Tensor  # [num_segments] int32: segment -> slot
    lora_ranks: torch.Tensor  # [num_slots] int32: 0 = no LoRA
    scalings: torch.Tensor  # [num_slots] fp32
    max_seg_len: int  # host: upper bound of seg_indptr[s+1] - seg_indptr[s]
    num_segments: int  # host
    host_seg_lens: tuple[int, ...] | None = None
    host_slots: tuple[int, ...] | None = None
    host_ranks: tuple[int, ...] | None = None
    _chunked: dict[int, SgmvMeta] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_lists(
        cls,
        seg_lens: list[int],
        slots: list[int],
        ranks: list[int],
        scalings: list[float],
        device: torch.device | str = "cpu",
    ) -> SgmvMeta:
        """Build the metadata from Python lists (no GPU sync: one host-to-device copy per tensor)."""
        if len(seg_lens) != len(slots) or len(ranks) != len(scalings):
            raise ValueError("seg_lens/slots and ranks/scalings must have equal lengths")
        if any(n < 0 for n in seg_lens) or any(r < 0 for r in ranks):
            raise ValueError("segment lengths and ranks must be >= 0")
        if any(not 0 <= w < len(ranks) for w in slots):
            raise ValueError(f"slot index out of range 0..{len(ranks) - 1}: {slots}")
        indptr = [0]
        for n in seg_lens:
            indptr.append(indptr[-1] + n)

        def as_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            seg_indptr=as_tensor(indptr, torch.int32),
            weight_indices=as_tensor(list(slots), torch.int32),
            lora_ranks=as_tensor(list(ranks), torch.int32),
            scalings=as_tensor(list(scalings), torch.float32),
            max_seg_len=max(seg_lens, default=0),
            num_segments=len(seg_lens),
            host_seg_lens=tuple(seg_lens),
            host_slots=tuple(slots),
            host_ranks=tuple(ranks),
        )

    def chunked(self, chunk_size: int) -> SgmvMeta:
        """This batch re-segmented for the chunked backend; see `chunk_segments`. Cached per chunk size."""
        if chunk_size not in self._chunked:
            if self.host_seg_lens is None or self.host_slots is None or self.host_ranks is None:
                raise ValueError("chunked() needs the host lists: build the metadata with from_lists")
            seg_lens, slots = chunk_segments(self.host_seg_lens, self.host_slots, self.host_ranks, chunk_size)
            indptr = [0]
            for n in seg_lens:
                indptr.append(indptr[-1] + n)
            device = self.seg_indptr.device
            self._chunked[chunk_size] = SgmvMeta(
                seg_indptr=torch.tensor(indptr, dtype=torch.int32).to(device, non_blocking=True),
                weight_indices=torch.tensor(slots, dtype=torch.int32).to(device, non_blocking=True),
                lora_ranks=self.lora_ranks,  # slot tables are shared, not copied
                scalings=self.scalings,
                max_seg_len=max(seg_lens, default=0),
                num_segments=len(seg_lens),
            )
        return self._chunked[chunk_size]


def chunk_segments(
    seg_lens: tuple[int, ...] | list[int],
    slots: tuple[int, ...] | list[int],
    ranks: tuple[int, ...] | list[int],
    chunk_size: int,
) -> tuple[list[int], list[int]]:
    """Re-segment a batch for the chunked backend, on the host, from Python lists.

    1. Merge: empty segments are dropped; adjacent segments with the same slot become one.
    2. Split: a segment longer than chunk_size becomes ceil(len / chunk_size) chunks.
    Every program then gets at most chunk_size rows of one adapter: balanced work, no tiny launches.

    seg_indptr is a prefix sum, so rows of rank-0 (base-model) segments keep a place: each run of them
    becomes one unsplit gap segment pointing at its rank-0 slot, which the kernels skip at once.
    Example (chunk 4): lens [3, 2, 0, 6, 1], slots [1, 1, 2, 0, 2], ranks [0, 8, 8] ->
    lens [4, 1, 6, 1], slots [1, 1, 0, 2]  (the 6 base-model rows form one skipped gap).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    merged_lens: list[int] = []
    merged_slots: list[int] = []
    for n, w in zip(seg_lens, slots, strict=True):
        if n == 0:
            continue
        if merged_slots and _merge_key(merged_slots[-1], ranks) == _merge_key(w, ranks):
            merged_lens[-1] += n
        else:
            merged_lens.append(n)
            merged_slots.append(w)
    out_lens: list[int] = []
    out_slots: list[int] = []
    for n, w in zip(merged_lens, merged_slots, strict=True):
        step = chunk_size if ranks[w] > 0 else n  # a skipped gap need not be split
        for start in range(0, n, step):
            out_lens.append(min(step, n - start))
            out_slots.append(w)
    return out_lens, out_slots


def _merge_key(slot: int, ranks: tuple[int, ...] | list[int]) -> int:
    """Adjacent segments merge when keys match: same slot, or both without LoRA (rank 0)."""
    return slot if ranks[slot] > 0 else -1


def sgmv_shrink_ref(
    x: torch.Tensor,  # [T, in_dim]
    A: torch.Tensor,  # [num_slots, num_stack * R, in_dim]
    meta: SgmvMeta,
    *,
    num_stack: int,
    out: torch.Tensor | None = None,  # [T, num_stack * R], x.dtype
) -> torch.Tensor:  # v [T, num_stack * R], x.dtype
    """v[seg, k*R : k*R + r] = x[seg] @ A[w, k*R : k*R + r, :]^T; see the module doc for the contract."""
    max_rank = A.shape[1] // num_stack
    v = torch.zeros(x.shape[0], A.shape[1], dtype=x.dtype, device=x.device) if out is None else out
    for start, end, w, rank, _ in _segments(meta):
        xs = x[start:end].float()
        for k in range(num_stack):
            cols = slice(k * max_rank, k * max_rank + rank)
            v[start:end, cols] = (xs @ A[w, cols].float().T).to(v.dtype)
    return v


def sgmv_expand_ref(
    v: torch.Tensor,  # [T, num_stack * R]
    B: torch.Tensor,  # [num_slots, out_dim, R]
    meta: SgmvMeta,
    y: torch.Tensor,  # [T, out_dim], updated in place
    *,
    output_slices: tuple[tuple[int, int], ...],  # ((offset, size), ...) one per stacked target
) -> None:
    """y[seg, o_k : o_k + n_k] += scaling[w] * v[seg, k*R : k*R + r] @ B[w, o_k : o_k + n_k, :r]^T."""
    max_rank = B.shape[2]
    for start, end, w, rank, scaling in _segments(meta):
        for k, (offset, size) in enumerate(output_slices):
            vs = v[start:end, k * max_rank : k * max_rank + rank].float()
            delta = vs @ B[w, offset : offset + size, :rank].float().T
            cols = slice(offset, offset + size)
            y[start:end, cols] = (y[start:end, cols].float() + scaling * delta).to(y.dtype)


def _segments(meta: SgmvMeta):
    """(start, end, slot, rank, scaling) of each non-empty segment with a LoRA (rank > 0)."""
    indptr = meta.seg_indptr.tolist()
    ranks = meta.lora_ranks.tolist()
    scalings = meta.scalings.tolist()
    for s, w in enumerate(meta.weight_indices.tolist()):
        if indptr[s + 1] > indptr[s] and ranks[w] > 0:
            yield indptr[s], indptr[s + 1], w, ranks[w], scalings[w]
