"""Named model shapes for random weights (benchmarks, tests): config.json dicts and their ModelConfigs.

Pure data: the demo checkpoint writer (loramux.demo_model) writes TINY_LLAMA_CONFIG with its tokenizer,
whose special ids are <s> = 0, </s> = 1, <pad> = 2.
"""

from engine.model_config import ModelConfig

TINY_LLAMA_CONFIG: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 176,  # not a power of two on purpose: kernels must not assume one
    "max_position_embeddings": 512,
    "mlp_bias": False,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-5,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
    "vocab_size": 512,
}

# config.json of meta-llama/Meta-Llama-3-8B, for benchmark shapes only: never write these weights in tests.
LLAMA3_8B_CONFIG: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-5,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}


NAMED_SHAPES: dict[str, ModelConfig] = {
    "tiny": ModelConfig.from_hf(TINY_LLAMA_CONFIG),
    "llama3-8b": ModelConfig.from_hf(LLAMA3_8B_CONFIG),
}
