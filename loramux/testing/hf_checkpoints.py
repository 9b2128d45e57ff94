"""Tiny random checkpoints written by transformers' own model classes, with the demo tokenizer.

Test-only (imports transformers): the checkpoint layout, names and config.json are transformers' own,
never our writer's, so loading them tests our reading of each family as the family ships.
"""

import math
from pathlib import Path

import torch
import transformers

from loramux.demo_model import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, write_demo_tokenizer

# family -> (config class, causal-LM class) in transformers
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
TINY = {
    "vocab_size": 512,  # the demo tokenizer's
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": PAD_TOKEN_ID,
}


def write_hf_checkpoint(out_dir: str | Path, family: str, *, seed: int = 0, **config) -> Path:
    """Build `family`'s transformers model from TINY <- `config`, draw its weights from `seed`, and
    `save_pretrained` it (safetensors) with the demo tokenizer into `out_dir`; return `out_dir`."""
    config_class, model_class = (getattr(transformers, name) for name in FAMILIES[family])
    hf_config = config_class(**(TINY | config))
    model = model_class(hf_config).eval()
    _randomize(model, seed)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    write_demo_tokenizer(out_dir, hf_config.max_position_embeddings, hf_config.vocab_size)
    return out_dir


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """The demo model's scales (loramux.demo_model._random_weights), so greedy tokens vary and every
    module matters: matrices ~ N(0, 1/in_dim), norms 1 + 0.1 noise, biases 0.1 noise."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            else:  # [out_dim, in_dim] linears and the [vocab, hidden] embedding alike
                param.copy_(noise / math.sqrt(param.shape[1]))
