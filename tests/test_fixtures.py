"""The shared fixtures are what the oracle tests stand on: transformers and peft must read them as real."""

import json
import math
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from loramux.demo_model import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    TINY_LLAMA_CONFIG,
    build_tokenizer,
    write_llama_checkpoint,
)
from loramux.testing.peft_adapters import load_peft_model

PROMPT_IDS = torch.tensor([[BOS_TOKEN_ID, 54, 261, 505, 270, 437, 80, 286, 367]])  # [1, T]
TEXTS = [
    "Hello, world! 1234567890",
    "  leading spaces, trailing tabs\t\t\nand a second line",
    "A café where naïve Zoë orders crème brûlée for €4.50.",
    "日本語のテキスト, Ελληνικά, русский, עברית",
    "emoji: 😀🚀👍🏽🇯🇵 and a never-seen one: 🦩🫠",
    "control \x00\x01 bytes and a lone combining mark: e\u0301",
]
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}


def load_model(model_dir: Path) -> PreTrainedModel:
    """Load and fail if any checkpoint tensor is missing, unused or misshapen (transformers would
    otherwise initialize it randomly and only warn)."""
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def greedy(model, max_new_tokens: int = 16) -> list[int]:
    out = model.generate(PROMPT_IDS, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
    return out[0, PROMPT_IDS.shape[1] :].tolist()


def logits(model) -> torch.Tensor:  # [T, V]
    with torch.no_grad():
        return model(PROMPT_IDS).logits[0]


def safetensors_dtypes(path: Path) -> dict[str, torch.dtype]:
    with safe_open(path, "pt") as f:
        return {name: f.get_tensor(name).dtype for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)


@pytest.mark.parametrize(
    ("config", "architecture"),
    [
        ({}, "LlamaForCausalLM"),
        ({"model_type": "mistral"}, "MistralForCausalLM"),
        ({"model_type": "qwen2"}, "Qwen2ForCausalLM"),
        ({"tie_word_embeddings": True}, "LlamaForCausalLM"),
        ({"rope_scaling": LLAMA31_ROPE, "num_hidden_layers": 3}, "LlamaForCausalLM"),
    ],
    ids=["llama", "mistral", "qwen2", "tied", "llama31-rope"],
)
def test_checkpoint_loads_and_decodes_varied_tokens(tmp_path: Path, config: dict, architecture: str):
    model = load_model(write_llama_checkpoint(tmp_path, config=config))
    assert type(model).__name__ == architecture
    assert model.config.num_hidden_layers == config.get("num_hidden_layers", 2)
    assert model.config.rope_parameters["rope_type"] == config.get("rope_scaling", {}).get(
        "rope_type", "default"
    )
    assert len(set(greedy(model))) >= 4


def test_default_checkpoint_files_and_config(tiny_llama_dir: Path):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    assert {key: config[key] for key in TINY_LLAMA_CONFIG} == TINY_LLAMA_CONFIG
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 1, 2)
    generation = json.loads((tiny_llama_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    with safe_open(tiny_llama_dir / "model.safetensors", "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    assert len(shapes) == 3 + 9 * 2
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (512, 64)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (32, 64)  # 2 kv heads x head_dim 16
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (64, 176)


def test_sharded_checkpoint_has_same_weights(tmp_path: Path, tiny_llama_dir: Path):
    sharded = write_llama_checkpoint(tmp_path, num_shards=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert not (sharded / "model.safetensors").exists()
    with safe_open(tiny_llama_dir / "model.safetensors", "pt") as f:
        assert set(index["weight_map"]) == set(f.keys())
        num_params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
    assert index["metadata"]["total_size"] == 4 * num_params  # fp32
    assert torch.equal(logits(load_model(sharded)), logits(load_model(tiny_llama_dir)))


def test_qwen2_has_qkv_biases_and_tied_has_no_lm_head(tmp_path: Path):
    qwen2 = write_llama_checkpoint(tmp_path / "qwen2", config={"model_type": "qwen2"})
    names = safetensors_dtypes(qwen2 / "model.safetensors")
    assert {n for n in names if n.endswith(".bias")} == {
        f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in "qkv"
    }
    tied = write_llama_checkpoint(tmp_path / "tied", config={"tie_word_embeddings": True})
    assert "lm_head.weight" not in safetensors_dtypes(tied / "model.safetensors")
    model = load_model(tied)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_checkpoint_dtype(tmp_path: Path, dtype: torch.dtype):
    model_dir = write_llama_checkpoint(tmp_path, dtype=dtype)
    assert set(safetensors_dtypes(model_dir / "model.safetensors").values()) == {dtype}
    assert json.loads((model_dir / "config.json").read_text())["torch_dtype"] == str(dtype).removeprefix(
        "torch."
    )


def test_tokenizer_round_trips_and_matches_transformers(tiny_llama_dir: Path):
    tokenizer = build_tokenizer()
    hf_tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert [tokenizer.id_to_token(i) for i in range(3)] == ["<s>", "</s>", "<pad>"]
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id) == (
        BOS_TOKEN_ID,
        EOS_TOKEN_ID,
        PAD_TOKEN_ID,
    )
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        assert ids[0] == BOS_TOKEN_ID
        assert hf_tokenizer(text).input_ids == ids
        assert tokenizer.decode(ids) == text
        assert hf_tokenizer.decode(ids, skip_special_tokens=True) == text


def test_checkpoint_files_are_byte_deterministic(tmp_path: Path, tiny_llama_dir: Path):
    assert build_tokenizer().get_vocab_size() == 512
    again = write_llama_checkpoint(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"):
        assert (again / name).read_bytes() == (tiny_llama_dir / name).read_bytes(), name


def test_adapter_reloads_and_changes_logits(tiny_llama_dir: Path, make_adapter):
    adapter_dir = make_adapter("qv_r8")
    state = safetensors_dtypes(adapter_dir / "adapter_model.safetensors")
    assert len(state) == 2 * 2 * 2  # layers x (q, v) x (A, B)
    base = load_model(tiny_llama_dir)
    base_logits, base_tokens = logits(base), greedy(base)
    adapted = PeftModel.from_pretrained(base, adapter_dir).eval()  # injects LoRA layers into `base`
    adapter_logits = logits(adapted)
    assert adapter_logits.abs().max() < 10 * base_logits.abs().max()
    assert not torch.allclose(adapter_logits, base_logits, atol=1e-2)
    assert greedy(adapted) != base_tokens


def test_adapter_config_keeps_patterns_and_rslora(make_adapter):
    adapter_dir = make_adapter(
        "patterns",
        r=16,
        target_modules=("q_proj", "v_proj", "down_proj"),
        rank_pattern={"v_proj": 4},
        alpha_pattern={"down_proj": 64},
        use_rslora=True,
    )
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert (config["r"], config["rank_pattern"], config["alpha_pattern"]) == (
        16,
        {"v_proj": 4},
        {"down_proj": 64},
    )
    assert config["use_rslora"] is True
    with safe_open(adapter_dir / "adapter_model.safetensors", "pt") as f:
        v_b = f.get_tensor("base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight")
    assert v_b.shape == (32, 4)
    assert v_b.abs().min() > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_adapter_dtype(make_adapter, dtype: torch.dtype):
    adapter_dir = make_adapter(f"qv_{dtype}", dtype=dtype, seed=1)
    assert set(safetensors_dtypes(adapter_dir / "adapter_model.safetensors").values()) == {dtype}


def test_mixed_adapter_batch_matches_single_adapters(tiny_llama_dir: Path, make_adapter):
    dirs = {
        "one": make_adapter("qv_r8"),
        "two": make_adapter("all_r4", r=4, target_modules=ALL_MODULES, seed=2),
    }
    model = load_peft_model(tiny_llama_dir, dirs)
    batch = PROMPT_IDS.repeat(3, 1)  # [3, T]
    with torch.no_grad():
        mixed = model(batch, adapter_names=["one", "__base__", "two"]).logits  # [3, T, V]
        singles = []
        for name in ("one", "two"):
            model.set_adapter(name)
            singles.append(model(PROMPT_IDS).logits[0])
        with model.disable_adapter():
            base = model(PROMPT_IDS).logits[0]
    torch.testing.assert_close(mixed, torch.stack([singles[0], base, singles[1]]))
    assert not torch.allclose(singles[0], singles[1], atol=1e-2)
