"""Qwen3: the Llama decoder plus an RMSNorm over head_dim on every head of q and k, applied after the
projection and before RoPE. `head_dim` comes from config.json, independent of hidden_size / heads; small
sizes tie the embeddings (ModelConfig.tie_word_embeddings); q/k/v carry no bias unless attention_bias."""

import torch

from engine.model_config import ModelConfig
from engine.models.blocks import Attention, DecoderModel, RMSNorm
from engine.parallel import SINGLE, TensorParallel


class Qwen3Attention(Attention):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TensorParallel = SINGLE, **factory):
        super().__init__(config, layer_id, tp, **factory)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, **factory)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, **factory)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, H, D], k: [T, Hkv, D]; each head normalised over D with one weight shared by all heads
        return self.q_norm(q), self.k_norm(k)


class Qwen3Model(DecoderModel):
    attention = Qwen3Attention
