"""Qwen3 and Mistral against transformers + peft at TP=1: checkpoints written by transformers' own
classes, adapters made by peft (mixed ranks, rank_pattern/alpha_pattern, rsLoRA); a batch mixing the
base model and every adapter, with fewer slots than adapters, gives peft's greedy tokens and logits.
Architectures loramux does not serve are refused at engine start with one line naming them."""

from __future__ import annotations

import json

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from loraformat.errors import FailedPrecondition
from loramux.shell.cli import main
from tests.engine.test_lora_parity import (
    ADAPTERS,
    NUM_TOKENS,
    PROMPTS,
    assert_mixed_batch_logits_match,
    peft_greedy,
    run_all,
)

# family -> write_hf_checkpoint config: Qwen3 with head_dim 32 != hidden 64 / 4 heads and tied
# embeddings (as its small sizes ship); Mistral with its default head_dim and sliding window
FAMILIES = {
    "qwen3": {"head_dim": 32, "tie_word_embeddings": True},
    "mistral": {},
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(model_dir, adapter dirs by name, peft model with every adapter), built once per family."""
    from loramux.testing.hf_checkpoints import write_hf_checkpoint
    from loramux.testing.peft_adapters import load_peft_model, make_peft_adapter

    root = tmp_path_factory.mktemp(request.param)
    model_dir = write_hf_checkpoint(root / "model", request.param, seed=3, **FAMILIES[request.param])
    adapters = {name: make_peft_adapter(model_dir, root / name, **kwargs) for name, kwargs in ADAPTERS.items()}
    return model_dir, adapters, load_peft_model(model_dir, adapters)


def make_core(model_dir, adapters, tmp_path, max_loras_per_batch: int, tensor_parallel_size: int = 1) -> EngineCore:
    config = EngineConfig(
        tensor_parallel_size=tensor_parallel_size,
        model_dir=str(model_dir),
        adapters=tuple((name, str(path)) for name, path in adapters.items()),
        work_dir=str(tmp_path),
        max_lora_rank=64,
        max_loras_per_batch=max_loras_per_batch,
    )
    return EngineCore.build(config)


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])  # 2: a spawned rank over gloo, S-LoRA slot shards
def test_mixed_batch_with_evictions_matches_peft(family, tmp_path, tensor_parallel_size):
    from transformers import AutoTokenizer

    model_dir, adapters, peft_model = family
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    core = make_core(model_dir, adapters, tmp_path, max_loras_per_batch=3, tensor_parallel_size=tensor_parallel_size)  # 5 adapters, 3 slots
    try:
        assert core.model_config.arch.family == json.loads((model_dir / "config.json").read_text())["model_type"]
        jobs = [(p, a) for p in PROMPTS[:2] for a in ["", *ADAPTERS]]
        for (tokens, final), (prompt, adapter) in zip(run_all(core, jobs), jobs, strict=True):
            assert tokens == peft_greedy(peft_model, tokenizer, prompt, adapter), (prompt, adapter)
            assert final.completion_tokens == NUM_TOKENS
        assert core.lora.slots.num_evictions > 0
    finally:
        core.close()
    base = peft_greedy(peft_model, tokenizer, PROMPTS[0], "")
    assert all(peft_greedy(peft_model, tokenizer, PROMPTS[0], a) != base for a in ADAPTERS)  # adapters matter


def test_mixed_batch_logits_match_peft(family, tmp_path):
    from transformers import AutoTokenizer

    model_dir, adapters, peft_model = family
    core = make_core(model_dir, adapters, tmp_path, max_loras_per_batch=len(ADAPTERS))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    names = ["", "attn", "patterns", "rslora", "mlp", "all"]
    prompts = [tokenizer(PROMPTS[i % len(PROMPTS)]).input_ids for i in range(len(names))]
    assert_mixed_batch_logits_match(core, peft_model, names, prompts)


def test_qwen3_model_has_per_head_qk_norms(family):
    model_dir, _, _ = family
    from engine.weights import load_model

    model, config = load_model(model_dir)
    attn = model.layers[0].self_attn
    if config.arch.family == "qwen3":
        assert attn.q_norm.weight.shape == (config.head_dim,) == (32,) and model.lm_head is None
        assert config.q_size == 128 != config.hidden_size  # head_dim independent of hidden / heads
    else:
        assert not hasattr(attn, "q_norm")


UNSUPPORTED = {
    "qwen3_moe": (["Qwen3MoeForCausalLM"], "mixture-of-experts"),
    "mixtral": (["MixtralForCausalLM"], "mixture-of-experts"),
    "gpt2": (["GPT2LMHeadModel"], "GPT2LMHeadModel"),
}


@pytest.mark.parametrize("model_type", list(UNSUPPORTED))
def test_unsupported_architecture_is_refused_at_engine_start(model_type, tiny_llama_dir, tmp_path, capsys):
    architectures, reason = UNSUPPORTED[model_type]
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config |= {"model_type": model_type, "architectures": architectures}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(FailedPrecondition) as info:
        EngineCore.build(EngineConfig(model_dir=str(model_dir), work_dir=str(tmp_path)))
    assert architectures[0] in str(info.value) and reason in str(info.value)
    assert main(["engine", "serve", "--model", str(model_dir), "--port", "0"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: FAILED_PRECONDITION: architecture ")
    assert architectures[0] in lines[-1] and "Qwen3ForCausalLM" in lines[-1]  # names it and what is served
