"""Pure-PyTorch reference of causal attention over a paged KV cache (extend and decode alike).

Semantics, for request b with prefix length p = prefix_lens[b], extend length e = extend_lens[b], its rows
r = s[b] .. s[b]+e-1 of q (s = exclusive cumsum of extend_lens), and its KV slots
slots = req_to_token[req_pool_indices[b], 0 : p+e]:

    K = k_cache[slots]                                   # [p+e, num_kv_heads, head_dim]
    V = v_cache[slots]                                   # [p+e, num_kv_heads, head_dim]
    o[s[b]+j, h] = softmax_i( scale * q[s[b]+j, h] . K[i, h // g]  for i <= p+j ) @ V[:, h // g]

with g = num_heads // num_kv_heads (grouped-query attention: query head h reads KV head h // g, as
transformers' `repeat_kv` does). New token j sits at position p+j and sees every position up to its own.
Decode is the case e = 1. Computed in fp32; the output has q's dtype.
"""

import torch


def extend_attention_ref(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int: (request slot, position) -> KV slot
    req_pool_indices: torch.Tensor,  # [B] int: request b's row of req_to_token
    prefix_lens: torch.Tensor,  # [B] int: tokens already cached before this step
    extend_lens: torch.Tensor,  # [B] int: new tokens in this step; sum == T
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim], q.dtype
    """Causal attention of the new tokens of B requests over their cached and new K/V; see the module doc."""
    _check_inputs(q, k_cache, v_cache, extend_lens)
    o = torch.empty_like(q)
    start = 0
    rows = zip(req_pool_indices.tolist(), prefix_lens.tolist(), extend_lens.tolist(), strict=True)
    for req_idx, prefix_len, extend_len in rows:
        slots = req_to_token[req_idx, : prefix_len + extend_len].long()
        o[start : start + extend_len] = _attend_one(
            q[start : start + extend_len], k_cache[slots], v_cache[slots], prefix_len, scale
        )
        start += extend_len
    return o


def _attend_one(
    q: torch.Tensor,  # [E, num_heads, head_dim]
    k: torch.Tensor,  # [L, num_kv_heads, head_dim], L = prefix_len + E
    v: torch.Tensor,  # [L, num_kv_heads, head_dim]
    prefix_len: int,
    scale: float,
) -> torch.Tensor:  # [E, num_heads, head_dim]
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [L, num_heads, head_dim]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("ehd,lhd->hel", q.float(), k) * scale  # [num_heads, E, L]
    query_pos = prefix_len + torch.arange(q.shape[0], device=q.device)  # [E]
    key_pos = torch.arange(k.shape[0], device=q.device)  # [L]
    scores = scores.masked_fill(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hel,lhd->ehd", probs, v).to(q.dtype)


def check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """q [T, H, D] against a KV cache [S, Hkv, D] of every extend-attention kernel; ValueError if they do not fit."""
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"want q [T, H, D], k/v [S, Hkv, D]; got {tuple(q.shape)}, {tuple(k_cache.shape)}")
    if q.shape[2] != k_cache.shape[2] or q.shape[1] % k_cache.shape[1]:
        raise ValueError(
            f"q heads {q.shape[1]} x {q.shape[2]} do not fit KV heads {tuple(k_cache.shape[1:])}"
        )


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, extend_lens: torch.Tensor):
    check_shapes(q, k_cache, v_cache)
    if int(extend_lens.sum()) != q.shape[0]:
        raise ValueError(f"extend_lens sum to {int(extend_lens.sum())}, q has {q.shape[0]} rows")
