"""Decode-specialised SGMV kernels in Triton: a split-K shrink whose split count follows the step's
segments, tensor-core tiles over each segment's rows, and work that follows each adapter's rank rather
than the slot capacity R.

Semantics and the contract on v are those of `sgmv_shrink` / `sgmv_expand` (lorakernels/sgmv_ref.py; the
`*_ref` functions are the reference of both):

    v[seg, k*R : k*R + r]    = x[seg] @ A[w, k*R : k*R + r, :]^T                          r = lora_ranks[w]
    y[seg, o_k : o_k + n_k] += scaling[w] * v[seg, k*R : k*R + r] @ B[w, o_k : o_k + n_k, :r]^T

    x [T, in_dim] fp16/bf16/fp32, A [num_slots, num_stack * R, in_dim], v [T, num_stack * R], B [num_slots, out_dim, R]

Why other kernels: a decode step is one token per request. `sgmv_shrink` gives each segment one program
that walks all of in_dim (the 14336-wide down projection: 112 serial tiles) through a tile R wide
whatever the rank. The scheduler puts each adapter's requests next to each other and a decode step
merges them into one segment per run (engine/lora_inputs.py, `lora_segments`), so a segment here is
1..DECODE_MAX_SEG_LEN rows of one adapter, and each adapter's A and B are read once for all its rows.

    shrink stage 1, grid (num_programs, num_stack): the step's n segments (counted on the device from
        seg_indptr, so a CUDA graph captured for a batch size serves any grouping of its rows) share the
        programs: each segment gets s = max(1, num_programs // n) splits of in_dim (at least one
        BLOCK_K tile apiece), and program p takes work items p, p + num_programs, ...: item i is split
        i % s of segment i // s. For each 16-row tile of the segment
        and each BLOCK_R-wide tile of ranks below r (a rank-16 adapter in a rank-64 slot costs 16 rows
        of A), a tensor-core dot over the split's columns:
            partial[split, row, k*R + n] = x[row, split] . A[w, k*R + n, split]           (fp32)
        Few segments (one popular adapter) get many short splits; many segments get few longer ones.
    shrink stage 2, grid (T, num_stack): each row finds its segment (one vector load of seg_indptr) and
        sums its segment's splits in one [splits, R] load and a tree sum (deterministic; no atomics):
            v[row, k*R + n] = round(sum_s partial[s, row, k*R + n])
    expand, grid (num_segments, sum_k cdiv(n_k, BLOCK_N)): program (g, j) takes column block j of the
        targets' blocks end to end (target 0's, then 1's, then 2's: q/k/v launches 48 blocks a segment at
        Llama-3-8B's 4096/1024/1024 columns, not 3 x 32), loads its
        segment's [BLOCK_N, r] tile of B once (columns past the slot's rank are masked, so never read)
        and, per 16-row tile of the segment, adds scaling * v[rows] @ B_tile^T (a tensor-core dot, fp32)
        into y's BLOCK_N columns; every (row, column) of y has one writer. With `overwrite` it stores the
        delta instead of adding it and writes zeros for rank-0 (base-model) segments: y need not be
        zeroed first when the segments cover every row and the slices every column. A program of an empty
        segment (a decode graph's padding) returns after reading the segment's bounds: no B, no wait.

    fused delta (`sgmv_lora_delta_decode`): stage 1, then the expand with FROM_PARTIALS: each program
        sums its rows' splits from the partials (SPLIT_CHUNK splits a load) and rounds them as stage 2
        stores v, then expands; no stage 2 and no v. Every column block's program sums its segment's
        splits again (from L2), in exchange for one launch and one dependent round trip less.

    with the LoRA PDL switch on (lorakernels/pdl.py `set_lora_enabled`, EngineConfig.lora_pdl): stage 1
        releases its dependents first thing and stage 2 and the expand are launched with programmatic
        dependent launch, each releasing its own; so their programs are scheduled while the kernel before
        still runs, read the step's metadata (and the expand its B tile), and only then wait for it.

All grids are fixed by host ints (T, num_segments, in_dim, the device's SM count), so launching never
syncs and a captured CUDA graph serves every step of its batch size. Prefill-sized steps go to
`sgmv_shrink` / `sgmv_expand` (`*_auto`: more than DECODE_MAX_TOKENS tokens, or a segment of more than
DECODE_MAX_SEG_LEN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorakernels import pdl
from lorakernels.pdl import release_dependents, wait_for_producer
from lorakernels.sgmv import MAX_STACK, check_expand_args, sgmv_expand, sgmv_shrink, shrink_output
from lorakernels.sgmv_ref import SgmvMeta
from lorakernels.tuned import ExpandTile, ShrinkTile, device_sms, device_tiles

DECODE_MAX_SEG_LEN = 64  # a decode step's merged run of one adapter's requests (engine/lora_inputs.py)
DECODE_MAX_TOKENS = 512  # the split workspace is [splits, T, stack * R] fp32: bounded for prefill-sized T
MAX_DECODE_SEGMENTS = 4096  # seg_indptr is read in one vector load
ROWS = 16  # rows of a segment per tensor-core tile (tl.dot's least M)
BLOCK_R = 16
BLOCK_K = 128  # built-in tiles, where lorakernels/tuned.py has none for the device and shape
BUILTIN_EXPAND = ExpandTile(128, 4)
SPLIT_CHUNK = 8  # the fused delta's expand sums this many splits' partials a load
PROGRAMS_PER_SM = 2  # measured on an H200: 2 beats 4, 8 and 16 in all but one case (BENCHMARKS.md)


@triton.jit
def _num_live_segments(seg_indptr_ptr, num_segments, BLOCK_G: tl.constexpr):
    """Segments up to the last non-empty one: seg_indptr is non-decreasing, so those whose start is
    below the total row count are a prefix (a graph's padding segments are empty and trail)."""
    offs = tl.arange(0, BLOCK_G)
    starts = tl.load(seg_indptr_ptr + offs, mask=offs < num_segments, other=2**30)
    total = tl.load(seg_indptr_ptr + num_segments)
    return tl.sum((starts < total).to(tl.int32))


@triton.jit
def _splits(n, num_programs, K, BLOCK_K: tl.constexpr):
    """(splits a segment gets, columns a split covers, splits that hold columns) for n live segments."""
    wanted = tl.maximum(num_programs // tl.maximum(n, 1), 1)
    split_len = tl.cdiv(tl.cdiv(K, wanted), BLOCK_K) * BLOCK_K
    return wanted, split_len, tl.cdiv(K, split_len)


@triton.jit
def _shrink_split_kernel(
    # pointers
    x_ptr,  # [T, K]
    a_ptr,  # [num_slots, num_stack * R, K]
    partial_ptr,  # [max_splits, T, num_stack * R] fp32
    seg_indptr_ptr,  # [num_segments + 1] int32
    weight_indices_ptr,  # [num_segments] int32
    lora_ranks_ptr,  # [num_slots] int32
    # sizes
    K,
    max_rank,  # R
    num_segments,
    num_programs,
    # strides
    stride_xm, stride_xk,
    stride_aw, stride_an, stride_ak,
    stride_ps, stride_pm, stride_pn,
    # meta-parameters
    ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,  # >= num_segments
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    RELEASE: tl.constexpr = False,  # lorakernels/pdl.py: let the next kernel's programs start now
):  # fmt: skip
    if RELEASE:
        release_dependents()
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)  # stacked target
    n = _num_live_segments(seg_indptr_ptr, num_segments, BLOCK_G)
    wanted, split_len, num_splits = _splits(n, num_programs, K, BLOCK_K)
    offs_m = tl.arange(0, ROWS)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    # work item w = (segment w // wanted, split w % wanted); more segments than programs: several each
    for w in range(pid, n * wanted, num_programs):
        seg = w // wanted
        split = w % wanted
        if split < num_splits:
            # -- this segment's slot, rank and rows; this split's columns -----------------------------
            slot = tl.load(weight_indices_ptr + seg)
            rank = tl.load(lora_ranks_ptr + slot)
            row_start = tl.load(seg_indptr_ptr + seg)
            row_end = tl.load(seg_indptr_ptr + seg + 1)
            k_start = split * split_len
            k_end = tl.minimum(k_start + split_len, K)
            a_base = a_ptr + slot.to(tl.int64) * stride_aw + (pid_k * max_rank) * stride_an
            # -- row tiles x rank tiles below this slot's rank: rank 0 (base model, empty slot) runs none
            for m0 in range(row_start, row_end, ROWS):
                rows = m0 + offs_m
                mask_m = rows < row_end
                for n0 in range(0, rank, BLOCK_R):
                    cols = n0 + offs_r
                    mask_r = cols < rank
                    acc = tl.zeros((ROWS, BLOCK_R), dtype=tl.float32)
                    for k0 in range(k_start, k_end, BLOCK_K):
                        offs = k0 + offs_k
                        mask_k = offs < k_end
                        xv = tl.load(
                            x_ptr + rows[:, None] * stride_xm + offs[None, :] * stride_xk,
                            mask=mask_m[:, None] & mask_k[None, :],
                            other=0.0,
                        )  # [ROWS, BLOCK_K]
                        av = tl.load(
                            a_base + cols[None, :] * stride_an + offs[:, None] * stride_ak,
                            mask=mask_k[:, None] & mask_r[None, :],
                            other=0.0,
                        )  # [BLOCK_K, BLOCK_R]: A^T
                        if UPCAST_DOT:
                            xv = xv.to(tl.float32)
                            av = av.to(tl.float32)
                        acc += tl.dot(xv, av, input_precision=INPUT_PRECISION)
                    p_ptrs = (
                        partial_ptr
                        + split * stride_ps
                        + rows[:, None] * stride_pm
                        + (pid_k * max_rank + cols)[None, :] * stride_pn
                    )
                    tl.store(p_ptrs, acc, mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _shrink_reduce_kernel(
    # pointers
    partial_ptr,  # [max_splits, T, num_stack * R] fp32
    v_ptr,  # [T, num_stack * R]
    seg_indptr_ptr,  # [num_segments + 1] int32
    weight_indices_ptr,  # [num_segments] int32
    lora_ranks_ptr,  # [num_slots] int32
    # sizes
    K,
    max_rank,
    num_segments,
    num_programs,
    # strides
    stride_ps, stride_pm, stride_pn,
    stride_vm, stride_vn,
    # meta-parameters
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,  # >= num_segments
    BLOCK_S: tl.constexpr,  # >= any split count: every split's partial in one load
    BLOCK_RR: tl.constexpr,  # >= R
    RELEASE: tl.constexpr = False,  # lorakernels/pdl.py: let the next kernel's programs start now
    USE_PDL: tl.constexpr = False,  # lorakernels/pdl.py: read the metadata, then wait for the shrink
):  # fmt: skip
    if RELEASE:
        release_dependents()
    row = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    ends = tl.load(seg_indptr_ptr + 1 + offs_g, mask=offs_g < num_segments, other=2**30)
    seg = tl.sum((ends <= row).to(tl.int32))  # the segment holding row (num_segments: none)
    live = seg < num_segments
    # rank 0 for a row past the segments: nothing loaded or stored below
    rank = tl.load(lora_ranks_ptr + tl.load(weight_indices_ptr + seg, mask=live, other=0), mask=live, other=0)
    n = _num_live_segments(seg_indptr_ptr, num_segments, BLOCK_G)
    _, _, num_splits = _splits(n, num_programs, K, BLOCK_K)
    offs_s = tl.arange(0, BLOCK_S)
    offs_r = tl.arange(0, BLOCK_RR)
    cols = pid_k * max_rank + offs_r
    mask = (offs_s[:, None] < num_splits) & (offs_r[None, :] < rank)
    if USE_PDL:
        wait_for_producer()  # everything above is metadata; the partials are the shrink's
    p_ptrs = partial_ptr + offs_s[:, None] * stride_ps + row * stride_pm + cols[None, :] * stride_pn
    acc = tl.sum(tl.load(p_ptrs, mask=mask, other=0.0), axis=0)  # [BLOCK_RR]
    tl.store(v_ptr + row * stride_vm + cols * stride_vn, acc.to(v_ptr.dtype.element_ty), mask=offs_r < rank)


def _num_sms(device: torch.device) -> int:
    return device_sms(device) or 8  # the interpreter: enough to exercise several splits on small test shapes


def builtin_shrink_tile(num_stack: int, device: torch.device) -> ShrinkTile:
    """The shrink's tile where lorakernels/tuned.py has none: about PROGRAMS_PER_SM programs per SM in all."""
    return ShrinkTile(max(1, PROGRAMS_PER_SM * _num_sms(device) // num_stack), BLOCK_K, 4)


def decode_config(
    in_dim: int, num_stack: int, device: torch.device, num_programs: int = 0, *, max_rank: int = 0, num_tokens: int = 0,
    tile: ShrinkTile | None = None,
) -> dict:  # fmt: skip
    """The shrink's launch: its program count per stacked target, its BLOCK_K and warps, and the most
    splits any segment can get (the partial workspace's depth). `tile` when given; else the device's
    tuned tile for this shape and token count (lorakernels/tuned.py), if any; else about PROGRAMS_PER_SM
    programs per SM in all, BLOCK_K and 4 warps. A nonzero num_programs overrides the tile's count.

    Example (H200, 132 SMs, no tuned file; q/k/v, in_dim 4096, so 88 programs a target): 32 segments of
    one row get 2 splits of 2048 columns; 4 segments of 16 rows (a single adapter at batch 64) get 22
    splits of 256 columns (two 128-wide tiles), 16 of which hold columns.
    """
    tile = tile or device_tiles(device).lookup("shrink", in_dim, num_stack, max_rank, num_tokens)
    tile = tile or builtin_shrink_tile(num_stack, device)
    num_programs = num_programs or tile.num_programs
    return {
        "num_programs": num_programs,
        "block_k": tile.block_k,
        "num_warps": tile.num_warps,
        "max_splits": min(num_programs, triton.cdiv(in_dim, tile.block_k)),
    }


def sgmv_shrink_decode(
    x: torch.Tensor,  # [T, in_dim]
    A: torch.Tensor,  # [num_slots, num_stack * R, in_dim], x.dtype
    meta: SgmvMeta,
    *,
    num_stack: int,
    out: torch.Tensor | None = None,  # [T, num_stack * R], x.dtype
    num_programs: int = 0,  # 0: decode_config's (tests pass others to force splits)
    tile: ShrinkTile | None = None,  # None: the device's tuned tile or the built-in one (decode_config)
) -> torch.Tensor:  # v [T, num_stack * R], x.dtype; entries outside the LoRA rows/ranks left as they were
    """v[seg, k*R : k*R + r] = x[seg] @ A[w, k*R : k*R + r, :]^T, split over in_dim; see the module doc."""
    out = shrink_output(x, A, meta, num_stack, out)
    num_tokens, in_dim, max_rank = x.shape[0], x.shape[1], A.shape[1] // num_stack
    if meta.num_segments == 0 or num_tokens == 0 or in_dim == 0:
        return out
    if meta.num_segments > MAX_DECODE_SEGMENTS:
        raise ValueError(f"{meta.num_segments} segments exceed the decode kernel's {MAX_DECODE_SEGMENTS}")
    config = decode_config(in_dim, num_stack, x.device, num_programs, max_rank=max_rank, num_tokens=num_tokens, tile=tile)
    partial = _split_partials(x, A, meta, num_stack, config)
    _reduce_partials(partial, out, meta, num_stack, config, in_dim)
    return out


def _reduce_partials(partial: torch.Tensor, out: torch.Tensor, meta: SgmvMeta, num_stack: int, config: dict, in_dim: int) -> None:
    """Stage 2 of the shrink: v = each row's splits of `partial` (stage 1's, launched with `config` over
    in_dim) summed and rounded into out."""
    num_tokens, max_rank, max_splits = out.shape[0], partial.shape[2] // num_stack, config["max_splits"]
    _shrink_reduce_kernel[(num_tokens, num_stack)](
        partial, out, meta.seg_indptr, meta.weight_indices, meta.lora_ranks,
        in_dim, max_rank, meta.num_segments, config["num_programs"],
        partial.stride(0), partial.stride(1), partial.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_K=config["block_k"], BLOCK_G=triton.next_power_of_2(meta.num_segments),
        BLOCK_S=triton.next_power_of_2(max_splits), BLOCK_RR=max(triton.next_power_of_2(max_rank), 16),
        num_warps=1 if max_splits * max_rank <= 1024 else 4, **pdl.lora_launch(out.device, first=False),
    )  # fmt: skip


def _split_partials(x: torch.Tensor, A: torch.Tensor, meta: SgmvMeta, num_stack: int, config: dict) -> torch.Tensor:
    """Stage 1 of the shrink: the fp32 partials [max_splits, T, num_stack * R] of each segment's splits."""
    num_tokens, in_dim, max_rank = x.shape[0], x.shape[1], A.shape[1] // num_stack
    partial = torch.empty(config["max_splits"], num_tokens, A.shape[1], dtype=torch.float32, device=x.device)
    block_g = triton.next_power_of_2(meta.num_segments)
    _shrink_split_kernel[(config["num_programs"], num_stack)](
        x, A, partial, meta.seg_indptr, meta.weight_indices, meta.lora_ranks,
        in_dim, max_rank, meta.num_segments, config["num_programs"],
        x.stride(0), x.stride(1),
        A.stride(0), A.stride(1), A.stride(2),
        partial.stride(0), partial.stride(1), partial.stride(2),
        ROWS=ROWS, BLOCK_R=BLOCK_R, BLOCK_K=config["block_k"], BLOCK_G=block_g,
        INPUT_PRECISION="ieee",  # only fp32 operands look at it: exact fp32, no TF32
        UPCAST_DOT=x.device.type == "cpu" and x.dtype == torch.bfloat16,  # the interpreter's bf16 dot
        num_warps=config["num_warps"], **pdl.lora_launch(x.device, first=True),
    )  # fmt: skip
    return partial


def sgmv_shrink_auto(
    x: torch.Tensor,  # [T, in_dim]
    A: torch.Tensor,  # [num_slots, num_stack * R, in_dim], x.dtype
    meta: SgmvMeta,
    *,
    num_stack: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # v [T, num_stack * R]
    """The decode shrink for steps of at most DECODE_MAX_TOKENS tokens whose segments hold at most
    DECODE_MAX_SEG_LEN (host ints, so a graph captured for a decode batch keeps the decode kernel),
    `sgmv_shrink` otherwise."""
    shrink = sgmv_shrink_decode if is_decode_sized(meta, x.shape[0]) else sgmv_shrink
    return shrink(x, A, meta, num_stack=num_stack, out=out)


def is_decode_sized(meta: SgmvMeta, num_tokens: int) -> bool:
    """A decode-shaped step (host ints only): short segments, a decode batch's token count."""
    return (
        meta.max_seg_len <= DECODE_MAX_SEG_LEN
        and meta.num_segments <= MAX_DECODE_SEGMENTS
        and num_tokens <= DECODE_MAX_TOKENS
    )


@triton.jit
def _expand_decode_kernel(
    # pointers
    v_ptr,  # [T, num_stack * R]
    b_ptr,  # [num_slots, out_dim, R]
    y_ptr,  # [T, out_dim]
    seg_indptr_ptr,  # [num_segments + 1] int32
    weight_indices_ptr,  # [num_segments] int32
    lora_ranks_ptr,  # [num_slots] int32
    scalings_ptr,  # [num_slots] fp32
    # sizes
    max_rank,
    off0, size0, off1, size1, off2, size2,  # output slices (offset, size) of up to MAX_STACK targets
    nb0, nb1,  # column blocks of targets 0 and 1: grid axis 1 runs over target 0's blocks, then 1's, then 2's
    K,  # FROM_PARTIALS: the shrink's in_dim, num_programs and segment count (its split count follows them)
    num_programs,
    num_segments,
    # strides
    stride_vs,  # FROM_PARTIALS: between splits of the partial workspace
    stride_vm, stride_vn,
    stride_bw, stride_bn, stride_br,
    stride_ym, stride_yn,
    # meta-parameters
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,  # >= R
    OVERWRITE: tl.constexpr,  # store the delta (zeros for rank 0), not y + delta
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    FROM_PARTIALS: tl.constexpr,  # v_ptr is the split shrink's fp32 partials: sum them here (no reduce kernel)
    SHRINK_BLOCK_K: tl.constexpr,  # FROM_PARTIALS: the shrink's BLOCK_K
    BLOCK_G: tl.constexpr,  # FROM_PARTIALS: >= num_segments
    SPLIT_CHUNK: tl.constexpr,  # FROM_PARTIALS: splits summed a load
    RELEASE: tl.constexpr = False,  # lorakernels/pdl.py: let the next kernel's programs start now
    USE_PDL: tl.constexpr = False,  # lorakernels/pdl.py: read the metadata and B, then wait for v
):  # fmt: skip
    if RELEASE:
        release_dependents()
    seg = tl.program_id(0)
    block = tl.program_id(1)  # (target, column block) flattened: each target launches its own blocks only
    pid_k = tl.where(block < nb0, 0, tl.where(block < nb0 + nb1, 1, 2))  # stacked target
    pid_n = block - tl.where(pid_k == 0, 0, tl.where(pid_k == 1, nb0, nb0 + nb1))
    offset = tl.where(pid_k == 0, off0, tl.where(pid_k == 1, off1, off2))
    size = tl.where(pid_k == 0, size0, tl.where(pid_k == 1, size1, size2))
    row_start = tl.load(seg_indptr_ptr + seg)
    row_end = tl.load(seg_indptr_ptr + seg + 1)
    # an empty segment (a graph's padding: most of the grid where a step has fewer segments than rows):
    # nothing to read or write, so no wait either (a block past its slice's columns cannot occur; guarded)
    if (row_end <= row_start) | (pid_n * BLOCK_N >= size):
        return
    slot = tl.load(weight_indices_ptr + seg)
    rank = tl.load(lora_ranks_ptr + slot)
    # -- what no kernel of the step writes (metadata, this slot's B tile) before any wait: a program of a
    # -- rank-0 segment reads no B
    offs_m = tl.arange(0, ROWS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < size
    scaling = tl.load(scalings_ptr + slot)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    b_ptrs = b_ptr + slot.to(tl.int64) * stride_bw + (offset + offs_n)[None, :] * stride_bn + offs_r[:, None] * stride_br
    b = tl.load(b_ptrs, mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]: B^T
    if UPCAST_DOT:
        b = b.to(tl.float32)
    if USE_PDL:
        wait_for_producer()  # v (or the partials) and y come from the kernels before
    if rank > 0:
        if FROM_PARTIALS:
            n = _num_live_segments(seg_indptr_ptr, num_segments, BLOCK_G)
            _, _, num_splits = _splits(n, num_programs, K, SHRINK_BLOCK_K)
            offs_s = tl.arange(0, SPLIT_CHUNK)
        for m0 in range(row_start, row_end, ROWS):
            rows = m0 + offs_m
            mask_m = rows < row_end
            if FROM_PARTIALS:
                # v[rows] = round(sum over splits): what the reduce kernel stores, summed in chunks
                acc = tl.zeros((ROWS, BLOCK_R), dtype=tl.float32)
                cols = (pid_k * max_rank + offs_r)[None, :] * stride_vn
                for s0 in range(0, num_splits, SPLIT_CHUNK):
                    splits = s0 + offs_s
                    p = tl.load(
                        v_ptr + splits[:, None, None] * stride_vs + rows[None, :, None] * stride_vm + cols[None, :, :],
                        mask=(splits < num_splits)[:, None, None] & mask_m[None, :, None] & mask_r[None, None, :],
                        other=0.0,
                    )  # [SPLIT_CHUNK, ROWS, BLOCK_R]
                    acc += tl.sum(p, axis=0)
                vv = acc.to(y_ptr.dtype.element_ty)
            else:
                vv = tl.load(
                    v_ptr + rows[:, None] * stride_vm + (pid_k * max_rank + offs_r)[None, :] * stride_vn,
                    mask=mask_m[:, None] & mask_r[None, :],
                    other=0.0,
                )  # [ROWS, BLOCK_R]
            if UPCAST_DOT:
                vv = vv.to(tl.float32)
            delta = tl.dot(vv, b, input_precision=INPUT_PRECISION) * scaling  # [ROWS, BLOCK_N] fp32
            y_ptrs = y_ptr + rows[:, None] * stride_ym + (offset + offs_n)[None, :] * stride_yn
            mask = mask_m[:, None] & mask_n[None, :]
            if not OVERWRITE:
                delta += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_ptrs, delta.to(y_ptr.dtype.element_ty), mask=mask)
    elif OVERWRITE:
        zeros = tl.zeros((ROWS, BLOCK_N), dtype=y_ptr.dtype.element_ty)
        for m0 in range(row_start, row_end, ROWS):
            rows = m0 + offs_m
            y_ptrs = y_ptr + rows[:, None] * stride_ym + (offset + offs_n)[None, :] * stride_yn
            tl.store(y_ptrs, zeros, mask=(rows < row_end)[:, None] & mask_n[None, :])


def sgmv_expand_decode(
    v: torch.Tensor,  # [T, num_stack * R]
    B: torch.Tensor,  # [num_slots, out_dim, R], v.dtype
    meta: SgmvMeta,
    y: torch.Tensor,  # [T, out_dim], updated in place
    *,
    output_slices: tuple[tuple[int, int], ...],  # ((offset, size), ...) one per stacked target
    tile: ExpandTile | None = None,  # None: the device's tuned tile for this shape, else BUILTIN_EXPAND
    overwrite: bool = False,  # y[rows of the segments, slices] = the delta (0 for rank-0 segments)
) -> None:
    """y[seg, o_k : o_k + n_k] += scaling[w] * v[seg, k*R : k*R + r] @ B[w, o_k : o_k + n_k, :r]^T, one
    program per (segment, column block, target); see the module doc."""
    check_expand_args(v, B, meta, y, output_slices)
    if meta.num_segments == 0 or v.shape[0] == 0:
        return
    if max(size for _, size in output_slices) == 0:
        return
    _launch_expand(v, B, meta, y, output_slices, tile, overwrite)


def _launch_expand(
    v: torch.Tensor,  # [T, num_stack * R]; or with `partials` the shrink's [splits, T, num_stack * R] fp32
    B: torch.Tensor,
    meta: SgmvMeta,
    y: torch.Tensor,
    output_slices: tuple[tuple[int, int], ...],
    tile: ExpandTile | None,
    overwrite: bool,
    partials: dict | None = None,  # the shrink's decode_config and in_dim: v holds its partials
) -> None:
    max_rank, num_tokens = B.shape[2], y.shape[0]
    widest = max(size for _, size in output_slices)
    num_stack = len(output_slices)
    tile = tile or device_tiles(y.device).lookup("expand", widest, num_stack, max_rank, num_tokens) or BUILTIN_EXPAND
    slices = [x for pair in output_slices for x in pair] + [0, 0] * (MAX_STACK - len(output_slices))
    blocks = [triton.cdiv(size, tile.block_n) for _, size in output_slices] + [0] * (MAX_STACK - len(output_slices))
    split_stride, rows_stride, cols_stride = (v.stride(0), v.stride(1), v.stride(2)) if partials else (0, v.stride(0), v.stride(1))
    _expand_decode_kernel[(meta.num_segments, sum(blocks))](
        v, B, y, meta.seg_indptr, meta.weight_indices, meta.lora_ranks, meta.scalings,
        max_rank, *slices, blocks[0], blocks[1],
        partials["in_dim"] if partials else 0, partials["num_programs"] if partials else 0, meta.num_segments,
        split_stride, rows_stride, cols_stride,
        B.stride(0), B.stride(1), B.stride(2),
        y.stride(0), y.stride(1),
        ROWS=ROWS, BLOCK_N=tile.block_n, BLOCK_R=max(triton.next_power_of_2(max_rank), 16), OVERWRITE=overwrite,
        INPUT_PRECISION="ieee", UPCAST_DOT=y.device.type == "cpu" and y.dtype == torch.bfloat16,
        FROM_PARTIALS=partials is not None, SHRINK_BLOCK_K=partials["block_k"] if partials else BLOCK_K,
        BLOCK_G=triton.next_power_of_2(meta.num_segments) if partials else 1, SPLIT_CHUNK=SPLIT_CHUNK,  # 1: no variants
        num_warps=tile.num_warps, **pdl.lora_launch(y.device, first=False),
    )  # fmt: skip


def sgmv_expand_auto(
    v: torch.Tensor,  # [T, num_stack * R]
    B: torch.Tensor,  # [num_slots, out_dim, R], v.dtype
    meta: SgmvMeta,
    y: torch.Tensor,  # [T, out_dim], updated in place
    *,
    output_slices: tuple[tuple[int, int], ...],
) -> None:
    """The decode expand where `sgmv_shrink_auto` takes the decode shrink, `sgmv_expand` otherwise."""
    expand = sgmv_expand_decode if is_decode_sized(meta, v.shape[0]) else sgmv_expand
    expand(v, B, meta, y, output_slices=output_slices)


def sgmv_delta_auto(
    v: torch.Tensor,  # [T, num_stack * R]
    B: torch.Tensor,  # [num_slots, out_dim, R], v.dtype
    meta: SgmvMeta,
    *,
    output_slices: tuple[tuple[int, int], ...],
) -> torch.Tensor:  # [T, out_dim], v.dtype
    """The LoRA delta alone, scaling * v @ B^T per segment (0 where no LoRA), in a new tensor: in a
    decode step whose segments cover every row and slices every column, the decode expand writes each
    entry once (no zero fill first); otherwise zeros plus `sgmv_expand_auto`."""
    num_rows, out_dim = v.shape[0], B.shape[1]
    if _decode_covers(meta, num_rows, output_slices, out_dim):
        delta = torch.empty(num_rows, out_dim, dtype=v.dtype, device=v.device)
        sgmv_expand_decode(v, B, meta, delta, output_slices=output_slices, overwrite=True)
        return delta
    delta = torch.zeros(num_rows, out_dim, dtype=v.dtype, device=v.device)
    sgmv_expand_auto(v, B, meta, delta, output_slices=output_slices)
    return delta


def sgmv_lora_delta_auto(
    x: torch.Tensor,  # [T, in_dim]
    A: torch.Tensor,  # [num_slots, num_stack * R, in_dim], x.dtype
    B: torch.Tensor,  # [num_slots, out_dim, R], x.dtype
    meta: SgmvMeta,
    *,
    num_stack: int,
    output_slices: tuple[tuple[int, int], ...],
) -> torch.Tensor:  # [T, out_dim], x.dtype
    """A step's LoRA delta from x in a new tensor: the fused decode delta (`sgmv_lora_delta_decode`) where
    the step is decode-sized with segments over every row and slices over every column (host ints, so a
    captured decode graph keeps it), else the shrink then `sgmv_delta_auto`."""
    if _decode_covers(meta, x.shape[0], output_slices, B.shape[1]):
        return sgmv_lora_delta_decode(x, A, B, meta, num_stack=num_stack, output_slices=output_slices)
    v = sgmv_shrink_auto(x, A, meta, num_stack=num_stack)
    return sgmv_delta_auto(v, B, meta, output_slices=output_slices)


def _decode_covers(meta: SgmvMeta, num_rows: int, output_slices: tuple[tuple[int, int], ...], out_dim: int) -> bool:
    """A decode-sized step whose segments hold every row and whose slices tile out_dim: an overwriting
    decode expand writes each entry of the delta once (host ints only)."""
    return (
        is_decode_sized(meta, num_rows)
        and meta.host_seg_lens is not None
        and sum(meta.host_seg_lens) == num_rows
        and _tiles(output_slices, out_dim)
    )


def _tiles(output_slices: tuple[tuple[int, int], ...], out_dim: int) -> bool:
    """The slices lie end to end from column 0 to out_dim."""
    end = 0
    for offset, size in output_slices:
        if offset != end:
            return False
        end += size
    return end == out_dim


def sgmv_lora_delta_decode(
    x: torch.Tensor,  # [T, in_dim]
    A: torch.Tensor,  # [num_slots, num_stack * R, in_dim], x.dtype
    B: torch.Tensor,  # [num_slots, out_dim, R], x.dtype
    meta: SgmvMeta,
    *,
    num_stack: int,
    output_slices: tuple[tuple[int, int], ...],
    num_programs: int = 0,  # the shrink's (0: decode_config's)
    shrink_tile: ShrinkTile | None = None,
    expand_tile: ExpandTile | None = None,
) -> torch.Tensor:  # [T, out_dim], x.dtype
    """A decode step's LoRA delta straight from x: scaling * (x @ A^T) @ B^T per segment, 0 where no LoRA,
    in a new tensor. The split-K shrink's fp32 partials go to the expand, which sums each row's splits as
    it loads them and rounds the sum to x's dtype, as the reduce kernel stores v: no reduce kernel and no
    v, one launch and one round trip less on a decode step's side stream, at the price of every column
    block's program summing its segment's splits again. The same as `sgmv_shrink_decode` then
    `sgmv_delta_auto` but for the order of the fp32 split sums. Decode-sized steps (`is_decode_sized`)
    whose segments cover every row and whose slices tile out_dim, as a decode graph's are; ValueError
    otherwise."""
    v_like = shrink_output(x, A, meta, num_stack, None)  # the shrink's checks (v itself is never written)
    num_tokens, in_dim, out_dim = x.shape[0], x.shape[1], B.shape[1]
    delta = torch.empty(num_tokens, out_dim, dtype=x.dtype, device=x.device)
    check_expand_args(v_like, B, meta, delta, output_slices)  # also: one slice a stacked target
    if not _decode_covers(meta, num_tokens, output_slices, out_dim):
        raise ValueError("the fused decode delta takes decode-sized steps whose segments cover every row and slices every column")
    if num_tokens == 0 or out_dim == 0:
        return delta
    if in_dim == 0 or meta.num_segments == 0:
        return delta.zero_()
    max_rank = A.shape[1] // num_stack
    config = decode_config(in_dim, num_stack, x.device, num_programs, max_rank=max_rank, num_tokens=num_tokens, tile=shrink_tile)
    partial = _split_partials(x, A, meta, num_stack, config)
    _launch_expand(partial, B, meta, delta, output_slices, expand_tile, overwrite=True, partials={**config, "in_dim": in_dim})
    return delta
