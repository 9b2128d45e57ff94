"""Architecture specs: one lookup for the registry and the engine; Qwen3 adapters compiled exactly and
checked against the Qwen3 shape; unsupported architectures refused with one line naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.lora_pool import fused_targets
from engine.model_config import ModelConfig
from loraformat.architectures import LLAMA, MISTRAL, QWEN2, QWEN3, SPECS, Split, spec_for_config
from loraformat.errors import FailedPrecondition, InvalidArgument
from loraformat.model_shapes import ModelShape
from loraformat.peft_config import parse_peft_config, resolve_targets
from tests.loraformat.test_peft_compile import ALL, assert_artifact_matches_merge, compile_dir

QWEN3_CONFIG = {"head_dim": 32, "tie_word_embeddings": True}  # head_dim != hidden 64 / 4 heads


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    from loramux.testing.hf_checkpoints import write_hf_checkpoint

    return write_hf_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=4, **QWEN3_CONFIG)


@pytest.fixture(scope="module")
def qwen3_adapter(qwen3_dir, tmp_path_factory) -> Path:
    from loramux.testing.peft_adapters import make_peft_adapter

    return make_peft_adapter(
        qwen3_dir,
        tmp_path_factory.mktemp("qwen3-adapter"),
        r=8,
        lora_alpha=16,
        target_modules=ALL,
        rank_pattern={"v_proj": 3, "model.layers.1.mlp.down_proj": 12},
        alpha_pattern={"o_proj": 4},
        use_rslora=True,
        seed=21,
    )


def shape_of(model_dir: Path, **overrides) -> ModelShape:
    return ModelShape.from_config(json.loads((model_dir / "config.json").read_text()) | overrides)


def test_each_family_answers_to_its_names_and_the_fused_layout_is_shared():
    for spec, model_type, arch in [
        (LLAMA, "llama", "LlamaForCausalLM"),
        (MISTRAL, "mistral", "MistralForCausalLM"),
        (QWEN2, "qwen2", "Qwen2ForCausalLM"),
        (QWEN3, "qwen3", "Qwen3ForCausalLM"),
    ]:
        assert spec_for_config({"model_type": model_type, "architectures": [arch]}) is spec
    for spec in SPECS:
        assert {t.name: t.split for t in spec.fused} == {
            "qkv": Split.COLUMN, "gate_up": Split.COLUMN, "o": Split.ROW, "down": Split.ROW
        }  # fmt: skip
        assert sorted(m for t in spec.fused for m in t.modules) == sorted(spec.lora_modules)
    assert QWEN3.qk_norm and not LLAMA.qk_norm and QWEN2.biases({}).qkv and not QWEN3.biases({}).qkv
    assert QWEN3.biases({"attention_bias": True}).o and not QWEN2.biases({"attention_bias": True}).o


def test_registry_shape_and_engine_slots_read_the_same_spec(qwen3_dir: Path):
    shape = shape_of(qwen3_dir)
    config = ModelConfig.from_hf(json.loads((qwen3_dir / "config.json").read_text()))
    assert shape.arch is config.arch is QWEN3
    assert shape.module_dims("q_proj") == (64, 128) and shape.module_dims("o_proj") == (128, 64)
    assert shape.module_dims("k_proj") == (64, 64)
    for target in fused_targets(config):  # the slot layout is the registry's widths, stacked
        dims = [shape.module_dims(m) for m in target.modules]
        assert target.in_dim == dims[0][0] and target.out_dim == sum(out for _, out in dims)
    assert "model.layers.1.self_attn.q_norm" in shape.all_module_paths()
    assert "model.layers.1.self_attn.q_norm" not in shape.lora_module_paths()


def test_qwen3_adapter_compiles_to_peft_merge(qwen3_dir: Path, qwen3_adapter: Path, tmp_path: Path):
    shape = shape_of(qwen3_dir)
    compiled = compile_dir(qwen3_adapter, shape, tmp_path / "artifact.safetensors")
    assert compiled.rank == 12
    assert assert_artifact_matches_merge(tmp_path / "artifact.safetensors", qwen3_adapter, qwen3_dir, shape) == 14


@pytest.mark.parametrize(
    "overrides",
    [
        {"head_dim": 16},  # a Qwen3 whose heads are narrower: q/k/v/o shapes disagree
        {"intermediate_size": 128},
        {"num_hidden_layers": 1},
    ],
)
def test_qwen3_adapter_is_refused_on_a_mismatched_base(qwen3_dir, qwen3_adapter, tmp_path, overrides):
    with pytest.raises(FailedPrecondition, match=r"shape|layer"):
        compile_dir(qwen3_adapter, shape_of(qwen3_dir, **overrides), tmp_path / "artifact.safetensors")
    assert not (tmp_path / "artifact.safetensors").exists()


def test_a_pattern_reaching_qwen3_qk_norms_is_refused(qwen3_dir, qwen3_adapter, tiny_llama_dir, tmp_path):
    """The spec's extra modules are part of the tree PEFT patterns match: the same regex is fine on Llama
    (it matches q/k/v/o only) and refused on Qwen3, where it also reaches the q/k norms."""
    config = json.loads((qwen3_adapter / "adapter_config.json").read_text())
    config["target_modules"] = r".*\.self_attn\..*"
    adapter = tmp_path / "regex"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    (adapter / "adapter_model.safetensors").write_bytes((qwen3_adapter / "adapter_model.safetensors").read_bytes())
    with pytest.raises(FailedPrecondition, match=r"self_attn\.k_norm' is not a supported module"):
        compile_dir(adapter, shape_of(qwen3_dir), tmp_path / "a.safetensors")
    on_llama = resolve_targets(parse_peft_config(json.dumps(config).encode()), shape_of(tiny_llama_dir))
    assert {p.rsplit(".", 1)[1] for p in on_llama} == {"q_proj", "k_proj", "v_proj", "o_proj"}


@pytest.mark.parametrize(
    ("config", "needles"),
    [
        ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}, ["Qwen3MoeForCausalLM", "mixture-of-experts"]),
        ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}, ["MixtralForCausalLM", "mixture-of-experts"]),
        ({"model_type": "qwen3", "architectures": ["Qwen3ForSequenceClassification"]}, ["Qwen3ForSequenceClassification"]),
        ({"model_type": "gpt2"}, ["model_type 'gpt2'"]),
    ],
)
def test_unsupported_architecture_is_one_line_naming_it(config, needles):
    with pytest.raises(FailedPrecondition) as info:
        ModelShape.from_config(config | {"hidden_size": 64, "num_attention_heads": 4})
    message = str(info.value)
    assert "\n" not in message and message.startswith("architecture ") and "Qwen3ForCausalLM" in message
    assert all(needle in message for needle in needles), message


def test_architectures_must_be_a_list_of_names():
    with pytest.raises(InvalidArgument, match="architectures"):
        spec_for_config({"model_type": "llama", "architectures": "LlamaForCausalLM"})
