"""What one forward step reads besides token ids and positions: attention metadata and the KV buffers."""

from dataclasses import dataclass

import torch

from engine.model_config import ModelConfig
from kernels.attention_sdpa import SdpaPlan


@dataclass
class DecodePlan:
    """An all-decode step (one token per request) in static buffers: what a captured graph reads."""

    req_rows: torch.Tensor  # [B] int64: each request's row of req_to_token
    seq_lens: torch.Tensor  # [B] int32: tokens to attend to, the new one included; 0 = padding row
    max_context: int  # host-known capacity (the width of req_to_token)
    workspace: object  # kernels.decode_attention.DecodeAttentionWorkspace (Triton is imported only on CUDA)


@dataclass
class AttentionInputs:
    """Where this step's tokens write their K/V and which cached tokens each request attends to.

    The T tokens of the step are B requests' new tokens back to back; request b owns extend_lens[b] of
    them, at positions prefix_lens[b] .. prefix_lens[b]+extend_lens[b]-1 of row req_pool_indices[b] of
    req_to_token. Invariant: out_cache_loc[t] == req_to_token[row(t), position(t)] for every new token t.
    """

    out_cache_loc: torch.Tensor  # [T] int64: KV slot each new token's K/V is written to
    req_to_token: torch.Tensor  # [max_reqs, max_context] int: (request slot, position) -> KV slot
    req_pool_indices: torch.Tensor  # [B] int
    prefix_lens: torch.Tensor  # [B] int: tokens already in the cache
    extend_lens: torch.Tensor  # [B] int: new tokens this step; 1 for decode
    sdpa_plan: SdpaPlan | None = None  # the same batch as index tensors for the batched SDPA backend
    decode_plan: DecodePlan | None = None  # an all-decode batch for the graph-safe decode kernel


@dataclass
class KVBuffers:
    """Per-layer K and V pools indexed by KV slot; allocated once, written in place by every forward."""

    k: list[torch.Tensor]  # num_layers x [num_slots, num_kv_heads, head_dim]
    v: list[torch.Tensor]  # num_layers x [num_slots, num_kv_heads, head_dim]

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str
    ) -> "KVBuffers":
        shape = (num_slots, config.num_kv_heads, config.head_dim)
        layers = range(config.num_layers)
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in layers],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in layers],
        )

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]
