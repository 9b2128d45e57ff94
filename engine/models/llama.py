"""Llama 2/3, and Mistral and Qwen2 with their specs: the shared blocks as they are.

What differs among the three (q/k/v and o biases, the sliding window Qwen2 switches on by flag) is read
from the family's spec into ModelConfig; the forward is the same."""

from engine.models.blocks import Attention, DecoderModel


class LlamaModel(DecoderModel):
    attention = Attention
