"""Compiling PEFT adapters into the canonical artifact, checked against peft's own merge_and_unload().

The oracle is peft itself: every adapter is made and merged by peft, and the artifact applied by hand
(W + scaling * B @ A for every layer and module) must give the weights peft merges.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from loraformat.errors import FailedPrecondition, InvalidArgument, StatusError
from loraformat.model_shapes import SUPPORTED_MODULES, ModelShape, module_path
from loraformat.peft_compile import CompiledAdapter, all_finite, compile_adapter, read_canonical
from loraformat.peft_config import parse_peft_config
from loraformat.safetensors_io import write_safetensors
from loramux.demo_model import write_llama_checkpoint
from loramux.testing.peft_adapters import make_peft_adapter

ALL = SUPPORTED_MODULES
MLP = ("gate_proj", "up_proj", "down_proj")
PEFT = "base_model.model.model.layers"
Q = f"{PEFT}.0.self_attn.q_proj"
Q_A = f"{Q}.lora_A.weight"
Q_B = f"{Q}.lora_B.weight"

# make_adapter caches by name for the whole session: these names are this file's own.
ADAPTERS = {
    "compile-plain": dict(target_modules=ALL, r=8, lora_alpha=16),
    "compile-patterns": dict(
        target_modules=ALL,
        r=8,
        lora_alpha=16,
        rank_pattern={"q_proj": 4, "model.layers.1.mlp.down_proj": 12},
        alpha_pattern={"v_proj": 7, r"layers\.0\.mlp\.up_proj": 40},
    ),
    "compile-rslora": dict(
        target_modules=ALL,
        r=8,
        lora_alpha=16,
        use_rslora=True,
        rank_pattern={"k_proj": 2},
        alpha_pattern={"o_proj": 3},
    ),
    "compile-mlp-only": dict(target_modules=MLP, r=4, lora_alpha=8),
    "compile-layer-1": dict(target_modules=("q_proj", "v_proj"), layers_to_transform=[1]),
    "compile-bf16": dict(target_modules=ALL, dtype=torch.bfloat16),
    "compile-fp16": dict(target_modules=ALL, dtype=torch.float16),
}
# Adapters made straight from LoraConfig, as the brief for real users goes (init_lora_weights=False).
INLINE_ADAPTERS = {
    "regex": dict(target_modules=r".*\.layers\.1\.self_attn\.(q|v)_proj", r=4, lora_alpha=8),
    "all-linear": dict(target_modules="all-linear", r=2, lora_alpha=5, rank_pattern={"gate_proj": 6}),
}


@pytest.fixture(scope="module")
def shape(tiny_llama_dir: Path) -> ModelShape:
    return ModelShape.from_config(json.loads((tiny_llama_dir / "config.json").read_text()))


@pytest.fixture(scope="module")
def adapter(make_adapter, tiny_llama_dir: Path, tmp_path_factory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name in ADAPTERS:
            return make_adapter(name, **ADAPTERS[name])
        if name not in made:
            made[name] = inline_adapter(
                tiny_llama_dir, tmp_path_factory.mktemp(name), **INLINE_ADAPTERS[name]
            )
        return made[name]

    return get


def inline_adapter(model_dir: Path, out_dir: Path, **lora_kwargs) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_kwargs))
    peft_model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def compile_dir(adapter_dir: Path, shape: ModelShape, out_path: Path, **kwargs) -> CompiledAdapter:
    kwargs = {"base_model": "tiny", "max_rank": 64} | kwargs
    config = (adapter_dir / "adapter_config.json").read_bytes()
    weights = adapter_dir / "adapter_model.safetensors"
    return compile_adapter(config, weights, shape, out_path=out_path, **kwargs)


def merged_weights(model_dir: Path, adapter_dir: Path) -> dict[str, torch.Tensor]:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().state_dict()


def assert_artifact_matches_merge(
    artifact: Path, adapter_dir: Path, model_dir: Path, shape: ModelShape
) -> int:
    """W + scaling * B @ A == peft's merge for every (layer, module); returns how many modules moved."""
    canonical = read_canonical(artifact, shape)
    base = load_file(model_dir / "model.safetensors")
    merged = merged_weights(model_dir, adapter_dir)
    num_adapted = 0
    for layer in range(shape.num_layers):
        for module in SUPPORTED_MODULES:
            key = f"{module_path(layer, module)}.weight"
            expected = base[key].double()  # W: [out_dim, in_dim]
            weights = canonical.module_weights(layer, module)
            if weights is not None:
                a, b = weights  # A: [R, in_dim], B: [out_dim, R]
                expected = expected + canonical.scaling * (b.double() @ a.double())
                num_adapted += 1
                assert not torch.equal(merged[key], base[key]), key  # the adapter really moves it
            torch.testing.assert_close(expected.float(), merged[key], atol=1e-5, rtol=0, msg=key)
    return num_adapted


# ---- (a) the artifact equals peft's merge ----

EXPECTED_ADAPTED = {
    "compile-plain": 14,
    "compile-patterns": 14,
    "compile-rslora": 14,
    "compile-mlp-only": 6,
    "compile-layer-1": 2,
    "compile-bf16": 14,
    "compile-fp16": 14,
    "regex": 2,
    "all-linear": 14,
}


@pytest.mark.parametrize("name", sorted(EXPECTED_ADAPTED))
def test_artifact_equals_peft_merge(
    name: str, adapter, tiny_llama_dir: Path, shape: ModelShape, tmp_path: Path
):
    adapter_dir = adapter(name)
    compile_dir(adapter_dir, shape, tmp_path / "artifact.safetensors")
    num_adapted = assert_artifact_matches_merge(
        tmp_path / "artifact.safetensors", adapter_dir, tiny_llama_dir, shape
    )
    assert num_adapted == EXPECTED_ADAPTED[name]


def test_qwen2_adapter_equals_peft_merge(tmp_path: Path):
    model_dir = write_llama_checkpoint(tmp_path / "qwen2", config={"model_type": "qwen2"})
    adapter_dir = make_peft_adapter(
        model_dir, tmp_path / "adapter", target_modules=ALL, rank_pattern={"v_proj": 3}
    )
    shape = ModelShape.from_config(json.loads((model_dir / "config.json").read_text()))
    compile_dir(adapter_dir, shape, tmp_path / "artifact.safetensors")
    assert (
        assert_artifact_matches_merge(tmp_path / "artifact.safetensors", adapter_dir, model_dir, shape) == 14
    )


def test_compiled_fields_and_metadata(adapter, shape: ModelShape, tmp_path: Path):
    compiled = compile_dir(  # a rank equal to the maximum is allowed
        adapter("compile-rslora"), shape, tmp_path / "a.safetensors", base_model="tiny-llama", max_rank=8
    )
    assert compiled.rank == 8 and compiled.alpha == 16.0 and compiled.scaling == 16 / math.sqrt(8)
    assert compiled.target_modules == ALL and compiled.num_layers == 2 and compiled.dtype == "float32"
    assert compiled.size_bytes == (tmp_path / "a.safetensors").stat().st_size
    assert read_canonical(tmp_path / "a.safetensors").metadata == {
        "format": "loramux.lora",
        "format_version": "1",
        "base_model": "tiny-llama",
        "num_layers": "2",
        "rank": "8",
        "alpha": "16.0",
        "scaling": repr(16 / math.sqrt(8)),
        "use_rslora": "true",
        "target_modules": ",".join(ALL),
    }
    canonical = read_canonical(tmp_path / "a.safetensors", shape)
    assert (canonical.base_model, canonical.num_layers, canonical.rank) == ("tiny-llama", 2, 8)
    assert (canonical.alpha, canonical.scaling, canonical.use_rslora) == (16.0, 16 / math.sqrt(8), True)
    assert canonical.target_modules == ALL
    compile_dir(adapter("compile-plain"), shape, tmp_path / "plain.safetensors")
    assert read_canonical(tmp_path / "plain.safetensors").use_rslora is False


def test_rank_pattern_is_zero_padded_to_the_max_rank(adapter, shape: ModelShape, tmp_path: Path):
    compiled = compile_dir(adapter("compile-patterns"), shape, tmp_path / "a.safetensors")
    assert compiled.rank == 12  # model.layers.1.mlp.down_proj
    a, b = read_canonical(tmp_path / "a.safetensors").module_weights(0, "q_proj")
    assert a.shape == (12, 64) and b.shape == (64, 12)
    assert a[4:].count_nonzero() == 0 and b[:, 4:].count_nonzero() == 0
    assert a[:4].count_nonzero() > 0 and b[:, :4].count_nonzero() > 0


def test_rank_equal_to_hidden_size_pads_the_smaller_modules(adapter, shape: ModelShape, tmp_path: Path):
    """Max rank 64 == hidden_size: q_proj's A [8, 64] is square in neither sense and still gets padded."""

    def widen(weights: dict) -> dict:
        out = {}
        for name, t in weights.items():
            if ".q_proj." in name:
                out[name] = t
            elif ".lora_A." in name:
                out[name] = torch.cat([t, torch.zeros(64 - t.shape[0], t.shape[1])])
            else:
                out[name] = torch.cat([t, torch.zeros(t.shape[0], 64 - t.shape[1])], dim=1)
        return out

    config, weights = variant(
        adapter("compile-plain"), tmp_path, config={"r": 64, "lora_alpha": 128, "rank_pattern": {"q_proj": 8}},
        tensors=widen,
    )
    assert compile_adapter(config, weights, shape, base_model="t", max_rank=64, out_path=tmp_path / "a").rank == 64
    a, b = read_canonical(tmp_path / "a", shape).module_weights(0, "q_proj")
    assert a.shape == (64, 64) and b.shape == (64, 64)
    assert torch.equal(a[:8], load_file(weights)[Q_A]) and a[8:].count_nonzero() == 0


@pytest.mark.parametrize(("name", "dtype"), [("compile-bf16", "bfloat16"), ("compile-fp16", "float16")])
def test_source_dtype_is_kept(name: str, dtype: str, adapter, shape: ModelShape, tmp_path: Path):
    assert compile_dir(adapter(name), shape, tmp_path / "a.safetensors").dtype == dtype
    canonical = read_canonical(tmp_path / "a.safetensors")
    assert {str(t.dtype) for t in canonical.tensors.values()} == {f"torch.{dtype}"}


def test_mixed_dtypes_become_fp32(adapter, shape: ModelShape, tmp_path: Path):
    config, weights = variant(adapter("compile-plain"), tmp_path, tensors=lambda w: w | {Q_A: w[Q_A].half()})
    compiled = compile_adapter(config, weights, shape, base_model="t", max_rank=64, out_path=tmp_path / "a")
    assert compiled.dtype == "float32"
    assert torch.equal(
        read_canonical(tmp_path / "a").tensors["layers.0.q_proj.lora_A"], load_file(weights)[Q_A].float()
    )


def test_adapter_name_in_tensor_names_is_accepted(adapter, shape: ModelShape, tmp_path: Path):
    def with_adapter_name(w):
        return {k.replace(".weight", ".default.weight"): v for k, v in w.items()}

    plain = compile_dir(adapter("compile-plain"), shape, tmp_path / "plain")
    config, weights = variant(adapter("compile-plain"), tmp_path, tensors=with_adapter_name)
    named = compile_adapter(
        config, weights, shape, base_model="tiny", max_rank=64, out_path=tmp_path / "named"
    )
    assert named.digest == plain.digest


def test_targeted_module_missing_from_weights_contributes_zero(adapter, shape: ModelShape, tmp_path: Path):
    def drop_q_proj(weights: dict) -> dict:
        return {k: v for k, v in weights.items() if ".q_proj." not in k}

    config, weights = variant(adapter("compile-plain"), tmp_path, tensors=drop_q_proj)
    compiled = compile_adapter(config, weights, shape, base_model="t", max_rank=64, out_path=tmp_path / "a")
    canonical = read_canonical(tmp_path / "a", shape)
    assert compiled.target_modules == ALL and canonical.target_modules == ALL
    assert canonical.module_weights(0, "q_proj") is None and canonical.module_weights(1, "q_proj") is None
    assert len(canonical.tensors) == 2 * 2 * 6


@pytest.mark.parametrize("init", [True, False, "gaussian", "eva", "orthogonal"])
def test_inits_that_keep_base_weights_are_accepted(init, adapter, shape: ModelShape, tmp_path: Path):
    """init_lora_weights only says how training started: the trained weights compile to the very artifact
    of the plain adapter (same digest), neither refused nor altered."""
    config, weights = variant(adapter("compile-plain"), tmp_path, config={"init_lora_weights": init})
    compiled = compile_adapter(config, weights, shape, base_model="t", max_rank=64, out_path=tmp_path / "a")
    plain = compile_dir(adapter("compile-plain"), shape, tmp_path / "plain", base_model="t")
    assert compiled.digest == plain.digest
    assert (tmp_path / "a").read_bytes() == (tmp_path / "plain").read_bytes()


# ---- (c) determinism ----


def test_same_input_gives_same_bytes_and_digest(adapter, shape: ModelShape, tmp_path: Path):
    source = adapter("compile-patterns")
    renamed = shutil.copytree(source, tmp_path / "another-name")
    first = compile_dir(source, shape, tmp_path / "1.safetensors")
    second = compile_dir(renamed, shape, tmp_path / "2.safetensors")
    raw = (tmp_path / "1.safetensors").read_bytes()
    assert raw == (tmp_path / "2.safetensors").read_bytes()
    assert first == second
    assert first.digest == hashlib.sha256(raw).hexdigest() and first.size_bytes == len(raw)


def test_different_weights_give_different_digests(adapter, shape: ModelShape, tmp_path: Path):
    first = compile_dir(adapter("compile-plain"), shape, tmp_path / "1")
    config, weights = variant(adapter("compile-plain"), tmp_path, tensors=lambda w: w | {Q_B: w[Q_B] * 2})
    second = compile_adapter(config, weights, shape, base_model="tiny", max_rank=64, out_path=tmp_path / "2")
    assert first.digest != second.digest


# ---- (b) rejections: nothing is written ----


def variant(
    adapter_dir: Path,
    tmp_path: Path,
    config: dict | None = None,
    tensors: Callable[[dict], dict] | None = None,
    raw: Callable[[bytes], bytes] | None = None,
    weights_name: str = "adapter_model.safetensors",
) -> tuple[bytes, Path]:
    """A copy of a PEFT adapter with its config and weights changed: (config bytes, weights path)."""
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text()) | (config or {})
    cfg = {k: v for k, v in cfg.items() if v is not DELETE}
    source = adapter_dir / "adapter_model.safetensors"
    path = tmp_path / "in" / weights_name
    path.parent.mkdir(exist_ok=True)
    if tensors is not None:
        changed = tensors(load_file(source))
        save_file({name: t.contiguous().clone() for name, t in changed.items()}, path)
    else:
        path.write_bytes(raw(source.read_bytes()) if raw else source.read_bytes())
    return json.dumps(cfg).encode(), path


DELETE = object()


@dataclass(frozen=True)
class Bad:
    error: type[StatusError]
    offender: str  # must appear in the message
    config: dict = field(default_factory=dict)
    tensors: Callable[[dict], dict] | None = None
    raw: Callable[[bytes], bytes] | None = None
    config_raw: bytes | None = None
    max_rank: int = 64
    weights_name: str = "adapter_model.safetensors"


def rename_layer(weights: dict, layer: int) -> dict:
    return {k.replace(f"{PEFT}.0.", f"{PEFT}.{layer}."): v for k, v in weights.items()}


def set_value(tensor: torch.Tensor, value: float) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.view(-1)[3] = value
    return tensor


def without(*names: str) -> Callable[[dict], dict]:
    return lambda w: {k: v for k, v in w.items() if k not in names}


def with_tensors(**extra: torch.Tensor) -> Callable[[dict], dict]:
    return lambda w: w | {name.replace("__", "."): t for name, t in extra.items()}


def header_len(data: bytes) -> int:
    return struct.unpack("<Q", data[:8])[0]


def too_many_tensors(_: bytes) -> bytes:
    header = json.dumps(
        {f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(100_000)}
    )
    return struct.pack("<Q", len(header)) + header.encode() + b"\0" * 400_000


def corrupt_header(data: bytes) -> bytes:
    return data[:8] + b"\xff\x00garbage" + data[18:]


def claim_more_bytes(data: bytes) -> bytes:
    return struct.pack("<Q", len(data) + 1000) + data[8:]


ZEROS_A = torch.zeros(8, 64)
ZEROS_B = torch.zeros(64, 8)
UNSUPPORTED = {
    "use_dora": True,
    "bias": "all",
    "modules_to_save": ["lm_head"],
    "layer_replication": [[0, 2], [1, 2]],
    "loftq_config": {"loftq_bits": 4},
    "fan_in_fan_out": True,
    "lora_bias": True,
    "target_parameters": ["mlp.experts.down_proj"],
    "trainable_token_indices": [1, 2],
    "use_qalora": True,
    "alora_invocation_tokens": [5, 6],
    "megatron_config": {"tensor_model_parallel_size": 2},
    "kasa_config": {"r": 8},
}

BAD_ADAPTERS = {
    **{
        f"config_{key}": Bad(FailedPrecondition, key, config={key: value})
        for key, value in UNSUPPORTED.items()
    },
    "config_bias_lora_only": Bad(FailedPrecondition, "bias", config={"bias": "lora_only"}),
    **{
        f"config_init_{init}": Bad(
            FailedPrecondition, "init_lora_weights", config={"init_lora_weights": init}
        )
        for init in ("pissa", "pissa_niter_4", "olora", "loftq", "corda", "lora_ga")
    },
    "config_not_json": Bad(InvalidArgument, "adapter_config.json", config_raw=b"{not json"),
    "config_not_object": Bad(InvalidArgument, "adapter_config.json", config_raw=b"[1]"),
    "config_peft_type": Bad(FailedPrecondition, "peft_type", config={"peft_type": "IA3"}),
    "config_r_string": Bad(InvalidArgument, "'r'", config={"r": "8"}),
    "config_r_zero": Bad(InvalidArgument, "'r'", config={"r": 0}),
    "config_alpha_string": Bad(InvalidArgument, "lora_alpha", config={"lora_alpha": "16"}),
    "config_alpha_zero": Bad(InvalidArgument, "lora_alpha", config={"lora_alpha": 0}),
    "config_rank_pattern_zero": Bad(
        InvalidArgument, "rank_pattern['q_proj']", config={"rank_pattern": {"q_proj": 0}}
    ),
    "config_rank_pattern_regex": Bad(InvalidArgument, "rank_pattern['(']", config={"rank_pattern": {"(": 4}}),
    "config_alpha_pattern_nan": Bad(
        InvalidArgument, "alpha_pattern", config={"alpha_pattern": {"q_proj": "x"}}
    ),
    "config_use_dora_string": Bad(InvalidArgument, "use_dora", config={"use_dora": "yes"}),
    "config_target_missing": Bad(InvalidArgument, "target_modules", config={"target_modules": DELETE}),
    "target_lm_head": Bad(FailedPrecondition, "lm_head", config={"target_modules": ["q_proj", "lm_head"]}),
    "target_embed_tokens": Bad(
        FailedPrecondition, "embed_tokens", config={"target_modules": ["embed_tokens"]}
    ),
    "target_regex_lm_head": Bad(
        FailedPrecondition, "lm_head", config={"target_modules": ".*(q_proj|lm_head)"}
    ),
    "target_regex_container": Bad(
        FailedPrecondition, "model.layers.0.mlp", config={"target_modules": r"model\.layers\.\d+\.mlp"}
    ),
    "target_regex_nothing": Bad(FailedPrecondition, "target_modules", config={"target_modules": "nothing"}),
    "weights_nan": Bad(InvalidArgument, Q_B, tensors=lambda w: w | {Q_B: set_value(w[Q_B], math.nan)}),
    "weights_inf": Bad(InvalidArgument, Q_A, tensors=lambda w: w | {Q_A: set_value(w[Q_A], -math.inf)}),
    "weights_int8": Bad(
        InvalidArgument, f"{Q_A}': dtype 'I8'", tensors=lambda w: w | {Q_A: w[Q_A].to(torch.int8)}
    ),
    "weights_a_without_b": Bad(InvalidArgument, Q_A, tensors=without(Q_B)),
    "weights_b_without_a": Bad(InvalidArgument, Q_B, tensors=without(Q_A)),
    "weights_no_tensors": Bad(InvalidArgument, "holds no tensors", tensors=lambda w: {}),
    "weights_unknown_name": Bad(
        InvalidArgument,
        f"'some.tensor': not a LoRA weight (expected e.g. {Q_A!r})",
        tensors=lambda w: w | {"some.tensor": ZEROS_A},
    ),
    "weights_unknown_module": Bad(
        InvalidArgument, "foo_proj", tensors=lambda w: w | {Q_A.replace("q_proj", "foo_proj"): ZEROS_A}
    ),
    "weights_duplicate": Bad(
        InvalidArgument,
        "both lora_A",
        tensors=lambda w: w | {Q_A.replace(".weight", ".default.weight"): w[Q_A]},
    ),
    "weights_embedding": Bad(
        FailedPrecondition,
        "lora_embedding_A",
        tensors=lambda w: w | {"base_model.model.model.embed_tokens.lora_embedding_A": ZEROS_A},
    ),
    "weights_dora_magnitude": Bad(
        FailedPrecondition,
        "lora_magnitude_vector",
        tensors=lambda w: w | {f"{Q}.lora_magnitude_vector": torch.ones(64)},
    ),
    "weights_bias": Bad(
        FailedPrecondition, "lora_B.bias", tensors=lambda w: w | {f"{Q}.lora_B.bias": torch.zeros(64)}
    ),
    "weights_lm_head": Bad(
        FailedPrecondition,
        "lm_head",
        tensors=lambda w: (
            w
            | {
                "base_model.model.lm_head.lora_A.weight": ZEROS_A,
                "base_model.model.lm_head.lora_B.weight": ZEROS_B,
            }
        ),
    ),
    "weights_layer_out_of_range": Bad(FailedPrecondition, "layer 5", tensors=lambda w: rename_layer(w, 5)),
    "weights_layer_one_past_the_last": Bad(FailedPrecondition, "layer 2", tensors=lambda w: rename_layer(w, 2)),
    "weights_wrong_in_dim": Bad(
        FailedPrecondition, f"{Q_A}': shape [8, 63]", tensors=lambda w: w | {Q_A: w[Q_A][:, :63]}
    ),
    "weights_wrong_out_dim": Bad(
        FailedPrecondition, f"{Q_B}': shape [63, 8]", tensors=lambda w: w | {Q_B: w[Q_B][:63]}
    ),
    "weights_rank_disagrees": Bad(
        FailedPrecondition,
        "shape [4, 64] does not match the expected [8, 64]",
        tensors=lambda w: w | {Q_A: w[Q_A][:4], Q_B: w[Q_B][:, :4]},
    ),
    "weights_not_targeted": Bad(InvalidArgument, "mlp.down_proj", config={"target_modules": ["q_proj"]}),
    "rank_over_max": Bad(FailedPrecondition, "rank: 8", max_rank=4),
    "fold_overflows_fp16": Bad(
        FailedPrecondition,
        "overflows",
        config={"alpha_pattern": {"q_proj": 1e12}},
        tensors=lambda w: {k: v.half() for k, v in w.items()},
    ),
    "file_100k_tensors": Bad(InvalidArgument, "100000 tensors", raw=too_many_tensors),
    "file_truncated": Bad(InvalidArgument, "truncated", raw=lambda data: data[:-100]),
    "file_corrupted_header": Bad(InvalidArgument, "not valid JSON", raw=corrupt_header),
    "file_claims_more_bytes": Bad(InvalidArgument, "past the end of the file", raw=claim_more_bytes),
    "file_pickle": Bad(InvalidArgument, "adapter_model.bin: pickle", weights_name="adapter_model.bin"),
}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
def test_compile_rejects(case: str, adapter, shape: ModelShape, tmp_path: Path):
    bad = BAD_ADAPTERS[case]
    config, weights = variant(
        adapter("compile-plain"), tmp_path, bad.config, bad.tensors, bad.raw, bad.weights_name
    )
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(StatusError) as info:
        compile_adapter(
            bad.config_raw or config,
            weights,
            shape,
            base_model="tiny",
            max_rank=bad.max_rank,
            out_path=out_dir / "artifact.safetensors",
        )
    assert type(info.value) is bad.error, str(info.value)
    assert bad.offender in str(info.value)
    assert list(out_dir.iterdir()) == []  # neither the artifact nor a partial temporary file


REAL_BAD_ADAPTERS = {
    "compile-bad-dora": (dict(use_dora=True), "use_dora"),
    "compile-bad-bias": (dict(bias="all"), "bias"),
    "compile-bad-modules-to-save": (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    "compile-bad-pissa": (dict(init_lora_weights="pissa"), "init_lora_weights"),
    "compile-bad-embedding": (dict(target_modules=("q_proj", "embed_tokens")), "embed_tokens"),
    "compile-bad-lm-head": (dict(target_modules=("v_proj", "lm_head")), "lm_head"),
}


@pytest.mark.parametrize("name", sorted(REAL_BAD_ADAPTERS))
def test_compile_rejects_real_peft_adapters(name: str, make_adapter, shape: ModelShape, tmp_path: Path):
    kwargs, offender = REAL_BAD_ADAPTERS[name]
    with pytest.raises(FailedPrecondition, match=offender):
        compile_dir(make_adapter(name, **kwargs), shape, tmp_path / "artifact.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_parse_accepts_a_real_peft_config(adapter):
    spec = parse_peft_config((adapter("compile-patterns") / "adapter_config.json").read_bytes())
    assert spec.r == 8 and spec.lora_alpha == 16.0 and not spec.use_rslora
    assert spec.rank_of("model.layers.0.self_attn.q_proj") == 4
    assert spec.rank_of("model.layers.0.mlp.down_proj") == 8
    assert spec.rank_of("model.layers.1.mlp.down_proj") == 12
    assert spec.alpha_of("model.layers.1.self_attn.v_proj") == 7.0
    assert spec.alpha_of("model.layers.0.mlp.up_proj") == 40.0
    assert spec.alpha_of("model.layers.1.mlp.up_proj") == 16.0


# ---- the artifact reader ----


def test_read_canonical_checks_format_and_model(adapter, shape: ModelShape, tmp_path: Path):
    compile_dir(adapter("compile-plain"), shape, tmp_path / "a")
    canonical = read_canonical(tmp_path / "a")
    assert read_canonical((tmp_path / "a").read_bytes()).metadata == canonical.metadata
    deeper = ModelShape(**{**shape.__dict__, "num_layers": 3})
    with pytest.raises(FailedPrecondition, match="num_layers"):
        read_canonical(tmp_path / "a", deeper)
    wider = ModelShape(**{**shape.__dict__, "hidden_size": 128})
    with pytest.raises(FailedPrecondition, match=r"layers\.0\.down_proj\.lora_B.*\[128, 8\]"):
        read_canonical(tmp_path / "a", wider)
    write_safetensors(tmp_path / "b", canonical.tensors, canonical.metadata | {"format_version": "2"})
    with pytest.raises(InvalidArgument, match="format_version"):
        read_canonical(tmp_path / "b")
    half = {k: v for k, v in canonical.tensors.items() if k != "layers.1.v_proj.lora_B"}
    write_safetensors(tmp_path / "c", half, canonical.metadata)
    with pytest.raises(InvalidArgument, match=r"layers\.1\.v_proj\.lora_A"):
        read_canonical(tmp_path / "c")


def canonical_parts(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    canonical = read_canonical(path)
    return dict(canonical.tensors), dict(canonical.metadata)


def _a_and_b(layer: int, module: str, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    return {f"layers.{layer}.{module}.lora_A": a, f"layers.{layer}.{module}.lora_B": b}


BAD_ARTIFACTS = {
    "format": ({"format": "other.lora"}, {}, "metadata 'format' is 'other.lora'"),
    "rank_missing": ({"rank": None}, {}, "metadata 'rank' is missing"),
    "rank_not_a_number": ({"rank": "eight"}, {}, "metadata 'rank' has a bad value 'eight'"),
    "use_rslora_not_a_bool": ({"use_rslora": "yes"}, {}, "metadata 'use_rslora' has a bad value 'yes'"),
    "unknown_target_module": (
        {"target_modules": "q_proj,foo_proj"}, {}, "metadata 'target_modules' has a bad value"
    ),
    "module_not_a_target": (
        {"target_modules": "q_proj"}, {}, "does not name a target module"
    ),
    "not_a_canonical_name": ({}, {"bias": torch.zeros(8)}, "'bias' does not name"),
    "layer_one_past_the_last": (
        {}, _a_and_b(2, "q_proj", torch.zeros(8, 64), torch.zeros(64, 8)), "layer 2 is out of range (2)"
    ),
    "a_of_another_rank": (
        {}, _a_and_b(0, "q_proj", torch.zeros(4, 64), torch.zeros(64, 8)), "shape [4, 64], not 2-D with rank 8"
    ),
    "b_of_another_rank": (
        {}, _a_and_b(0, "q_proj", torch.zeros(8, 64), torch.zeros(64, 4)), "shape [64, 4], not 2-D with rank 8"
    ),
    "a_not_2d": (
        {}, _a_and_b(0, "q_proj", torch.zeros(8, 64, 1), torch.zeros(64, 8)), "shape [8, 64, 1], not 2-D"
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ARTIFACTS))
def test_read_canonical_rejects(case: str, adapter, shape: ModelShape, tmp_path: Path):
    metadata_changes, tensor_changes, message = BAD_ARTIFACTS[case]
    compile_dir(adapter("compile-plain"), shape, tmp_path / "a")
    tensors, metadata = canonical_parts(tmp_path / "a")
    metadata = {k: v for k, v in (metadata | metadata_changes).items() if v is not None}
    write_safetensors(tmp_path / "bad", tensors | tensor_changes, metadata)
    with pytest.raises(InvalidArgument) as info:
        read_canonical(tmp_path / "bad")
    assert type(info.value) is InvalidArgument and message in str(info.value)


def test_a_failed_write_leaves_nothing(adapter, shape: ModelShape, tmp_path: Path, monkeypatch):
    """A failure while the artifact is being written (a full disk) removes the partial file and is raised."""
    import loraformat.peft_compile as peft_compile

    def fail_midway(f, specs, produce, metadata):
        f.write(b"the first bytes")
        raise OSError("no space left on device")

    monkeypatch.setattr(peft_compile, "write_safetensors_lazy", fail_midway)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(OSError, match="no space left"):
        compile_dir(adapter("compile-plain"), shape, out_dir / "artifact.safetensors")
    assert list(out_dir.iterdir()) == []


# ---- model shapes ----

LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_model_shape_dims():
    shape = ModelShape.from_config(LLAMA)
    assert shape.head_dim == 16
    assert [shape.module_dims(m) for m in SUPPORTED_MODULES] == [
        (64, 64),
        (64, 32),
        (64, 32),
        (64, 64),
        (64, 176),
        (64, 176),
        (176, 64),
    ]
    wide_heads = ModelShape.from_config(LLAMA | {"head_dim": 32, "model_type": "mistral"})
    assert wide_heads.module_dims("q_proj") == (64, 128) and wide_heads.module_dims("o_proj") == (128, 64)


@pytest.mark.parametrize(
    ("change", "error", "offender"),
    [
        ({"model_type": "gpt2"}, FailedPrecondition, "model_type"),
        ({"model_type": None}, InvalidArgument, "model_type"),
        ({"hidden_size": "64"}, InvalidArgument, "hidden_size"),
        ({"num_hidden_layers": 0}, InvalidArgument, "num_hidden_layers"),
        ({"intermediate_size": True}, InvalidArgument, "intermediate_size"),
        ({"num_key_value_heads": 3}, InvalidArgument, "num_key_value_heads"),
        ({"num_attention_heads": DELETE}, InvalidArgument, "num_attention_heads"),
        ({"head_dim": -1}, InvalidArgument, "head_dim"),
    ],
)
def test_model_shape_rejects(change: dict, error: type, offender: str):
    cfg = {k: v for k, v in (LLAMA | change).items() if v is not DELETE}
    with pytest.raises(error) as info:
        ModelShape.from_config(cfg)
    assert type(info.value) is error and offender in str(info.value)


def test_artifacts_of_one_header_are_parsed_and_checked_once(adapter, shape: ModelShape, tmp_path: Path, monkeypatch):
    """Artifacts whose headers are the same bytes (one base model, rank, alpha and targets) share one
    parsed and checked header, each with its own tensors' bytes and its own metadata dict; the check
    against a model shape runs again for another shape; a header that fails is kept for nobody: each
    read of it fails, naming its own file."""
    import loraformat.peft_compile as peft_compile
    import loraformat.safetensors_io as safetensors_io

    headers = safetensors_io._ParsedHeaders(8)
    monkeypatch.setattr(safetensors_io, "_HEADERS", headers)
    checks = []
    real_check = peft_compile._check_canonical_tensors
    monkeypatch.setattr(peft_compile, "_check_canonical_tensors", lambda *args: checks.append(args[2]) or real_check(*args))
    compile_dir(adapter("compile-plain"), shape, tmp_path / "a")
    tensors, metadata = canonical_parts(tmp_path / "a")
    write_safetensors(tmp_path / "b", {k: v + 1 for k, v in tensors.items()}, metadata)  # other weights, one header
    checks.clear()
    a, b = read_canonical(tmp_path / "a", shape), read_canonical(bytearray((tmp_path / "b").read_bytes()), shape)
    assert checks == [shape] and headers.num_hits >= 1
    assert a.tensors.header is b.tensors.header
    assert all(torch.equal(b.tensors[name], a.tensors[name] + 1) for name in tensors)
    a.metadata["note"] = "mine"
    assert "note" not in b.metadata and "note" not in read_canonical(tmp_path / "b", shape).metadata
    deeper = ModelShape(**{**shape.__dict__, "num_layers": 3})
    with pytest.raises(FailedPrecondition, match="num_layers"):
        read_canonical(tmp_path / "b", deeper)
    assert checks == [shape, deeper]
    data = (tmp_path / "b").read_bytes()
    for name in ("c", "d"):  # b's header over a data region cut short
        (tmp_path / name).write_bytes(data[:-2])
        with pytest.raises(InvalidArgument, match=rf"^{name}: .*truncated"):
            read_canonical(tmp_path / name, shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8])
def test_all_finite_agrees_with_torch_isfinite(dtype: torch.dtype):
    """`all_finite` (the exponent-bit check uploads run) against torch.isfinite: random tensors, each
    with one NaN, +Inf or -Inf at a random place, contiguous and strided; the extreme finite values,
    subnormals and -0 pass."""
    gen = torch.Generator().manual_seed(7)
    for trial in range(30):
        t = (torch.randn(37, 21, generator=gen) * 10 ** (trial % 5)).to(dtype)
        if dtype.is_floating_point and trial % 3:
            t.view(-1)[torch.randint(t.numel(), (1,), generator=gen)] = (math.nan, math.inf, -math.inf)[trial % 3]
        for view in (t, t[:, 3], t.t(), t[::2, 1::3]):
            assert all_finite(view) == bool(torch.isfinite(view).all()), (trial, view.shape)
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        assert all_finite(torch.tensor([info.max, -info.max, info.tiny, info.tiny / 4, -0.0, 0.0], dtype=dtype))
        assert not all_finite(torch.tensor([1.0, info.max], dtype=torch.float64).to(dtype) * 2)  # overflows to Inf
