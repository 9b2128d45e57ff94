"""The shapes of a base model, read from its Hugging Face `config.json`, with its architecture spec.

Pure code: the registry and the engine both import it. Only the decoder projections that LoRA may target
are described; their names follow Hugging Face's module tree (`model.layers.{i}.self_attn.q_proj`, ...),
which is the tree PEFT names its tensors and patterns after. Which projections exist and their widths
come from the family's `ArchSpec` (loraformat.architectures).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraformat import bounded_json
from loraformat.architectures import DENSE_PROJECTIONS, ArchSpec, Dims, spec_for_config
from loraformat.errors import InvalidArgument, quote

# Plausibility bounds on a base model's config: several times the largest open models of these
# families (405B: 126 layers, hidden 16384, intermediate 53248, 128 heads; vocabularies up to 256k),
# so no real model is refused, while a config claiming 200000 layers cannot make a small adapter cost
# seconds and hundreds of MB of module paths to validate.
MAX_CONFIG_VALUES = {
    "num_hidden_layers": 1024,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 19,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 4096,
    "vocab_size": 1 << 22,
}

# Every supported family has the dense projection set; a family with another set reads its spec's.
SUPPORTED_MODULES = tuple(p.name for p in DENSE_PROJECTIONS)
MODULE_GROUPS = {p.name: p.group for p in DENSE_PROJECTIONS}

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
class ModelShape(Dims):
    arch: ArchSpec
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModelShape:
        arch = spec_for_config(cfg)  # refuses unsupported architectures with one line naming them
        if "vocab_size" in cfg:
            _positive_int(cfg, "vocab_size")
        hidden_size = _positive_int(cfg, "hidden_size")
        num_heads = _positive_int(cfg, "num_attention_heads")
        num_kv_heads = _positive_int(cfg, "num_key_value_heads", default=num_heads)
        _check_divides(num_kv_heads, num_heads, "num_key_value_heads", "num_attention_heads")
        return cls(
            arch=arch,
            model_type=cfg["model_type"],
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
        cfg = bounded_json.loads(raw, "config_json")
        if not isinstance(cfg, dict):
            raise InvalidArgument("config_json must be a JSON object")
        return cls.from_config(cfg)

    def module_dims(self, module: str) -> tuple[int, int]:
        """(in_dim, out_dim) of the projection: its weight is [out_dim, in_dim]."""
        return self.arch.projection(module).dims(self)

    def lora_module_paths(self) -> tuple[str, ...]:
        """The paths of every projection LoRA may adapt, layer by layer in the spec's module order."""
        return tuple(
            f"model.layers.{i}.{p.group}.{p.name}" for i in range(self.num_layers) for p in self.arch.projections
        )

    def all_module_paths(self) -> tuple[str, ...]:
        """Every submodule name of the causal-LM model, as `named_modules()` lists them (root excluded)."""
        others = tuple(
            f"model.layers.{i}{suffix}" for i in range(self.num_layers) for suffix in self.arch.other_layer_modules
        )
        return _OTHER_MODEL_MODULES + others + self.lora_module_paths()


def _positive_int(cfg: dict[str, Any], field: str, default: int | None = None) -> int:
    value = cfg.get(field, default)
    # bool is an int subclass; `true` is never a valid size.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(f"config field {field!r}: expected a positive integer, got {quote(value)}")
    limit = MAX_CONFIG_VALUES.get(field, 1 << 31)
    if not 0 < value <= limit:
        raise InvalidArgument(f"config field {field!r}: {value} is outside 1..{limit}")
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
