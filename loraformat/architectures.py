"""Architecture specs: what loramux knows of each model family, as pure frozen data.

One `ArchSpec` per family answers, for the registry (adapter validation, `RegisterBaseModel`) and the
engine (config, weights, slot layout, model): which Hugging Face `architectures`/`model_type` it serves,
which projections LoRA may target and their (in, out) widths, how those projections fuse into the
engine's four targets and how each target splits under tensor parallelism, how checkpoint tensors map
onto the fused parameters, and the extra modules a family has (biases, q/k norms).

A new dense family is one spec here plus one small model file in `engine/models/`. Anything else
(mixture-of-experts included) is refused by `spec_for_config` with one line naming it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from loraformat.errors import FailedPrecondition, InvalidArgument


class Split(enum.Enum):
    """How a fused target is sharded across tensor-parallel ranks (Megatron/S-LoRA layout)."""

    COLUMN = "column"  # output features split; each rank holds whole inputs (q/k/v, gate/up)
    ROW = "row"  # input features split; the partial outputs are summed by an all-reduce (o, down)


class Dims:
    """What a projection's width is read from, mixed into the registry's ModelShape and the engine's
    ModelConfig (both dataclasses with these fields): the attention widths are derived here, once."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class Projection:
    """A linear LoRA may target, by its Hugging Face/PEFT module name.

    Its weight is [out_dim, in_dim]; `in_dim`/`out_dim` name the `Dims` field that gives each width."""

    name: str  # q_proj
    group: str  # the decoder-layer submodule that owns it: self_attn | mlp
    in_dim: str  # hidden_size | q_size | intermediate_size
    out_dim: str  # hidden_size | q_size | kv_size | intermediate_size

    def dims(self, dims: Dims) -> tuple[int, int]:
        return getattr(dims, self.in_dim), getattr(dims, self.out_dim)


@dataclass(frozen=True)
class FusedTarget:
    """Projections sharing one input, stacked along the output in the engine's one fused linear.

    `param` is that linear's name inside a decoder layer; the checkpoint tensors
    `model.layers.{i}.{group}.{module}.{weight|bias}` of `modules`, concatenated in order along the
    output dimension, are its weight and bias."""

    name: str  # qkv | o | gate_up | down: the LoRA slot target
    modules: tuple[str, ...]  # projection names in output-row order
    param: str  # self_attn.qkv_proj
    split: Split


DENSE_PROJECTIONS = (
    Projection("q_proj", "self_attn", "hidden_size", "q_size"),
    Projection("k_proj", "self_attn", "hidden_size", "kv_size"),
    Projection("v_proj", "self_attn", "hidden_size", "kv_size"),
    Projection("o_proj", "self_attn", "q_size", "hidden_size"),
    Projection("gate_proj", "mlp", "hidden_size", "intermediate_size"),
    Projection("up_proj", "mlp", "hidden_size", "intermediate_size"),
    Projection("down_proj", "mlp", "intermediate_size", "hidden_size"),
)

DENSE_FUSED = (
    FusedTarget("qkv", ("q_proj", "k_proj", "v_proj"), "self_attn.qkv_proj", Split.COLUMN),
    FusedTarget("o", ("o_proj",), "self_attn.o_proj", Split.ROW),
    FusedTarget("gate_up", ("gate_proj", "up_proj"), "mlp.gate_up_proj", Split.COLUMN),
    FusedTarget("down", ("down_proj",), "mlp.down_proj", Split.ROW),
)

# Submodules of every dense decoder layer that LoRA cannot adapt here; PEFT patterns may still match them.
_DENSE_OTHER_LAYER_MODULES = (
    "",
    ".self_attn",
    ".mlp",
    ".mlp.act_fn",
    ".input_layernorm",
    ".post_attention_layernorm",
)


@dataclass(frozen=True)
class Biases:
    qkv: bool
    o: bool
    mlp: bool


@dataclass(frozen=True)
class ArchSpec:
    family: str  # the name users see: llama | mistral | qwen2 | qwen3
    model_types: tuple[str, ...]  # config.json `model_type` values it answers to
    architectures: tuple[str, ...]  # config.json `architectures` entries it answers to
    model_file: str  # the key of its model class in engine/models (families may share one)
    # Biases: True/False fixed by the family, None read from config.json (`attention_bias` for q/k/v and
    # o, `mlp_bias` for the MLP), as transformers' modelling code of the family does.
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    mlp_bias: bool | None = False
    # RMSNorm over head_dim on each head of q and k, after the projection and before RoPE (Qwen3).
    qk_norm: bool = False
    # config.json's `sliding_window` applies only when `use_sliding_window` is true (Qwen2/Qwen3).
    window_needs_flag: bool = False
    projections: tuple[Projection, ...] = field(default=DENSE_PROJECTIONS, repr=False)
    fused: tuple[FusedTarget, ...] = field(default=DENSE_FUSED, repr=False)

    @property
    def lora_modules(self) -> tuple[str, ...]:
        """Projection names, in the canonical order of the artifact and of PEFT targets."""
        return tuple(p.name for p in self.projections)

    @property
    def other_layer_modules(self) -> tuple[str, ...]:
        """Suffixes (after `model.layers.{i}`) of the layer's submodules that LoRA cannot adapt."""
        norms = (".self_attn.q_norm", ".self_attn.k_norm") if self.qk_norm else ()
        return _DENSE_OTHER_LAYER_MODULES + norms

    def projection(self, name: str) -> Projection:
        for p in self.projections:
            if p.name == name:
                return p
        raise FailedPrecondition(
            f"module {name!r} is not supported (supported: {', '.join(self.lora_modules)})"
        )

    def biases(self, cfg: dict[str, Any]) -> Biases:
        attention_bias = bool(cfg.get("attention_bias", False))
        return Biases(
            qkv=attention_bias if self.qkv_bias is None else self.qkv_bias,
            o=attention_bias if self.o_bias is None else self.o_bias,
            mlp=bool(cfg.get("mlp_bias", False)) if self.mlp_bias is None else self.mlp_bias,
        )


LLAMA = ArchSpec(
    family="llama",
    model_types=("llama",),
    architectures=("LlamaForCausalLM",),
    model_file="llama",
    mlp_bias=None,
)
MISTRAL = ArchSpec(
    family="mistral",
    model_types=("mistral",),
    architectures=("MistralForCausalLM",),
    model_file="llama",  # the Llama decoder; its sliding window is stored, not applied
    qkv_bias=False,
    o_bias=False,
)
QWEN2 = ArchSpec(
    family="qwen2",
    model_types=("qwen2",),
    architectures=("Qwen2ForCausalLM",),
    model_file="llama",  # the Llama decoder with q/k/v biases
    qkv_bias=True,
    o_bias=False,
    window_needs_flag=True,
)
QWEN3 = ArchSpec(
    family="qwen3",
    model_types=("qwen3",),
    architectures=("Qwen3ForCausalLM",),
    model_file="qwen3",
    qk_norm=True,
    window_needs_flag=True,
)

SPECS: tuple[ArchSpec, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3)
_BY_MODEL_TYPE = {model_type: spec for spec in SPECS for model_type in spec.model_types}
_ARCHITECTURES = frozenset(a for spec in SPECS for a in spec.architectures)
# The MoE families users try first; named so the refusal says why rather than only "unknown".
_MOE_HINTS = ("moe", "mixtral", "deepseek", "dbrx", "jamba", "arctic", "olmoe")


def spec_for_config(cfg: dict[str, Any]) -> ArchSpec:
    """The spec of a config.json dict; FailedPrecondition with one line naming an unsupported one."""
    if not isinstance(cfg, dict):
        raise InvalidArgument("config: expected a JSON object")
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str):
        raise InvalidArgument("config field 'model_type': missing or not a string")
    architectures = cfg.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise InvalidArgument("config field 'architectures': expected a list of strings")
    # model_type picks the family, as transformers' Auto classes do; an architecture no family serves (a
    # different head, an MoE variant) is refused even under a known model_type.
    spec = _BY_MODEL_TYPE.get(model_type)
    unknown = [a for a in architectures if a not in _ARCHITECTURES]
    if spec is None or unknown:
        raise FailedPrecondition(unsupported_line(model_type, unknown or architectures, cfg))
    return spec


def unsupported_line(model_type: str, architectures: list[str], cfg: dict[str, Any]) -> str:
    named = f"{architectures[0][:64]} (model_type {model_type[:64]!r})" if architectures else f"model_type {model_type[:64]!r}"
    served = ", ".join(a for spec in SPECS for a in spec.architectures)
    is_moe = any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts")) or any(
        hint in name.lower() for hint in _MOE_HINTS for name in (model_type, *architectures)
    )
    why = ": mixture-of-experts models are not served yet" if is_moe else ""
    return f"architecture {named} is not supported{why} (loramux serves the dense {served})"
