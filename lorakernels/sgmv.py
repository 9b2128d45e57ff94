"""SGMV shrink and expand in Triton: many LoRA adapters in one batch, one program per (row block, tile).

Semantics (the reference, the metadata and the v contract are in lorakernels/sgmv_ref.py):

    shrink:  v[seg, k*R : k*R + r]   = x[seg] @ A[w, k*R : k*R + r, :]^T                (fp32 accumulate)
    expand:  y[seg, o_k : o_k + n_k] += scalings[w] * v[seg, k*R : k*R + r] @ B[w, o_k : o_k + n_k, :r]^T

    x [T, in_dim] fp16/bf16/fp32, A [num_slots, num_stack * R, in_dim] same dtype, v [T, num_stack * R] x.dtype
    y [T, out_dim] any float dtype, B [num_slots, out_dim, R] dtype of v

Both ops are one kernel, `_sgmv_kernel`: out[rows, cols] (+)= scale * inp[rows, :K] @ W[w, cols, :K]^T
over one tile of BLOCK_M rows of one segment and BLOCK_N columns of one stacked target:

    op      inp  W  K (clipped)  N (clipped)  inp col offset  W row / out col offset  scale
    shrink  x    A  in_dim       r            0               k*R                     1 (store)
    expand  v    B  r            n_k          k*R             o_k                     scalings[w] (add)

Grid: row_blocks * num_stack * n_tiles programs, those of a row block neighbours in launch order
(`_tile_ids`: its stacked targets' shrinks then read its x from L2). Each segment's rows split into
blocks of BLOCK_M; a program finds its (segment, block) on the device from seg_indptr (a running count
of blocks per segment), so the grid needs only host ints: row_blocks = min(cdiv(max_seg_len, BLOCK_M) *
num_segments, T // BLOCK_M + num_segments) bounds the blocks of any segmentation of T rows, and
launching never syncs.
A captured CUDA graph therefore replays any segmentation of its T rows (a mixed prefill + decode step
with one long segment and many short ones launches about T / BLOCK_M + num_segments row programs, not
their product). Programs past the last block, past N, or of a rank-0 slot return at once.
Fused q/k/v (num_stack 3) and gate/up (2) share one shrink per input and one expand.

A shrink tile with split_k = S > 1 (lorakernels/tuned.py, or `builtin_split_k` for the built-in tile;
where a step's row blocks leave SMs idle, as a 2048-token prompt's 32 blocks of 64 rows do on 132 SMs,
each walking all of in_dim) launches S
programs a tile over the grid's third axis, split s taking a contiguous S-th of in_dim's BLOCK_K tiles
and storing its fp32 partial in a [S, T, num_stack * R] workspace; `_split_sum_kernel`, on the shrink's
grid and masks, sums each tile's S partials in split order and stores v (deterministic, no atomics).
fp32 inputs use IEEE fp32 dot products (no TF32), so they match the reference to fp32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorakernels.sgmv_ref import SgmvMeta
from lorakernels.tuned import SgmvTile, device_sms, device_tiles

MAX_STACK = 3  # q/k/v; the slice table below is passed as scalars so launching needs no device tensor
# Segments a program scans at once when it looks up its row block: fixed, so steps with other segment
# counts never compile another kernel variant (more segments take more passes).
SEGMENT_CHUNK = 64


@triton.jit
def _pick(k, a0, a1, a2):
    """The k-th of three scalars (k in 0..2): per-target offsets without a device table."""
    return tl.where(k == 0, a0, tl.where(k == 1, a1, a2))


@triton.jit
def row_block(seg_indptr_ptr, num_segments, block, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    """(segment, first row, end row) of row block `block`, counting each segment's cdiv(len, BLOCK_M)
    blocks in segment order; a block past the last gives segment num_segments (the caller returns)."""
    seg = 0
    blocks_before = 0  # blocks of the segments wholly before `block`
    carried = 0  # blocks of the chunks already scanned
    for chunk in range(0, num_segments, BLOCK_S):
        offs = chunk + tl.arange(0, BLOCK_S)
        live = offs < num_segments
        starts = tl.load(seg_indptr_ptr + offs, mask=live, other=0)
        ends = tl.load(seg_indptr_ptr + offs + 1, mask=live, other=0)
        blocks = (ends - starts + BLOCK_M - 1) // BLOCK_M
        last = carried + tl.cumsum(blocks, axis=0)  # blocks up to and including each segment
        before = live & (last <= block)
        seg += tl.sum(before.to(tl.int32), axis=0)
        blocks_before += tl.sum(tl.where(before, blocks, 0), axis=0)
        carried += tl.sum(blocks, axis=0)
    inside = seg < num_segments
    seg_start = tl.load(seg_indptr_ptr + seg, mask=inside, other=0)
    seg_end = tl.load(seg_indptr_ptr + seg + 1, mask=inside, other=0)
    return seg, seg_start + (block - blocks_before) * BLOCK_M, seg_end


@triton.jit
def row_segment(seg_indptr_ptr, num_segments, row, BLOCK_S: tl.constexpr):
    """The segment that holds `row`: how many segments end at or before it (num_segments: none does)."""
    seg = 0
    for chunk in range(0, num_segments, BLOCK_S):
        offs = chunk + tl.arange(0, BLOCK_S)
        live = offs < num_segments
        ends = tl.load(seg_indptr_ptr + offs + 1, mask=live, other=0)
        seg += tl.sum((live & (ends <= row)).to(tl.int32), axis=0)
    return seg


@triton.jit
def row_adapter(seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, num_segments, row, BLOCK_S: tl.constexpr):
    """(slot, rank) of the segment that holds `row` (a one-row kernel's adapter); rank 0 for a row in no
    segment (a graph's padding)."""
    seg = row_segment(seg_indptr_ptr, num_segments, row, BLOCK_S)
    live = seg < num_segments
    slot = tl.load(weight_indices_ptr + seg, mask=live, other=0)
    rank = tl.load(lora_ranks_ptr + slot, mask=live, other=0)
    return slot, rank


@triton.jit
def segment_or_tail_block(
    seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, num_segments, num_tokens, pid, seg_blocks,
    BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """(slot, rank, first row, end row) of row program `pid` of a kernel that must reach every row, not only
    the segments' (a fused expand's next kernel: SiLU-mul, the residual add + RMSNorm): programs below
    seg_blocks take the segments' row blocks (`row_block`; past the last block an empty range), the rest
    the rows after the last segment (a graph's padding) with rank 0. `seg_and_tail_blocks` sizes both."""
    if pid < seg_blocks:
        seg, m_start, m_end = row_block(seg_indptr_ptr, num_segments, pid, BLOCK_M, BLOCK_S)
        live = seg < num_segments
        slot = tl.load(weight_indices_ptr + seg, mask=live, other=0)
        rank = tl.load(lora_ranks_ptr + slot, mask=live, other=0)
    else:
        m_start = tl.load(seg_indptr_ptr + num_segments) + (pid - seg_blocks) * BLOCK_M
        m_end = num_tokens
        slot = tl.load(weight_indices_ptr, mask=False, other=0)  # 0, typed as the loads above
        rank = slot  # 0: no LoRA
    return slot, rank, m_start, m_end


@triton.jit
def _tile_ids(n_tiles, num_stack):
    """(row block, stacked target, column tile) of this program: a row block's programs for every target
    and column tile are neighbours in launch order, so a shrink's stacked targets read the block's x
    while it is in L2 (an 8k-token step's x, 64 MB at Llama-3-8B, outgrows an H100/H200's L2 if each
    target walks all rows in turn)."""
    pid = tl.program_id(0)
    return pid // (n_tiles * num_stack), (pid // n_tiles) % num_stack, pid % n_tiles


@triton.jit
def _sgmv_kernel(
    inp_ptr,  # [T, *]
    w_ptr,  # [num_slots, rows, K]
    out_ptr,  # [T, *]
    seg_indptr_ptr,  # [num_segments + 1] int32
    weight_indices_ptr,  # [num_segments] int32
    lora_ranks_ptr,  # [num_slots] int32
    scalings_ptr,  # [num_slots] fp32
    num_segments,
    K,  # shrink: in_dim; expand: unused (K = rank)
    max_rank,  # R
    n_tiles,  # column tiles per target (max over targets)
    num_stack,
    off_0, off_1, off_2,  # W row / out column offset of target k
    size_0, size_1, size_2,  # column count of target k (shrink: R, clipped to rank)
    stride_im, stride_ik,
    stride_ww, stride_wn, stride_wk,
    stride_om, stride_on,
    stride_os,  # SPLIT_K > 1: out is the fp32 partials [SPLIT_K, T, *], this the split's stride
    IS_SHRINK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,  # segments scanned at once by row_block
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    SPLIT_K: tl.constexpr,  # shrink: programs that split K; each stores its fp32 partial
):  # fmt: skip
    block, pid_k, pid_n = _tile_ids(n_tiles, num_stack)
    seg, m_start, seg_end = row_block(seg_indptr_ptr, num_segments, block, BLOCK_M, BLOCK_S)
    if seg >= num_segments:
        return
    slot = tl.load(weight_indices_ptr + seg)
    rank = tl.load(lora_ranks_ptr + slot)
    if rank == 0:  # empty slot or base model: contributes nothing
        return
    col_offset = _pick(pid_k, off_0, off_1, off_2)
    n_size = _pick(pid_k, size_0, size_1, size_2)
    if IS_SHRINK:
        n_size = tl.minimum(n_size, rank)
        k_size = K
        inp_col_offset = 0
    else:
        k_size = rank
        inp_col_offset = pid_k * max_rank
    if (m_start >= seg_end) | (pid_n * BLOCK_N >= n_size):
        return

    offs_m = (m_start + tl.arange(0, BLOCK_M)).to(tl.int64)  # row x stride passes 2**31 at 75k tokens x 28672
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < seg_end
    mask_n = offs_n < n_size
    inp_ptrs = inp_ptr + offs_m[:, None] * stride_im + (inp_col_offset + offs_k)[None, :] * stride_ik
    w_ptrs = (
        w_ptr
        + slot.to(tl.int64) * stride_ww
        + (col_offset + offs_n)[None, :] * stride_wn
        + offs_k[:, None] * stride_wk
    )  # [BLOCK_K, BLOCK_N]: W^T

    # -- inner loop: acc[BLOCK_M, BLOCK_N] = inp[rows, :k_size] @ W[cols, :k_size]^T in fp32 -----------
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.cdiv(k_size, BLOCK_K)
    k_first = 0
    if SPLIT_K > 1:  # split s takes K tiles [s * per, (s + 1) * per) into its partial (none: zeros)
        out_ptr += tl.program_id(2).to(tl.int64) * stride_os
        per = tl.cdiv(k_tiles, SPLIT_K)
        k_first = tl.program_id(2) * per
        k_tiles = tl.minimum(k_first + per, k_tiles)
        inp_ptrs += k_first * BLOCK_K * stride_ik
        w_ptrs += k_first * BLOCK_K * stride_wk
    for k in range(k_first, k_tiles):
        k_left = k_size - k * BLOCK_K
        a = tl.load(inp_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if UPCAST_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=INPUT_PRECISION)
        inp_ptrs += BLOCK_K * stride_ik
        w_ptrs += BLOCK_K * stride_wk

    # -- epilogue: shrink stores, expand scales and adds ---------------------------------------------
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + (col_offset + offs_n)[None, :] * stride_on
    mask = mask_m[:, None] & mask_n[None, :]
    if not IS_SHRINK:
        scaling = tl.load(scalings_ptr + slot)
        acc = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + scaling * acc
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_sum_kernel(
    partial_ptr,  # [SPLIT_K, T, num_stack * R] fp32
    out_ptr,  # [T, num_stack * R]
    seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr,
    num_segments, max_rank, n_tiles, num_stack,
    size_0, size_1, size_2,
    stride_ps, stride_pm, stride_pn,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SPLIT_K: tl.constexpr,
):  # fmt: skip
    """v of a split shrink: each program of the shrink's grid (less its split axis) sums its tile's
    SPLIT_K partials in split order and stores them rounded, under the shrink's masks (v's other
    entries stay as they were)."""
    block, pid_k, pid_n = _tile_ids(n_tiles, num_stack)
    seg, m_start, seg_end = row_block(seg_indptr_ptr, num_segments, block, BLOCK_M, BLOCK_S)
    if seg >= num_segments:
        return
    rank = tl.load(lora_ranks_ptr + tl.load(weight_indices_ptr + seg))
    n_size = tl.minimum(_pick(pid_k, size_0, size_1, size_2), rank)
    if (rank == 0) | (m_start >= seg_end) | (pid_n * BLOCK_N >= n_size):
        return
    offs_m = (m_start + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < seg_end)[:, None] & (offs_n < n_size)[None, :]
    cols = pid_k * max_rank + offs_n
    ptrs = partial_ptr + offs_m[:, None] * stride_pm + cols[None, :] * stride_pn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(SPLIT_K):  # the pointer walks the splits (an int32 s * stride_ps could overflow)
        acc += tl.load(ptrs, mask=mask, other=0.0)
        ptrs += stride_ps
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def block_m_for(max_seg_len: int) -> int:
    """Rows per tile: tl.dot needs >= 16; grow with the segments so prefill reuses each weight tile."""
    return 16 if max_seg_len <= 16 else 32 if max_seg_len <= 32 else 64


def builtin_tile(is_shrink: bool, max_rank: int) -> SgmvTile:
    """The tile where lorakernels/tuned.py has none for the device and shape: a shrink's columns are the
    slot's ranks (a tile of at most 64), an expand's K is the rank."""
    rank_tile = min(max(triton.next_power_of_2(max_rank), 16), 64)
    return SgmvTile(64, rank_tile, 128, 4, 3) if is_shrink else SgmvTile(64, 128, rank_tile, 4, 2)


# The built-in shrink tile splits in_dim where a step's real row blocks fill at most a quarter of the SMs
# and the step is at least this long: on an H100 the tuner split o's and down's shrink 4 ways at 2048
# tokens (32 row blocks of 64 on 132 SMs: 29.9 -> 25.1 and 72.3 -> 49.5 us with the expand) and kept
# q/k/v (96 blocks) and gate/up (64) whole, and a 2048-token prefill with adapters ran 1.3% faster with
# those tiles (BENCHMARKS.md, 2026-12-06). Shorter steps are mixed and decode-like: left whole.
BUILTIN_SPLIT_MIN_TOKENS = 1024
BUILTIN_SPLIT_MAX = 8


def builtin_split_k(num_tokens: int, row_blocks: int, in_dim: int, block_k: int, programs_per_block: int, num_sms: int) -> int:
    """The built-in shrink tile's split of in_dim for a step of num_tokens rows in row_blocks blocks: the
    largest power of two (at most BUILTIN_SPLIT_MAX) that keeps the split programs within the SMs, where
    the blocks (times the programs each takes: stacked targets x column tiles) fill at most a quarter of
    them, each split at least 4 K tiles; else 1."""
    programs = row_blocks * programs_per_block
    if num_tokens < BUILTIN_SPLIT_MIN_TOKENS or programs * 4 > num_sms:
        return 1
    split = 1
    while split * 2 <= BUILTIN_SPLIT_MAX and programs * split * 2 <= num_sms and triton.cdiv(in_dim, block_k) >= split * 2 * 4:
        split *= 2
    return split


def _tile_config(tile: SgmvTile, max_seg_len: int) -> dict:
    """A tile's launch: its rows a program where the step's segments are that long (a captured graph's
    max_seg_len is its token count), else as few as `block_m_for` gives shorter segments."""
    block_m = tile.block_m if max_seg_len >= tile.block_m else block_m_for(max_seg_len)
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": tile.block_n,
        "BLOCK_K": tile.block_k,
        "num_warps": tile.num_warps,
        "num_stages": tile.num_stages,
    }


def _check_meta(meta: SgmvMeta, device: torch.device) -> None:
    for name in ("seg_indptr", "weight_indices", "lora_ranks", "scalings"):
        tensor = getattr(meta, name)
        if tensor.device != device:
            raise ValueError(f"meta.{name} is on {tensor.device}, the data on {device}")
    if meta.seg_indptr.dtype != torch.int32 or meta.weight_indices.dtype != torch.int32:
        raise ValueError("seg_indptr and weight_indices must be int32")
    if meta.lora_ranks.dtype != torch.int32 or meta.scalings.dtype != torch.float32:
        raise ValueError("lora_ranks must be int32 and scalings fp32")


def row_blocks(meta: SgmvMeta, num_rows: int, block_m: int) -> int:
    """Row programs of a launch: enough for every segmentation of num_rows rows into meta.num_segments
    segments of at most meta.max_seg_len rows (host ints only)."""
    return min(triton.cdiv(meta.max_seg_len, block_m) * meta.num_segments, num_rows // block_m + meta.num_segments)


def seg_and_tail_blocks(meta: SgmvMeta, num_rows: int, block_m: int) -> tuple[int, int]:
    """(segment row programs, tail row programs) of a `segment_or_tail_block` launch over num_rows rows:
    no tail where the host knows the segments cover every row."""
    covered = meta.host_seg_lens is not None and sum(meta.host_seg_lens) == num_rows
    return row_blocks(meta, num_rows, block_m), 0 if covered else triton.cdiv(num_rows, block_m)


def _launch(inp, w, out, meta, *, is_shrink, K, max_rank, slices, config, split_k: int = 1) -> None:
    """One SGMV launch; split_k > 1 (a shrink): the shrink's programs split K and store fp32 partials,
    then `_split_sum_kernel` sums them into `out`."""
    offsets = [off for off, _ in slices] + [0] * (MAX_STACK - len(slices))
    sizes = [size for _, size in slices] + [0] * (MAX_STACK - len(slices))
    n_tiles = triton.cdiv(max(sizes), config["BLOCK_N"])
    blocks = row_blocks(meta, inp.shape[0], config["BLOCK_M"])
    if blocks == 0 or n_tiles == 0:
        return
    target = out
    if split_k > 1:
        target = torch.empty(split_k, *out.shape, dtype=torch.float32, device=out.device)
    grid = (blocks * n_tiles * len(slices), 1, split_k)
    _sgmv_kernel[grid](
        inp, w, target,
        meta.seg_indptr, meta.weight_indices, meta.lora_ranks, meta.scalings,
        meta.num_segments, K, max_rank, n_tiles, len(slices), *offsets, *sizes,
        inp.stride(0), inp.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        target.stride(-2), target.stride(-1), target.stride(0) if split_k > 1 else 0,
        IS_SHRINK=is_shrink,
        SPLIT_K=split_k,
        BLOCK_S=SEGMENT_CHUNK,
        INPUT_PRECISION="ieee",  # only fp32 operands look at it: exact fp32, no TF32
        # Triton's CPU interpreter (the only way Triton runs on CPU tensors) gets bf16 tl.dot wrong
        # (triton 3.9): upcast there; the products are exact in fp32 either way.
        UPCAST_DOT=inp.device.type == "cpu" and inp.dtype == torch.bfloat16,
        **config,
    )  # fmt: skip
    if split_k > 1:
        _split_sum_kernel[grid[:2]](
            target, out, meta.seg_indptr, meta.weight_indices, meta.lora_ranks,
            meta.num_segments, max_rank, n_tiles, len(slices), *sizes,
            target.stride(0), target.stride(1), target.stride(2),
            out.stride(0), out.stride(1),
            BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_S=SEGMENT_CHUNK, SPLIT_K=split_k,
            num_warps=4,
        )  # fmt: skip


def shrink_output(
    x: torch.Tensor, A: torch.Tensor, meta: SgmvMeta, num_stack: int, out: torch.Tensor | None
) -> torch.Tensor:  # v [T, num_stack * R], x.dtype
    """A shrink's checks (shapes, dtypes, metadata) and its output: `out` when given, else a new tensor."""
    if x.dim() != 2 or A.dim() != 3 or A.shape[2] != x.shape[1]:
        raise ValueError(
            f"want x [T, in_dim], A [slots, stack*R, in_dim]; got {tuple(x.shape)}, {tuple(A.shape)}"
        )
    if not 1 <= num_stack <= MAX_STACK or A.shape[1] % num_stack:
        raise ValueError(f"A rows {A.shape[1]} are not num_stack={num_stack} (1..{MAX_STACK}) blocks")
    if x.dtype != A.dtype:
        raise ValueError(f"x is {x.dtype}, A is {A.dtype}")
    _check_meta(meta, x.device)
    if out is None:
        return torch.empty(x.shape[0], A.shape[1], dtype=x.dtype, device=x.device)
    if out.shape != (x.shape[0], A.shape[1]) or out.dtype != x.dtype:
        raise ValueError(
            f"out must be [{x.shape[0]}, {A.shape[1]}] {x.dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    return out


def sgmv_shrink(
    x: torch.Tensor,  # [T, in_dim]
    A: torch.Tensor,  # [num_slots, num_stack * R, in_dim], x.dtype
    meta: SgmvMeta,
    *,
    num_stack: int,
    out: torch.Tensor | None = None,  # [T, num_stack * R], x.dtype
    tile: SgmvTile | None = None,  # None: the device's tuned tile (lorakernels/tuned.py), else the built-in one
) -> torch.Tensor:  # v [T, num_stack * R], x.dtype; entries outside the LoRA rows/ranks left as they were
    """v[seg, k*R : k*R + r] = x[seg] @ A[w, k*R : k*R + r, :]^T for every target k < num_stack."""
    out = shrink_output(x, A, meta, num_stack, out)
    max_rank = A.shape[1] // num_stack
    slices = tuple((k * max_rank, max_rank) for k in range(num_stack))
    tile = tile or device_tiles(x.device).lookup("sgmv_shrink", x.shape[1], num_stack, max_rank, x.shape[0])
    builtin = tile is None
    tile = tile or builtin_tile(True, max_rank)
    config = _tile_config(tile, meta.max_seg_len)
    if builtin:  # the interpreter (no SMs) and in_dims of few K tiles stay whole
        per_block = num_stack * triton.cdiv(max_rank, config["BLOCK_N"])
        block_m = config["BLOCK_M"]
        # the step's real row blocks where the host knows its segments (an eager step; many short ones fill
        # the grid), else a long prompt's (a graph replays other segmentations of its rows)
        lens = meta.host_seg_lens
        blocks = sum(triton.cdiv(n, block_m) for n in lens) if lens is not None else triton.cdiv(x.shape[0], block_m)
        split_k = builtin_split_k(x.shape[0], blocks, x.shape[1], config["BLOCK_K"], per_block, device_sms(x.device))
    else:
        split_k = tile.split_k if x.shape[1] > config["BLOCK_K"] else 1  # one K tile: nothing to split
    _launch(x, A, out, meta, is_shrink=True, K=x.shape[1], max_rank=max_rank, slices=slices, config=config, split_k=split_k)
    return out


def sgmv_expand(
    v: torch.Tensor,  # [T, num_stack * R]
    B: torch.Tensor,  # [num_slots, out_dim, R], v.dtype
    meta: SgmvMeta,
    y: torch.Tensor,  # [T, out_dim], updated in place
    *,
    output_slices: tuple[tuple[int, int], ...],  # ((offset, size), ...) one per stacked target
    tile: SgmvTile | None = None,  # None: the device's tuned tile (lorakernels/tuned.py), else the built-in one
) -> None:
    """y[seg, o_k : o_k + n_k] += scalings[w] * v[seg, k*R : k*R + r] @ B[w, o_k : o_k + n_k, :r]^T."""
    check_expand_args(v, B, meta, y, output_slices)
    max_rank = B.shape[2]
    widest = max((size for _, size in output_slices), default=0)
    tile = tile or device_tiles(v.device).lookup("sgmv_expand", widest, len(output_slices), max_rank, v.shape[0])
    config = _tile_config(tile or builtin_tile(False, max_rank), meta.max_seg_len)
    _launch(
        v, B, y, meta, is_shrink=False, K=0, max_rank=max_rank, slices=tuple(output_slices), config=config
    )


def check_expand_args(
    v: torch.Tensor, B: torch.Tensor, meta: SgmvMeta, y: torch.Tensor, output_slices: tuple[tuple[int, int], ...]
) -> None:
    """The shapes, dtypes and slices every expand kernel takes; ValueError naming what is wrong."""
    if v.dim() != 2 or B.dim() != 3 or y.dim() != 2 or y.shape[0] != v.shape[0] or B.shape[1] != y.shape[1]:
        raise ValueError(
            f"want v [T, stack*R], B [slots, out_dim, R], y [T, out_dim]; "
            f"got {tuple(v.shape)}, {tuple(B.shape)}, {tuple(y.shape)}"
        )
    max_rank = B.shape[2]
    if not 1 <= len(output_slices) <= MAX_STACK or v.shape[1] != len(output_slices) * max_rank:
        raise ValueError(f"v has {v.shape[1]} columns, want {len(output_slices)} targets x R={max_rank}")
    if any(off < 0 or size < 0 or off + size > y.shape[1] for off, size in output_slices):
        raise ValueError(f"output_slices {output_slices} fall outside out_dim {y.shape[1]}")
    if v.dtype != B.dtype:
        raise ValueError(f"v is {v.dtype}, B is {B.dtype}")
    _check_meta(meta, v.device)
