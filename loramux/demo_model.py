"""A tiny demo model of a supported family (Llama, Mistral, Qwen2, Qwen3): a locally trained tokenizer and random weights on disk.

Everything here is generated, never downloaded. The same arguments always produce byte-identical files,
so tests, the embedded `loramux up` mode and benchmarks can share one checkpoint layout:

    out_dir/
      config.json, generation_config.json
      model.safetensors                      (num_shards == 1)
      model-0000k-of-0000n.safetensors       (num_shards == n > 1)
      model.safetensors.index.json           (num_shards > 1)
      tokenizer.json, tokenizer_config.json, special_tokens_map.json

Special tokens: `<s>` = 0 (bos), `</s>` = 1 (eos), `<pad>` = 2. Encoding prepends `<s>` like Llama's
tokenizers do. The tokenizer is byte-level, so any UTF-8 text round-trips through encode/decode.
"""

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from engine.named_shapes import LLAMA3_8B_CONFIG, TINY_LLAMA_CONFIG
from loraformat.architectures import Biases, spec_for_config

__all__ = [
    "LLAMA3_8B_CONFIG",
    "TINY_LLAMA_CONFIG",
    "build_tokenizer",
    "write_demo_adapter",
    "write_demo_tokenizer",
    "write_llama_checkpoint",
]

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<s>", "</s>", "<pad>"
BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID = 0, 1, 2
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # ids are the positions in this tuple
# A small chat template in the Zephyr style, so chat requests work on the demo model; it uses what real
# templates use (special tokens by name, raise_exception, whitespace control by trim/lstrip_blocks).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}\n"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant, not ' + message['role']) }}{% endif %}\n"
    "<|{{ message['role'] }}|>\n{{ message['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# TINY_LLAMA_CONFIG (engine.named_shapes) names these ids as its bos/eos/pad.

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Llama's bias and tensor-parallel flags mean nothing to the other families (Qwen2 always biases q/k/v),
# so their config.json, like the real ones, does not carry them.
_LLAMA_ONLY_KEYS = frozenset({"attention_bias", "mlp_bias", "pretraining_tp"})

# Keys a model type has beyond Llama's; None disables sliding windows so every family sees full context.
_MODEL_TYPE_DEFAULTS: dict[str, dict] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {"use_sliding_window": False, "sliding_window": None},
    "qwen3": {"use_sliding_window": False, "sliding_window": None, "attention_bias": False},
}

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

_CORPUS = """\
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! How vexingly
quick daft zebras jump; the five boxing wizards jump quickly. Sphinx of black quartz, judge my vow.

On Monday, 3 March 2025, the weather station recorded 12.5 mm of rain, a high of 18°C and a low of
7°C. By Friday the total had reached 41.75 mm. "Is that a record?" asked the reporter. "Not quite,"
said the meteorologist, "the record is 63.2 mm, set in 1987." Numbers such as 0, 1, 2, 42, 100, 256,
1024, 65536 and 3.14159 appear in almost every report; so do dates like 2024-12-31 and times like 09:45.

A small café on the corner serves crème brûlée, jalapeño omelettes and a naïve but charming piña
colada. The owner, Zoë, speaks French, Español and a little Deutsch: "Grüß Gott!" she says to
every Austrian guest. Her sister in Tokyo writes in 日本語 (にほんご) and sends postcards that say
こんにちは and ありがとう. Her cousin in Moscow writes Привет, мир, and a friend in Athens writes
Γειά σου κόσμε. Emoji fill their messages: 😀 🎉 🚀 ❤️ 👍🏽 🇯🇵 and the occasional 🤖.

def greet(name: str) -> str:
    \"\"\"Return a friendly greeting.\"\"\"
    if not name:
        raise ValueError("name must not be empty")
    return f"Hello, {name}!"

for i in range(10):
    print(i, i * i, greet("world"))

Language models read text as tokens. A tokenizer splits each sentence into pieces: common words
become one token, rare words become several, and any byte that was never seen still has a token of
its own. That is why this tokenizer can encode every string, even one it has never met, and decode it
back to exactly the same bytes. Serving many adapters at once means that the same prompt may be
continued in many different ways, one per adapter, while the base model stays the same.

In the morning the market opens at eight; by noon the stalls are crowded with apples, pears, plums,
cherries, onions, carrots, potatoes and bread. Children run between the tables while their parents
argue about prices (three for a dollar? two for €1.50?) and the old clockmaker repairs watches at
his bench. When the bells ring at six, everyone packs up, sweeps the square and goes home for dinner.

Questions & answers: What is 7 × 8? It is 56. What is 2^10? It is 1024. Is 17 prime? Yes. Is 21
prime? No, 21 = 3 × 7. Email support@example.com or visit https://example.org/docs?page=2#intro for
more; use the path /usr/local/bin and the variable $HOME; wrap lists in [brackets], maps in {braces}
and notes in <angle brackets>. 50% off — today only!
"""


def build_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Train a byte-level BPE tokenizer of exactly `vocab_size` tokens on the embedded corpus.

    Invariants: ids 0, 1, 2 are `<s>`, `</s>`, `<pad>`; the next 256 ids cover every byte, so no text
    needs an unknown token; the result (and its `to_str()`) is the same on every call and in every process.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"the corpus yields {tokenizer.get_vocab_size()} tokens, not {vocab_size}")
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
            ),
        ]
    )
    return tokenizer


def write_llama_checkpoint(
    out_dir: str | Path,
    *,
    config: dict | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    num_shards: int = 1,
    vocab_size: int = 512,
) -> Path:
    """Write a Hugging Face checkpoint with random weights and the demo tokenizer; return its directory.

    `config` overrides merge on top of TINY_LLAMA_CONFIG (plus the defaults of its `model_type`: llama,
    mistral, qwen2 or qwen3). The model's vocab_size is the tokenizer's unless `config` asks for a larger one.
    Weights depend only on (merged config, seed): dtype and num_shards change the files, not the values
    beyond rounding. Loadable offline by transformers' AutoModelForCausalLM and AutoTokenizer.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    merged = _merge_config(config or {}, tokenizer.get_vocab_size(), dtype)
    weights = _random_weights(merged, seed)
    _write_weights(out_dir, {name: t.to(dtype) for name, t in weights.items()}, num_shards)
    _write_json(out_dir / "config.json", merged)
    _write_json(out_dir / "generation_config.json", _generation_config(merged))
    _write_tokenizer(out_dir, tokenizer, merged["max_position_embeddings"])
    return out_dir


def _merge_config(overrides: dict, tokenizer_vocab_size: int, dtype: torch.dtype) -> dict:
    """TINY_LLAMA_CONFIG <- model-type defaults <- overrides, with architectures and dtype made consistent."""
    model_type = overrides.get("model_type", TINY_LLAMA_CONFIG["model_type"])
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"model_type must be one of {sorted(_ARCHITECTURES)}, got {model_type!r}")
    family_keys = {
        k: v for k, v in TINY_LLAMA_CONFIG.items() if model_type == "llama" or k not in _LLAMA_ONLY_KEYS
    }
    merged = {
        **family_keys,
        "vocab_size": tokenizer_vocab_size,
        "architectures": [_ARCHITECTURES[model_type]],
        "torch_dtype": _DTYPE_NAMES[dtype],
        **_MODEL_TYPE_DEFAULTS[model_type],
        **overrides,
    }
    if merged["vocab_size"] < tokenizer_vocab_size:
        raise ValueError(f"vocab_size {merged['vocab_size']} < tokenizer's {tokenizer_vocab_size}")
    return merged


def _tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a Llama-family checkpoint, in the order weights are drawn."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    linears = {  # name -> [out_dim, in_dim]
        "self_attn.q_proj": (q_dim, hidden),
        "self_attn.k_proj": (kv_dim, hidden),
        "self_attn.v_proj": (kv_dim, hidden),
        "self_attn.o_proj": (hidden, q_dim),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    arch = spec_for_config(config)
    biased = _biased_linears(arch.biases(config))
    head_dim = config["head_dim"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        for name, shape in linears.items():
            shapes[f"{prefix}.{name}.weight"] = shape
            if name in biased:
                shapes[f"{prefix}.{name}.bias"] = shape[:1]
        if arch.qk_norm:
            shapes[f"{prefix}.self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{prefix}.self_attn.k_norm.weight"] = (head_dim,)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _biased_linears(biases: Biases) -> set[str]:
    """Linears with a bias, as the family's spec reads them from the config."""
    biased = set()
    if biases.qkv:
        biased |= {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}
    if biases.o:
        biased.add("self_attn.o_proj")
    if biases.mlp:
        biased |= {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    return biased


def _random_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """fp32 weights drawn in `_tensor_shapes` order from one seeded generator.

    Matrices have std 1/sqrt(in_dim), so each layer's output has about unit RMS; the embedding has std
    1/sqrt(hidden_size), so its rows have about unit norm and the layers, not the current token, dominate
    the residual stream (with tied embeddings greedy decoding would otherwise repeat the last token).
    Logits then have std about 1. Norm weights are 1 plus small noise.
    """
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in _tensor_shapes(config).items():
        noise = torch.randn(shape, generator=generator)
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            weights[name] = 0.1 * noise
        else:  # [out_dim, in_dim] linears and the [vocab, hidden] embedding alike
            weights[name] = noise / math.sqrt(shape[1])
    return weights


def _write_weights(out_dir: Path, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    """model.safetensors, or num_shards contiguous slices of the tensor list plus the HF index."""
    if not 1 <= num_shards <= len(weights):
        raise ValueError(f"num_shards must be in [1, {len(weights)}], got {num_shards}")
    metadata = {"format": "pt"}
    if num_shards == 1:
        save_file(weights, out_dir / "model.safetensors", metadata=metadata)
        return
    names = list(weights)
    weight_map = {}
    for shard in range(num_shards):
        filename = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        shard_names = names[shard * len(names) // num_shards : (shard + 1) * len(names) // num_shards]
        save_file({name: weights[name] for name in shard_names}, out_dir / filename, metadata=metadata)
        weight_map |= dict.fromkeys(shard_names, filename)
    total_size = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out_dir / "model.safetensors.index.json", index)


def _generation_config(config: dict) -> dict:
    """No sampling settings: transformers' generate() is greedy by default, as the oracle tests need."""
    return {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}


def write_demo_tokenizer(out_dir: str | Path, model_max_length: int, vocab_size: int = 512) -> None:
    """The demo tokenizer's files into `out_dir`: for checkpoints written by other means (transformers'
    own classes in tests) that need a tokenizer the engine and transformers both read."""
    _write_tokenizer(Path(out_dir), build_tokenizer(vocab_size), model_max_length)


def _write_tokenizer(out_dir: Path, tokenizer: Tokenizer, model_max_length: int) -> None:
    """tokenizer.json plus the two small files transformers reads to name the special tokens."""
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": model_max_length,
        # Decoding must give back the exact text; HF's cleanup would turn "a ." into "a.".
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "special_tokens_map.json", special)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_demo_adapter(out_dir: str | Path, model_dir: str | Path, *, rank: int = 8, seed: int = 1) -> Path:
    """A PEFT LoRA adapter of the model in model_dir, written without peft: adapter_config.json and
    adapter_model.safetensors with PEFT's tensor names, random A and a non-zero B on q_proj and v_proj
    of every layer, scaled to change the demo model's greedy tokens visibly."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    outs = {"q_proj": heads * head_dim, "v_proj": config.get("num_key_value_heads", heads) * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out_dim in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) / hidden**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_dim, rank, generator=gen) * 0.5 / rank**0.5
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": sorted(outs),
        "lora_dropout": 0.0,
        "bias": "none",
    }
    _write_json(out_dir / "adapter_config.json", adapter_config)
    return out_dir
