"""Paged decode attention in Triton, split-KV (flash-decoding), with a launch that CUDA graphs can capture.

Semantics, for request b < B with L_b = min(seq_lens[b], max_context) and KV slots
slots_b = req_to_token[req_rows[b], 0 : L_b] (the paged layout of lorakernels/attention_ref.py, decode case):

    K_b = k_cache[slots_b]                                        # [L_b, Hkv, D]
    V_b = v_cache[slots_b]                                        # [L_b, Hkv, D]
    o[b, h] = softmax_i( scale * q[b, h] . K_b[i, h // g] ) @ V_b[:, h // g]      (i < L_b, fp32)
    o[b, h] = 0                                                   if L_b == 0 (padding rows of a graph)

    q [B, H, D] fp32/fp16/bf16; k_cache, v_cache [num_slots, Hkv, D] q.dtype; g = H // Hkv;
    req_to_token [max_reqs, >= max_context] int32/int64; req_rows [B] int; seq_lens [B] int32; o [B, H, D] q.dtype

Two kernels, both on a grid fixed by host-known sizes (never by the step's lengths, so one captured graph
serves every step of a padded batch size; nothing here reads a device tensor on the host):

    stage 1, grid (B, Hkv, num_splits): request b's positions are cut into num_splits chunks of
        split_len_b = roundup(cdiv(L_b, num_splits), BLOCK_N) positions, computed on the device; program
        (b, kv head, s) attends the group's g query heads (loaded together as one [BLOCK_H, D] tile, padded
        to 16 rows for tl.dot, so K/V are read once per group) over chunk s and writes
            partial_o[b, h, s] = softmax-weighted V over the chunk            # [D] fp32
            partial_lse[b, h, s] = log2 sum_i 2^(log2(e) * scale * q . K_i)   # fp32
        Programs whose chunk starts at or past L_b return at once (all of them when L_b == 0).
    stage 2, grid (B, H): o[b, h] = sum_s 2^(lse_s - max lse) partial_o_s / sum_s 2^(lse_s - max lse)
        over the chunks that hold positions (s < cdiv(L_b, split_len_b)); zeros when there are none.
    With one chunk (num_splits == 1: batches whose requests x KV heads fill the GPU twice on their own,
    e.g. Llama-3-8B at batch 64) stage 1 writes o itself, what stage 2 would compute from its one chunk
    bit for bit, zeros for L_b == 0, and stage 2 is not launched (a kernel and its gap less a layer).

The partials live in a `DecodeAttentionWorkspace`, allocated once per (batch capacity, heads, head_dim,
num_splits) and passed to every call so a captured graph keeps reading and writing the same buffers.
Precondition not checked (it would sync): every slot in req_to_token[req_rows[b], :L_b] is < num_slots.
seq_lens above max_context are clamped to it, so req_to_token is never read past column max_context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lorakernels import pdl
from lorakernels.pdl import wait_for_producer

LOG2E = 1.4426950408889634
MIN_BLOCK_H = 16  # tl.dot needs M >= 16: a group of g < 16 query heads is padded with masked rows
MAX_SPLITS = 64
MIN_SPLIT_TOKENS = 64  # shorter chunks: their fixed cost (q load, partial store, merge read) dominates


@triton.jit
def _decode_attention_split_kernel(
    # pointers
    q_ptr,  # [B, H, D]
    k_cache_ptr,  # [num_slots, Hkv, D]
    v_cache_ptr,  # [num_slots, Hkv, D]
    req_to_token_ptr,  # [max_reqs, >= max_context] int32/int64
    req_rows_ptr,  # [B] int
    seq_lens_ptr,  # [B] int
    partial_o_ptr,  # [>= B, H, num_splits, D] fp32 (unused with DIRECT)
    partial_lse_ptr,  # [>= B, H, num_splits] fp32 (unused with DIRECT)
    o_ptr,  # [B, H, D]: written here with DIRECT (one chunk), else by the merge
    # sizes
    max_context,
    num_splits,
    head_dim,
    qk_scale,  # scale * log2(e): softmax in base 2
    # strides
    stride_qb, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_rtr,
    stride_pob, stride_poh, stride_pos,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    # meta-parameters
    DIRECT: tl.constexpr,  # num_splits == 1: the chunk's softmax is the output, no merge
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # lorakernels/pdl.py: wait for the previous grid first
):  # fmt: skip
    if USE_PDL:
        wait_for_producer()
    # -- which request, KV head and chunk; early exit past the request's length -------------------
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b).to(tl.int32), max_context)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < head_dim
    heads = kv_head * GROUP + offs_h
    mask_hd = mask_h[:, None] & mask_d[None, :]
    o_ptrs = o_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    if start >= end:
        if DIRECT:  # L_b == 0 (a graph's padding row): zeros, as the merge writes them
            zeros = tl.zeros((BLOCK_H, BLOCK_D), dtype=o_ptr.dtype.element_ty)
            tl.store(o_ptrs, zeros, mask=mask_hd)
        return

    # -- the group's query heads: q[b, kv_head*g : kv_head*g + g] as one padded tile ---------------
    q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_hd, other=0.0)  # [BLOCK_H, BLOCK_D]
    if UPCAST_DOT:
        q = q.to(tl.float32)
    slots_row_ptr = req_to_token_ptr + tl.load(req_rows_ptr + b).to(tl.int64) * stride_rtr

    # -- online softmax over the chunk, BLOCK_N positions at a time (fp32 running max, sum, acc) -----
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for n in range(start, end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(slots_row_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k_ptrs = k_cache_ptr + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        if UPCAST_DOT:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))  # finite: every chunk holds >= 1 position
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_ptrs = v_cache_ptr + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        if UPCAST_DOT:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    # -- the output (one chunk: what the merge computes from it, bit for bit), or this chunk's partials
    if DIRECT:
        tl.store(o_ptrs, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=mask_hd)
        return
    po_ptrs = (
        partial_o_ptr
        + b.to(tl.int64) * stride_pob
        + heads[:, None] * stride_poh
        + split * stride_pos
        + offs_d[None, :]
    )
    tl.store(po_ptrs, acc / l_i[:, None], mask=mask_hd)
    lse_ptrs = partial_lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split
    tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=mask_h)


@triton.jit
def _decode_attention_merge_kernel(
    # pointers
    partial_o_ptr,  # [>= B, H, num_splits, D] fp32
    partial_lse_ptr,  # [>= B, H, num_splits] fp32
    seq_lens_ptr,  # [B] int
    o_ptr,  # [B, H, D]
    # sizes
    max_context,
    num_splits,
    head_dim,
    # strides
    stride_pob, stride_poh, stride_pos,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    # meta-parameters
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,  # stage 1's: chunk lengths are rounded to it
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # lorakernels/pdl.py: wait for the previous grid first
):  # fmt: skip
    if USE_PDL:
        wait_for_producer()
    b = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b).to(tl.int32), max_context)
    split_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, 1)
    num_used = tl.cdiv(seq_len, split_len)  # chunks stage 1 wrote; 0 when seq_len == 0

    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_used
    mask_d = offs_d < head_dim
    lse_ptrs = partial_lse_ptr + b.to(tl.int64) * stride_lb + head * stride_lh + offs_s
    lse = tl.load(lse_ptrs, mask=mask_s, other=float("-inf"))  # [BLOCK_S]
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # no chunk used: keep -inf - -inf out
    weights = tl.where(mask_s, tl.exp2(lse - lse_max), 0.0)
    po_ptrs = (
        partial_o_ptr
        + b.to(tl.int64) * stride_pob
        + head * stride_poh
        + offs_s[:, None] * stride_pos
        + offs_d[None, :]
    )
    partial_o = tl.load(po_ptrs, mask=mask_s[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    total = tl.sum(weights, axis=0)
    o = tl.sum(weights[:, None] * partial_o, axis=0) / tl.where(total > 0, total, 1.0)  # zeros if unused
    o_ptrs = o_ptr + b.to(tl.int64) * stride_ob + head * stride_oh + offs_d
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=mask_d)


def _one_pass(num_splits: int) -> bool:
    """Whether stage 1 writes o itself (one chunk: no merge)."""
    return num_splits == 1


@dataclass
class DecodeAttentionWorkspace:
    """Stage-1 partials for up to `batch_size` requests; allocate once, pass to every (captured) call.

    partial_o [batch_size, H, num_splits, D] fp32, partial_lse [batch_size, H, num_splits] fp32. A call
    with B <= batch_size uses rows 0..B-1; only chunks holding positions are written and read.
    """

    partial_o: torch.Tensor
    partial_lse: torch.Tensor

    @classmethod
    def allocate(cls, batch_size, num_heads, head_dim, num_splits, device) -> DecodeAttentionWorkspace:
        return cls(
            torch.empty(batch_size, num_heads, num_splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(batch_size, num_heads, num_splits, dtype=torch.float32, device=device),
        )

    @property
    def num_splits(self) -> int:
        return self.partial_lse.shape[2]


def default_num_splits(batch_size: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Enough (request, KV head, chunk) programs to fill the GPU twice, chunks of >= MIN_SPLIT_TOKENS.

    Depends only on host-known sizes, so a graph captured at (batch_size, max_context) keeps it.
    """
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    want = triton.cdiv(2 * num_sms, max(batch_size * num_kv_heads, 1))
    return max(1, min(want, triton.cdiv(max_context, MIN_SPLIT_TOKENS), MAX_SPLITS))


def _config(q: torch.Tensor, group: int, head_dim: int) -> dict:
    on_cpu = q.device.type == "cpu"
    return {
        "BLOCK_H": max(MIN_BLOCK_H, triton.next_power_of_2(group)),
        # 16 on CPU keeps the interpreter's tiles small and lets short test sequences span several chunks
        "BLOCK_N": 16 if on_cpu else 64,
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "INPUT_PRECISION": "ieee",  # only fp32 operands look at it: exact fp32, no TF32
        # Triton's CPU interpreter gets bf16 tl.dot wrong (see lorakernels/sgmv.py): upcast there.
        "UPCAST_DOT": on_cpu and q.dtype == torch.bfloat16,
        "num_warps": 4,
        "num_stages": 2,
    }


def _check_inputs(q, k_cache, v_cache, req_to_token, req_rows, seq_lens, max_context) -> None:
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"want q [B, H, D], k/v [S, Hkv, D]; got {tuple(q.shape)}, {tuple(k_cache.shape)}")
    if q.shape[2] != k_cache.shape[2] or q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"q heads {tuple(q.shape[1:])} do not fit KV heads {tuple(k_cache.shape[1:])}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype}, k/v caches {k_cache.dtype}/{v_cache.dtype}")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or req_to_token.stride(1) != 1:
        raise ValueError("q, k_cache, v_cache and req_to_token need a contiguous last dimension")
    if req_to_token.dim() != 2 or req_to_token.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"req_to_token must be [max_reqs, max_context] int32/int64, got {req_to_token.dtype}"
        )
    if not 0 < max_context <= req_to_token.shape[1]:
        raise ValueError(f"max_context {max_context} outside 1..{req_to_token.shape[1]} (req_to_token width)")
    if req_rows.shape != (q.shape[0],) or seq_lens.shape != (q.shape[0],):
        raise ValueError(f"req_rows {tuple(req_rows.shape)} / seq_lens {tuple(seq_lens.shape)} != [B]")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("req_to_token", req_to_token),
                    ("req_rows", req_rows), ("seq_lens", seq_lens)):  # fmt: skip
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def _check_workspace(workspace, batch_size, num_heads, head_dim, num_splits, device) -> None:
    po, lse = workspace.partial_o, workspace.partial_lse
    if po.dtype != torch.float32 or lse.dtype != torch.float32 or po.device != device or lse.device != device:
        raise ValueError(f"workspace must be fp32 on {device}")
    if po.shape[0] < batch_size or po.shape[1:] != (num_heads, num_splits, head_dim):
        raise ValueError(
            f"partial_o {tuple(po.shape)} cannot hold [{batch_size}, {num_heads}, {num_splits}, {head_dim}]"
        )
    if (
        lse.shape[0] < batch_size
        or lse.shape[1:] != (num_heads, num_splits)
        or po.stride(3) != 1
        or lse.stride(2) != 1
    ):
        raise ValueError(
            f"partial_lse {tuple(lse.shape)} cannot hold [{batch_size}, {num_heads}, {num_splits}]"
        )


def decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D], q.dtype
    v_cache: torch.Tensor,  # [num_slots, Hkv, D], q.dtype
    req_to_token: torch.Tensor,  # [max_reqs, >= max_context] int32/int64
    req_rows: torch.Tensor,  # [B] int: request b's row of req_to_token
    seq_lens: torch.Tensor,  # [B] int32: positions to attend; 0 for padding rows
    scale: float,
    *,
    max_context: int,  # host-known capacity: seq_lens are clamped to it; picks num_splits
    num_splits: int | None = None,  # default: default_num_splits(B, Hkv, max_context) or the workspace's
    workspace: DecodeAttentionWorkspace | None = None,
    out: torch.Tensor | None = None,  # [B, H, D] q.dtype: a static output buffer for graphs
) -> torch.Tensor:  # o [B, H, D], q.dtype; rows with seq_lens == 0 are zeros
    """o[b, h] = softmax_i(scale * q[b, h] . K_b[i, h // g]) @ V_b[:, h // g], i < L_b; see the module doc."""
    # -- check --------------------------------------------------------------------------------------
    _check_inputs(q, k_cache, v_cache, req_to_token, req_rows, seq_lens, max_context)
    batch_size, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_splits is None:
        num_splits = (
            workspace.num_splits
            if workspace is not None
            else default_num_splits(batch_size, num_kv_heads, max_context, q.device)
        )
    if not 1 <= num_splits <= max_context:
        raise ValueError(f"num_splits {num_splits} outside 1..max_context={max_context}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")

    # -- allocate -----------------------------------------------------------------------------------
    if workspace is None:
        workspace = DecodeAttentionWorkspace.allocate(batch_size, num_heads, head_dim, num_splits, q.device)
    _check_workspace(workspace, batch_size, num_heads, head_dim, num_splits, q.device)
    if out is None:
        out = torch.empty_like(q)
    if batch_size == 0:
        return out

    # -- launch -------------------------------------------------------------------------------------
    config = _config(q, num_heads // num_kv_heads, head_dim)
    po, lse = workspace.partial_o, workspace.partial_lse
    direct = _one_pass(num_splits)
    _decode_attention_split_kernel[(batch_size, num_kv_heads, num_splits)](
        q, k_cache, v_cache, req_to_token, req_rows, seq_lens, po, lse, out,
        max_context, num_splits, head_dim, scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0),
        po.stride(0), po.stride(1), po.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        DIRECT=direct, GROUP=num_heads // num_kv_heads,
        **config, **pdl.launch(q.device),
    )  # fmt: skip
    if direct:
        return out
    _decode_attention_merge_kernel[(batch_size, num_heads)](
        po, lse, seq_lens, out,
        max_context, num_splits, head_dim,
        po.stride(0), po.stride(1), po.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_N=config["BLOCK_N"],
        BLOCK_D=config["BLOCK_D"],
        **pdl.launch(q.device),
    )  # fmt: skip
    return out


def decode_attention_ref(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    req_to_token: torch.Tensor,  # [max_reqs, >= max_context] int
    req_rows: torch.Tensor,  # [B] int
    seq_lens: torch.Tensor,  # [B] int
    scale: float,
    *,
    max_context: int,
    num_splits: int | None = None,  # accepted for signature parity; the reference does not split
    workspace: DecodeAttentionWorkspace | None = None,  # accepted for signature parity
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # o [B, H, D], q.dtype; rows with seq_lens == 0 are zeros
    """decode_attention in PyTorch, one request at a time in fp32 (reads seq_lens on the host: syncs)."""
    _check_inputs(q, k_cache, v_cache, req_to_token, req_rows, seq_lens, max_context)
    group = q.shape[1] // k_cache.shape[1]
    o = torch.zeros_like(q) if out is None else out.zero_()
    for b, (row, seq_len) in enumerate(zip(req_rows.tolist(), seq_lens.tolist(), strict=True)):
        slots = req_to_token[row, : min(seq_len, max_context)].long()
        if slots.numel() == 0:
            continue
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        probs = torch.softmax(torch.einsum("hd,lhd->hl", q[b].float(), k) * scale, dim=-1)  # [H, L]
        o[b] = torch.einsum("hl,lhd->hd", probs, v).to(q.dtype)
    return o
