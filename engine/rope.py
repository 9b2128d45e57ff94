"""Rotary position embedding (the rotate-half layout of Hugging Face Llama), with linear and Llama 3.1
scaling. Inverse frequencies are computed with the same fp32 operations as transformers, so the cos/sin
tables match it bit for bit on the same device."""

import math

import torch

from engine.model_config import ModelConfig


def inv_freq(config: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:  # [head_dim // 2]
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    freqs = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return freqs
    if scaling["rope_type"] == "linear":
        return freqs / scaling["factor"]
    return _llama3_inv_freq(freqs, scaling)


def _llama3_inv_freq(freqs: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend the band between smoothly."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / factor, freqs)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_cache(
    config: ModelConfig, max_positions: int | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:  # [max_positions, head_dim] fp32: cos in the first half of each row, sin in the second
    """The table `apply_rope` indexes by position; built once per model, fp32 whatever the model dtype."""
    max_positions = max_positions or config.max_position_embeddings
    positions = torch.arange(max_positions, device=device, dtype=torch.float)
    freqs = positions[:, None] * inv_freq(config, device)[None, :]  # [P, head_dim // 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [T] int
    cos_sin: torch.Tensor,  # [max_positions, head_dim] from cos_sin_cache
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their positions; computed in fp32, returned in the inputs' dtypes."""
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # each [T, head_dim // 2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)  # each [T, H, head_dim // 2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
