"""Causal attention of a step's new tokens over a paged KV cache, in Triton, FlashAttention-style: the
prefill and chunked-prefill kernel (extend steps with cached prefixes), on tensor cores.

Semantics are `extend_attention_ref`'s (lorakernels/attention_ref.py): request b's new tokens j = 0..e-1
sit at positions p+j and attend to positions 0..p+j, whose K/V lie in the cache at
`req_to_token[row_b, 0 : p+e]` (the step writes the new tokens' K/V before attention runs).

    grid (num_q_blocks, num_kv_heads): program (i, g) takes block i of one request's new tokens
        (BLOCK_M of them; the host lists (request, first token) per block) and every query head of KV
        head g. It walks the request's keys in BLOCK_N tiles, gathering each tile's slots from
        req_to_token, with an online softmax in fp32 (running max and sum per query row), and stops at
        the block's last query position: tiles past it are never read, and only the tiles that cross a
        query's own position are masked. Scores and P @ V are `tl.dot`s (tensor cores for fp16/bf16).

The query heads of one KV head share each K/V tile: the program stacks them as GROUP x BLOCK_M rows.
Blocks run longest first (`block_lists`); tiles wholly before a block's first query go unmasked; the
softmax runs in powers of two (exp2 of scores scaled by log2(e)), as FlashAttention's Triton kernels do.
Grids depend only on host lists (lengths), so launching never syncs with the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorakernels.attention_ref import check_shapes
from lorakernels.pending_delta import output_like


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, n0, last_pos, q_pos, table, k_ptr, v_ptr, kv_head, offs_d, mask_d, qk_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # keys past a query's position or past the block's last one: masked
    UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """One BLOCK_N tile of keys from position n0: the online softmax's running max m_i, sum l_i (both
    in powers of two: scores times qk_scale = scale * log2(e)) and output acc, updated."""
    key_pos = n0 + tl.arange(0, BLOCK_N)
    valid_n = key_pos <= last_pos
    if MASKED:
        slots = tl.load(table + key_pos, mask=valid_n, other=0).to(tl.int64)
        k = tl.load(k_ptr + slots[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                    mask=valid_n[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]  # fmt: skip
    else:
        slots = tl.load(table + key_pos).to(tl.int64)
        k = tl.load(k_ptr + slots[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None], mask=mask_d[:, None], other=0.0)
    if UPCAST_DOT:
        s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee") * qk_scale
    else:
        s = tl.dot(q, k, input_precision="ieee") * qk_scale  # "ieee": fp32 operands stay exact (no TF32)  # [BLOCK_H * BLOCK_M, BLOCK_N] fp32
    if MASKED:
        s = tl.where((key_pos[None, :] <= q_pos[:, None]) & valid_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past extend see no key at all
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MASKED:
        v = tl.load(v_ptr + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=valid_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]  # fmt: skip
    else:
        v = tl.load(v_ptr + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=mask_d[None, :], other=0.0)
    if UPCAST_DOT:
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _extend_attention_kernel(
    # pointers
    q_ptr,  # [T, H, D]
    k_ptr,  # [S, Hkv, D]
    v_ptr,  # [S, Hkv, D]
    o_ptr,  # [T, H, D]
    req_to_token_ptr,  # [max_reqs, max_context]
    block_req_ptr,  # [num_blocks] int32: the request of each query block
    block_start_ptr,  # [num_blocks] int32: its first new token (0-based within the request)
    req_rows_ptr,  # [B] int64
    prefix_lens_ptr,  # [B] int32
    extend_lens_ptr,  # [B] int32
    q_starts_ptr,  # [B] int32: the request's first row of q
    scale,
    # strides
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_rr,
    # meta-parameters
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_H: tl.constexpr,  # GROUP rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # >= HEAD_DIM, a power of two
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # the CPU interpreter gets bf16 tl.dot wrong (see lorakernels/sgmv.py): fp32 there
):  # fmt: skip
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.load(block_req_ptr + pid)
    first = tl.load(block_start_ptr + pid)
    row = tl.load(req_rows_ptr + b)
    prefix = tl.load(prefix_lens_ptr + b)
    extend = tl.load(extend_lens_ptr + b)
    q_start = tl.load(q_starts_ptr + b)

    # rows of the program's tile: BLOCK_H query heads x BLOCK_M new tokens, head-major
    offs = tl.arange(0, BLOCK_H * BLOCK_M)
    tok = first + offs % BLOCK_M  # new-token index within the request
    local_head = offs // BLOCK_M
    head = kv_head * GROUP + local_head
    valid_m = (tok < extend) & (local_head < GROUP)
    q_pos = prefix + tok  # the query's position: it sees keys 0..q_pos
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_ptrs = q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=valid_m[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full((BLOCK_H * BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H * BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H * BLOCK_M, BLOCK_D), dtype=tl.float32)
    last_pos = prefix + tl.minimum(first + BLOCK_M, extend) - 1  # the block's last query position
    table = req_to_token_ptr + row * stride_rr
    qk_scale = scale * 1.4426950408889634  # log2(e): the softmax in powers of two
    # Whole tiles at or before the block's first query position are seen by every query: no mask. The
    # tiles after them, up to the last query's position, are masked key by key.
    unmasked_end = (prefix + first + 1) // BLOCK_N * BLOCK_N
    for n0 in range(0, unmasked_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, n0, last_pos, q_pos, table, k_ptr, v_ptr, kv_head, offs_d, mask_d, qk_scale,
            stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_N, False, UPCAST_DOT,
        )  # fmt: skip
    for n0 in range(unmasked_end, last_pos + 1, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, n0, last_pos, q_pos, table, k_ptr, v_ptr, kv_head, offs_d, mask_d, qk_scale,
            stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_N, True, UPCAST_DOT,
        )  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = o_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=valid_m[:, None] & mask_d[None, :])


def block_size_m(group: int) -> int:
    """New tokens per program: its BLOCK_H x BLOCK_M query rows share each K/V tile; about 128 rows."""
    return max(16, 128 // triton.next_power_of_2(group))


def block_lists(
    extend_lens: list[int], block_m: int, prefix_lens: list[int] | None = None
) -> tuple[list[int], list[int], list[int]]:
    """(request of each query block, its first new token, each request's first row of q). Blocks are
    listed longest first (by their last query's position, which bounds the keys they read; ties in
    request order), so the programs that walk the most keys start first and short ones fill the tail."""
    prefix_lens = prefix_lens or [0] * len(extend_lens)
    blocks, q_starts, start = [], [], 0
    for b, extend_len in enumerate(extend_lens):
        q_starts.append(start)
        start += extend_len
        for first in range(0, extend_len, block_m):
            blocks.append((-(prefix_lens[b] + min(first + block_m, extend_len)), b, first))
    blocks.sort()
    return [b for _, b, _ in blocks], [first for _, _, first in blocks], q_starts


class ExtendPlan:
    """The step's launch lists, built once from host lists and reused by every layer."""

    def __init__(self, req_rows: list[int], prefix_lens: list[int], extend_lens: list[int], group: int,
                 device: torch.device):  # fmt: skip
        if not len(req_rows) == len(prefix_lens) == len(extend_lens):
            raise ValueError("req_rows, prefix_lens and extend_lens must have equal lengths")
        self.block_m = block_size_m(group)
        blocks_req, blocks_start, q_starts = block_lists(extend_lens, self.block_m, prefix_lens)
        self.num_tokens = sum(extend_lens)
        self.num_blocks = len(blocks_req)
        ints = torch.tensor([*blocks_req, *blocks_start, *prefix_lens, *extend_lens, *q_starts], dtype=torch.int32)
        ints = ints.to(device, non_blocking=True)
        n, b = self.num_blocks, len(extend_lens)
        self.block_req, self.block_start = ints[:n], ints[n : 2 * n]
        self.prefix_lens, self.extend_lens, self.q_starts = ints[2 * n : 2 * n + b], ints[2 * n + b : 2 * n + 2 * b], ints[2 * n + 2 * b :]
        self.req_rows = torch.tensor(req_rows, dtype=torch.int64).to(device, non_blocking=True)


class ExtendPlanBuffers:
    """ExtendPlan's lists in device buffers allocated once for steps of up to max_tokens new tokens and
    max_reqs requests, refilled in place (a captured CUDA graph reads them on every replay).

    A step's blocks come first; the rest of the block list names a padding request (index max_reqs:
    no token, no key), whose programs do no work, so a graph sized for T tokens (`plan(T)`) replays
    any step of at most T tokens. The host staging buffer is pinned on CUDA: no sync to refill.
    """

    def __init__(self, max_tokens: int, max_reqs: int, group: int, device: torch.device):
        self.block_m = block_size_m(group)
        self.max_tokens, self.max_reqs = max_tokens, max_reqs
        self.max_blocks = self.blocks_for(max_tokens)
        b = max_reqs + 1  # the padding request last
        pin = torch.device(device).type == "cuda"
        # layout: [block_req | block_start (max_blocks each) | prefix_lens | extend_lens | q_starts (b each)];
        # req_rows (int64) has its own
        self._host = torch.zeros(2 * self.max_blocks + 3 * b, dtype=torch.int32, pin_memory=pin)
        self._rows_host = torch.zeros(b, dtype=torch.int64, pin_memory=pin)
        self._ints = torch.zeros_like(self._host, device=device)
        self.req_rows = torch.zeros(b, dtype=torch.int64, device=device)
        n = self.max_blocks
        self.block_req, self.block_start = self._ints[:n], self._ints[n : 2 * n]
        self.prefix_lens, self.extend_lens, self.q_starts = (self._ints[2 * n + i * b : 2 * n + (i + 1) * b] for i in range(3))

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks of any step of at most num_tokens new tokens: sum of cdiv(e_b, BLOCK_M) over its
        requests, at most num_tokens // BLOCK_M + one per request."""
        return num_tokens // self.block_m + min(num_tokens, self.max_reqs)

    def plan(self, num_tokens: int) -> _StaticPlan:
        """The launch view of a graph for steps of up to num_tokens tokens (q has num_tokens rows)."""
        if not 0 < num_tokens <= self.max_tokens:
            raise ValueError(f"num_tokens must be in 1..{self.max_tokens}, got {num_tokens}")
        return _StaticPlan(self, num_tokens, self.blocks_for(num_tokens))

    def fill(self, req_rows: list[int], prefix_lens: list[int], extend_lens: list[int]) -> None:
        """Write a step's lists; queued on the current stream (the caller fences the staging buffer)."""
        if not len(req_rows) == len(prefix_lens) == len(extend_lens) <= self.max_reqs:
            raise ValueError(f"want equal lists of at most {self.max_reqs} requests")
        if sum(extend_lens) > self.max_tokens:
            raise ValueError(f"{sum(extend_lens)} new tokens; the buffers hold {self.max_tokens}")
        n, b, pad = self.max_blocks, self.max_reqs + 1, self.max_reqs
        blocks_req, blocks_start, q_starts = block_lists(extend_lens, self.block_m, prefix_lens)
        used, reqs = len(blocks_req), len(extend_lens)
        host = self._host
        host.zero_()
        host[:used] = torch.tensor(blocks_req, dtype=torch.int32)
        host[used:n] = pad
        host[n : n + used] = torch.tensor(blocks_start, dtype=torch.int32)
        for i, values in enumerate((prefix_lens, extend_lens, q_starts)):
            host[2 * n + i * b : 2 * n + i * b + reqs] = torch.tensor(values, dtype=torch.int32)
        self._rows_host.zero_()
        self._rows_host[:reqs] = torch.tensor(req_rows, dtype=torch.int64)
        self._ints.copy_(host, non_blocking=True)
        self.req_rows.copy_(self._rows_host, non_blocking=True)


class _StaticPlan:
    """An ExtendPlan's launch fields over ExtendPlanBuffers: the first num_blocks blocks of the list."""

    def __init__(self, buffers: ExtendPlanBuffers, num_tokens: int, num_blocks: int):
        self.block_m, self.num_tokens, self.num_blocks = buffers.block_m, num_tokens, num_blocks
        self.block_req, self.block_start = buffers.block_req[:num_blocks], buffers.block_start[:num_blocks]
        self.req_rows, self.prefix_lens = buffers.req_rows, buffers.prefix_lens
        self.extend_lens, self.q_starts = buffers.extend_lens, buffers.q_starts


def extend_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int
    plan: ExtendPlan | _StaticPlan,
    scale: float,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim], contiguous in head_dim (a view into a wider tensor, say)
) -> torch.Tensor:  # [T, num_heads, head_dim], q.dtype: out when given
    """Causal attention of the new tokens over their cached and new K/V; see the module doc."""
    check_shapes(q, k_cache, v_cache)
    if q.shape[0] != plan.num_tokens:
        raise ValueError(f"the plan covers {plan.num_tokens} new tokens, q has {q.shape[0]} rows")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if plan.block_m != block_size_m(group):
        raise ValueError(f"the plan was built for another head grouping than {group} query heads per KV head")
    if k_cache.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("q and the KV cache must be contiguous in head_dim")
    o = output_like(q, out)
    if plan.num_blocks == 0:
        return o
    _extend_attention_kernel[(plan.num_blocks, num_kv_heads)](
        q, k_cache, v_cache, o, req_to_token,
        plan.block_req, plan.block_start, plan.req_rows, plan.prefix_lens, plan.extend_lens, plan.q_starts,
        scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        o.stride(0), o.stride(1), req_to_token.stride(0),
        GROUP=group, BLOCK_H=triton.next_power_of_2(group), HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=plan.block_m, BLOCK_N=64 if head_dim <= 128 else 32,
        UPCAST_DOT=q.device.type == "cpu" and q.dtype != torch.float32, num_warps=4 if head_dim <= 64 else 8, num_stages=2,
    )  # fmt: skip
    return o

