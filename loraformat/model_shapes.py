"""The shapes of a Llama-family base model, read from its Hugging Face `config.json`.

Pure code: the engine imports it too. Only the decoder projections that LoRA may target are described;
their names follow Hugging Face's module tree (`model.layers.{i}.self_attn.q_proj`, ...), which is the
tree PEFT names its tensors and patterns after.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from loraformat.errors import FailedPrecondition, InvalidArgument

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The submodule of a decoder layer that owns each projection.
MODULE_GROUPS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


# Submodules of a decoder layer that LoRA cannot adapt here; PEFT patterns may still match them.
_OTHER_LAYER_MODULES = (
    "",
    ".self_attn",
    ".mlp",
    ".mlp.act_fn",
    ".input_layernorm",
    ".post_attention_layernorm",
)
_OTHER_MODEL_MODULES = (
    "model",
    "model.embed_tokens",
    "model.layers",
    "model.norm",
    "model.rotary_emb",
    "lm_head",
)


def module_path(layer: int, module: str) -> str:
    """The module's name inside the causal-LM model, as PEFT matches patterns against it."""
    return f"model.layers.{layer}.{MODULE_GROUPS[module]}.{module}"


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModelShape:
        if not isinstance(cfg, dict):
            raise InvalidArgument("config: expected a JSON object")
        model_type = cfg.get("model_type")
        if not isinstance(model_type, str):
            raise InvalidArgument("config field 'model_type': missing or not a string")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise FailedPrecondition(
                f"config field 'model_type': {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        hidden_size = _positive_int(cfg, "hidden_size")
        num_heads = _positive_int(cfg, "num_attention_heads")
        num_kv_heads = _positive_int(cfg, "num_key_value_heads", default=num_heads)
        _check_divides(num_kv_heads, num_heads, "num_key_value_heads", "num_attention_heads")
        return cls(
            model_type=model_type,
            num_layers=_positive_int(cfg, "num_hidden_layers"),
            hidden_size=hidden_size,
            intermediate_size=_positive_int(cfg, "intermediate_size"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=_head_dim(cfg, hidden_size, num_heads),
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> ModelShape:
        """From the text of a config.json (the wire's `BaseModel.config_json`)."""
        try:
            cfg = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            raise InvalidArgument(f"config_json: not valid JSON ({err})") from None
        return cls.from_config(cfg)

    def module_dims(self, module: str) -> tuple[int, int]:
        """(in_dim, out_dim) of the projection: its weight is [out_dim, in_dim]."""
        q_dim = self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        dims = {
            "q_proj": (self.hidden_size, q_dim),
            "k_proj": (self.hidden_size, kv_dim),
            "v_proj": (self.hidden_size, kv_dim),
            "o_proj": (q_dim, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }
        if module not in dims:
            raise FailedPrecondition(
                f"module {module!r} is not supported (supported: {', '.join(SUPPORTED_MODULES)})"
            )
        return dims[module]

    def lora_module_paths(self) -> tuple[str, ...]:
        """The paths of every projection LoRA may adapt, layer by layer in SUPPORTED_MODULES order."""
        return tuple(module_path(i, m) for i in range(self.num_layers) for m in SUPPORTED_MODULES)

    def all_module_paths(self) -> tuple[str, ...]:
        """Every submodule name of the causal-LM model, as `named_modules()` lists them (root excluded):
        the same tree for llama, mistral and qwen2."""
        others = tuple(
            f"model.layers.{i}{suffix}" for i in range(self.num_layers) for suffix in _OTHER_LAYER_MODULES
        )
        return _OTHER_MODEL_MODULES + others + self.lora_module_paths()


def _positive_int(cfg: dict[str, Any], field: str, default: int | None = None) -> int:
    value = cfg.get(field, default)
    # bool is an int subclass; `true` is never a valid size.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(f"config field {field!r}: expected a positive integer, got {value!r}")
    if value <= 0:
        raise InvalidArgument(f"config field {field!r}: expected a positive integer, got {value}")
    return value


def _head_dim(cfg: dict[str, Any], hidden_size: int, num_heads: int) -> int:
    # Mistral configs may carry `"head_dim": null`, meaning the default hidden / heads.
    if cfg.get("head_dim") is not None:
        return _positive_int(cfg, "head_dim")
    _check_divides(num_heads, hidden_size, "num_attention_heads", "hidden_size")
    return hidden_size // num_heads


def _check_divides(divisor: int, value: int, divisor_field: str, value_field: str) -> None:
    if value % divisor:
        raise InvalidArgument(
            f"config field {divisor_field!r}: {divisor} does not divide {value_field} ({value})"
        )
