"""Attention backends behind one interface, chosen once when a worker starts.

A backend turns a step's request rows, prefix lengths and extend lengths into metadata whose `attend`
the model calls in every layer (the model never asks which kernel runs):

    prepare(req_rows, prefix_lens, extend_lens) -> metadata     an eager step (any mix of prefill/decode)
    capture_metadata(req_rows, seq_lens) -> metadata            a decode batch in static buffers, for a
                                                                CUDA graph; a replay refills the buffers

    metadata.attend(q [T, H, D], k_cache [S, Hkv, D], v_cache [S, Hkv, D], scale) -> o [T, H, D]

`ref` (lorakernels/attention_ref.py, any step), `sdpa` (lorakernels/attention_sdpa.py, any step), `triton`
(lorakernels/extend_attention.py, any step: a FlashAttention-style Triton kernel over the paged cache, made
for prefill) and `decode` (lorakernels/decode_attention.py, all-decode steps only, graph-safe) are the backends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from lorakernels.attention_ref import extend_attention_ref
from lorakernels.attention_sdpa import SdpaPlan, sdpa_extend_attention


class AttentionMetadata(Protocol):
    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor: ...


class AttentionBackend(Protocol):
    name: str

    def prepare(self, req_rows: list[int], prefix_lens: list[int], extend_lens: list[int]) -> AttentionMetadata: ...


@dataclass
class RefMetadata:
    req_to_token: torch.Tensor  # [max_reqs, max_context]
    req_rows: torch.Tensor  # [B]
    prefix_lens: torch.Tensor  # [B]
    extend_lens: torch.Tensor  # [B]

    def attend(self, q, k_cache, v_cache, scale):
        return extend_attention_ref(q, k_cache, v_cache, self.req_to_token, self.req_rows, self.prefix_lens, self.extend_lens, scale)


@dataclass
class SdpaMetadata:
    plan: SdpaPlan

    def attend(self, q, k_cache, v_cache, scale):
        return sdpa_extend_attention(q, k_cache, v_cache, self.plan, scale)


@dataclass
class TritonMetadata:
    req_to_token: torch.Tensor  # [max_reqs, max_context]
    req_rows: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    # lorakernels.extend_attention.ExtendPlan, built by the first layer (it needs the head grouping); a step
    # graph gives its static plan (ExtendPlanBuffers.plan) instead, and the lists above go unread
    plan: object = None

    def attend(self, q, k_cache, v_cache, scale):
        return self.attend_into(q, k_cache, v_cache, scale, None)

    def attend_into(self, q, k_cache, v_cache, scale, out):
        """`attend` writing `out` when given (a view into the LoRA tail's x_aug: engine/lora_tail.py)."""
        from lorakernels.extend_attention import ExtendPlan, extend_attention  # Triton: imported on use

        if self.plan is None:
            group = q.shape[1] // k_cache.shape[1]
            self.plan = ExtendPlan(self.req_rows, self.prefix_lens, self.extend_lens, group, q.device)
        return extend_attention(q, k_cache, v_cache, self.req_to_token, self.plan, scale, out=out)


@dataclass
class DecodeKernelMetadata:
    req_to_token: torch.Tensor  # [max_reqs, max_context]
    req_rows: torch.Tensor  # [B] int64 static buffer
    seq_lens: torch.Tensor  # [B] int32 static buffer: tokens to attend to, the new one included; 0 = padding
    max_context: int
    workspace: object  # lorakernels.decode_attention.DecodeAttentionWorkspace (Triton: imported on CUDA only)

    def attend(self, q, k_cache, v_cache, scale):
        from lorakernels.decode_attention import decode_attention

        return decode_attention(
            q, k_cache, v_cache, self.req_to_token, self.req_rows, self.seq_lens, scale,
            max_context=self.max_context, workspace=self.workspace,
        )  # fmt: skip


class RefBackend:
    name = "ref"

    def __init__(self, req_to_token: torch.Tensor):
        self.req_to_token = req_to_token
        self.device = req_to_token.device

    def prepare(self, req_rows, prefix_lens, extend_lens) -> RefMetadata:
        return RefMetadata(self.req_to_token, _tensor(req_rows, self.device), _tensor(prefix_lens, self.device), _tensor(extend_lens, self.device))


class SdpaBackend:
    name = "sdpa"

    def __init__(self, req_to_token: torch.Tensor):
        self.req_to_token = req_to_token

    def prepare(self, req_rows, prefix_lens, extend_lens) -> SdpaMetadata:
        return SdpaMetadata(SdpaPlan.build(list(req_rows), list(prefix_lens), list(extend_lens), self.req_to_token, self.req_to_token.device))


class TritonBackend:
    name = "triton"

    def __init__(self, req_to_token: torch.Tensor):
        self.req_to_token = req_to_token

    def prepare(self, req_rows, prefix_lens, extend_lens) -> TritonMetadata:
        return TritonMetadata(self.req_to_token, list(req_rows), list(prefix_lens), list(extend_lens))


class DecodeKernelBackend:
    """The paged split-KV decode kernel: all-decode steps only, with a graph-safe launch."""

    name = "decode"

    def __init__(self, req_to_token: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
        self.req_to_token = req_to_token
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    def capture_metadata(self, req_rows: torch.Tensor, seq_lens: torch.Tensor) -> DecodeKernelMetadata:
        from lorakernels.decode_attention import DecodeAttentionWorkspace, default_num_splits

        batch, device, max_context = req_rows.shape[0], self.req_to_token.device, self.req_to_token.shape[1]
        num_splits = default_num_splits(batch, self.num_kv_heads, max_context, device)
        workspace = DecodeAttentionWorkspace.allocate(batch, self.num_heads, self.head_dim, num_splits, device)
        return DecodeKernelMetadata(self.req_to_token, req_rows, seq_lens, max_context, workspace)


EAGER_BACKENDS: dict[str, type] = {"ref": RefBackend, "sdpa": SdpaBackend, "triton": TritonBackend}


def eager_backend(name: str, req_to_token: torch.Tensor) -> AttentionBackend:
    if name not in EAGER_BACKENDS:
        raise ValueError(f"attention_backend must be one of {sorted(EAGER_BACKENDS)}, not {name!r}")
    return EAGER_BACKENDS[name](req_to_token)


def _tensor(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)
