"""Batched PyTorch attention over a paged KV cache: the semantics of `extend_attention_ref`, through SDPA.

Same equation as lorakernels/attention_ref.py (request b: prefix p, extend e, rows s[b] .. s[b]+e-1 of q, KV
slots req_to_token[row_b, 0 : p+e]; new token j sees positions <= p+j; query head h reads KV head h // g):

    decodes (e == 1), all together, one SDPA call:
        K[b, i] = k_cache[slots_b[i]] for i < L_b, k_cache[0] (masked out) for L_b <= i < L_max
        o[s[b]] = softmax_i( scale * q[s[b]] . K[b, i]  for i < L_b ) @ V[b]
    extends (e > 1), one SDPA call each, causal with the diagonal offset by p:
        o[s[b]+j] = softmax_i( scale * q[s[b]+j] . K_b[i]  for i <= p+j ) @ V_b

Masks are per request ([B, 1, 1, L_max] for the decodes, [e, p+e] for one extend): never [T, T] and never
across unrelated requests. Computed in q's dtype (bf16 on CUDA reaches the fused SDPA kernels where the mask
allows); the output has q's dtype.

Running example: rows [4, 1, 7], prefix_lens [9, 0, 3], extend_lens [1, 5, 1] (T = 7) gives
    decode_q_rows [0, 6], decode_slots [2, 10] (row 4's 10 slots; row 7's 4 then 6 x slot 0),
    key_mask [[T x 10], [T T T T F F F F F F]] as [2, 1, 1, 10], and one extend (q rows 1..5, prefix 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lorakernels.attention_ref import check_shapes

# cuDNN's SDPA builds an execution plan on the host for every new shape: 1.6 ms of CPU per call on an
# H200 host (torch 2.11), 57% of a Llama-3-8B decode step, so it is left out of the candidates.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class ExtendChunk:
    """One request with extend_len > 1: its q rows and every KV slot it attends to."""

    q_start: int
    extend_len: int
    prefix_len: int
    slots: torch.Tensor  # [prefix_len + extend_len] int64 KV slots
    causal_mask: torch.Tensor | None  # [extend_len, prefix_len + extend_len] bool; None when prefix_len == 0


@dataclass
class SdpaPlan:
    """Device index tensors for one step, shared by every layer; built once on the host, no device sync."""

    num_tokens: int  # T
    decode_q_rows: torch.Tensor  # [B_dec] int64: q row of each decode request
    decode_slots: torch.Tensor  # [B_dec, L_max] int64: KV slots, padding = slot 0
    decode_key_mask: torch.Tensor  # [B_dec, 1, 1, L_max] bool: True where the key is real
    extends: list[ExtendChunk]
    is_all_decode: bool  # decode_q_rows == arange(T): the decode output is the whole output

    @classmethod
    def build(
        cls,
        req_rows: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        req_to_token: torch.Tensor,  # [max_reqs, max_context] int, on device
        device: torch.device | str,
    ) -> SdpaPlan:
        if not len(req_rows) == len(prefix_lens) == len(extend_lens):
            raise ValueError(
                f"{len(req_rows)} rows, {len(prefix_lens)} prefix lens, {len(extend_lens)} extend lens"
            )
        if any(e < 1 for e in extend_lens):
            raise ValueError(f"every extend_len must be >= 1; got {extend_lens}")
        q_starts = _exclusive_cumsum(extend_lens)
        decodes = [b for b, e in enumerate(extend_lens) if e == 1]
        decode_q_rows, decode_slots, key_mask = _decode_tensors(
            [q_starts[b] for b in decodes], [req_rows[b] for b in decodes],
            [prefix_lens[b] + 1 for b in decodes], req_to_token, device,
        )  # fmt: skip
        extends = [
            _extend_chunk(q_starts[b], extend_lens[b], prefix_lens[b], req_to_token[req_rows[b]], device)
            for b in range(len(req_rows))
            if extend_lens[b] > 1
        ]
        return cls(
            sum(extend_lens), decode_q_rows, decode_slots, key_mask, extends, len(decodes) == sum(extend_lens)
        )


def sdpa_extend_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    plan: SdpaPlan,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim], q.dtype
    """Causal attention of the step's new tokens over their cached and new K/V; see the module doc."""
    _check_inputs(q, k_cache, v_cache, plan)
    if plan.is_all_decode:
        return _attend_decodes(q, k_cache, v_cache, plan, scale)
    o = torch.empty_like(q)
    if plan.decode_q_rows.numel():
        o.index_copy_(
            0, plan.decode_q_rows, _attend_decodes(q[plan.decode_q_rows], k_cache, v_cache, plan, scale)
        )
    for chunk in plan.extends:
        rows = slice(chunk.q_start, chunk.q_start + chunk.extend_len)
        o[rows] = _attend_extend(
            q[rows], k_cache[chunk.slots], v_cache[chunk.slots], chunk.causal_mask, scale
        )
    return o


def _attend_decodes(
    q: torch.Tensor,  # [B, H, D]: one query per decode request
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    plan: SdpaPlan,
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    k = k_cache[plan.decode_slots].to(q.dtype).transpose(1, 2)  # [B, Hkv, L_max, D]
    v = v_cache[plan.decode_slots].to(q.dtype).transpose(1, 2)  # [B, Hkv, L_max, D]
    with sdpa_kernel(SDPA_BACKENDS):
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=plan.decode_key_mask, scale=scale, enable_gqa=True
        )  # [B, H, 1, D]
    return o.squeeze(2)


def _attend_extend(
    q: torch.Tensor,  # [E, H, D]
    k: torch.Tensor,  # [L, Hkv, D], L = prefix_len + E
    v: torch.Tensor,  # [L, Hkv, D]
    causal_mask: torch.Tensor | None,  # [E, L] bool, or None for prefix_len == 0 (plain causal)
    scale: float,
) -> torch.Tensor:  # [E, H, D]
    q_, k_, v_ = (x.to(q.dtype).transpose(0, 1) for x in (q, k, v))  # [heads, E or L, D]
    with sdpa_kernel(SDPA_BACKENDS):
        o = F.scaled_dot_product_attention(
            q_, k_, v_, attn_mask=causal_mask, is_causal=causal_mask is None, scale=scale, enable_gqa=True
        )  # [H, E, D]
    return o.transpose(0, 1)


def _decode_tensors(
    q_rows: list[int], req_rows: list[int], seq_lens: list[int], req_to_token: torch.Tensor, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q rows [B], KV slots [B, L_max] padded with slot 0, key mask [B, 1, 1, L_max]) of the decodes."""
    max_len = max(seq_lens, default=0)
    key_mask = (
        torch.arange(max_len)[None, :] < torch.tensor(seq_lens, dtype=torch.int64)[:, None]
    )  # [B, L_max]
    key_mask = key_mask.to(device, non_blocking=True)
    rows = _to_device(req_rows, device)
    slots = req_to_token[rows, :max_len].long()  # [B, L_max]; past L_b: stale or unset entries
    slots = slots.masked_fill(~key_mask, 0)
    return _to_device(q_rows, device), slots, key_mask[:, None, None, :]


def _extend_chunk(
    q_start: int, extend_len: int, prefix_len: int, token_row: torch.Tensor, device
) -> ExtendChunk:
    seq_len = prefix_len + extend_len
    mask = None
    if prefix_len:  # query j (position prefix_len + j) sees keys 0 .. prefix_len + j
        mask = torch.arange(seq_len)[None, :] <= prefix_len + torch.arange(extend_len)[:, None]  # [E, L]
        mask = mask.to(device, non_blocking=True)
    return ExtendChunk(q_start, extend_len, prefix_len, token_row[:seq_len].long(), mask)


def _exclusive_cumsum(values: list[int]) -> list[int]:
    starts, total = [], 0
    for v in values:
        starts.append(total)
        total += v
    return starts


def _to_device(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: SdpaPlan):
    check_shapes(q, k_cache, v_cache)
    if q.shape[0] != plan.num_tokens:
        raise ValueError(f"the plan covers {plan.num_tokens} tokens, q has {q.shape[0]} rows")
