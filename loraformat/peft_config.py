"""Parse a PEFT LoRA `adapter_config.json` and resolve which modules of a base model it adapts.

`parse_peft_config` refuses every PEFT feature whose forward is not W x + s_m * B_m A_m x, so what it
returns is exactly what the compiler can serve; `resolve_targets` applies PEFT's own matching rules
(target_modules, exclude_modules, layers_to_transform, layers_pattern) to the base model's module paths.
Pure code: no databases, object stores or gRPC; the registry and the engine both import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from loraformat import bounded_json
from loraformat.errors import FailedPrecondition, InvalidArgument, quote
from loraformat.model_shapes import SUPPORTED_MODULES, ModelShape
from loraformat.patterns import check_pattern, fullmatch, match
from loraformat.peft_files import CONFIG_FILE

_ALL_LINEAR = "all-linear"


def _field(name: str) -> str:
    return f"{CONFIG_FILE} field {name!r}"


# ---- adapter_config.json ----


@dataclass(frozen=True)
class LoraSpec:
    """The parts of a PEFT LoraConfig that decide the served weights.

    Patterns keep PEFT's semantics and their file order (the first matching key wins)."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str  # a list as written, or a regex / "all-linear"
    exclude_modules: tuple[str, ...] | str | None
    layers_to_transform: tuple[int, ...] | None
    layers_pattern: tuple[str, ...] | None
    rank_pattern: tuple[tuple[str, int], ...]
    alpha_pattern: tuple[tuple[str, float], ...]
    use_rslora: bool

    @property
    def scaling(self) -> float:
        """The adapter's one scaling: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
        return _scale(self.lora_alpha, self.r, self.use_rslora)

    def rank_of(self, path: str) -> int:
        return _pattern_value(self.rank_pattern, path, self.r)

    def alpha_of(self, path: str) -> float:
        return _pattern_value(self.alpha_pattern, path, self.lora_alpha)

    def scale_of(self, path: str) -> float:
        """PEFT's own scaling of one module, e.g. path `model.layers.3.self_attn.q_proj`."""
        return _scale(self.alpha_of(path), self.rank_of(path), self.use_rslora)


def _scale(alpha: float, rank: int, use_rslora: bool) -> float:
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def _pattern_value(patterns: tuple[tuple[str, Any], ...], path: str, default: Any) -> Any:
    # peft.utils.other.get_pattern_key: the first key that matches a dotted suffix of the path.
    for key, value in patterns:
        if match(_suffix_pattern(key), path):
            return value
    return default


def _suffix_pattern(key: str) -> str:
    return rf"(.*\.)?({key})$"


def _layer_pattern(layers_module: str) -> str:
    return rf"(?:^|.*?\.)(?:{layers_module})\.(?P<idx>\d+)\."


def parse_peft_config(raw: bytes) -> LoraSpec:
    """Parses adapter_config.json, refusing every PEFT feature the engine cannot serve exactly."""
    cfg = _load_json_object(raw)
    _check_peft_type(cfg)
    _reject_unsupported(cfg)
    return LoraSpec(
        r=_positive_int(cfg.get("r", 8), "r"),
        lora_alpha=_lora_alpha(cfg),
        target_modules=_target_modules(cfg.get("target_modules")),
        exclude_modules=_names_or_regex(cfg.get("exclude_modules"), "exclude_modules"),
        layers_to_transform=_layers_to_transform(cfg.get("layers_to_transform")),
        layers_pattern=_layers_pattern(cfg.get("layers_pattern")),
        rank_pattern=_patterns(cfg, "rank_pattern", _positive_int),
        alpha_pattern=_patterns(cfg, "alpha_pattern", _finite_number),
        use_rslora=_flag(cfg, "use_rslora"),
    )


def _load_json_object(raw: bytes) -> dict[str, Any]:
    cfg = bounded_json.loads(raw, CONFIG_FILE)
    if not isinstance(cfg, dict):
        raise InvalidArgument(f"{CONFIG_FILE}: not a JSON object")
    return cfg


def _check_peft_type(cfg: dict[str, Any]) -> None:
    peft_type = cfg.get("peft_type")
    if not isinstance(peft_type, str):
        raise InvalidArgument(f"{_field('peft_type')}: missing or not a string ({quote(peft_type)})")
    if peft_type.upper() != "LORA":
        raise FailedPrecondition(f"{_field('peft_type')}: {quote(peft_type)} is not LORA")


def _flag(cfg: dict[str, Any], field: str) -> bool:
    value = cfg.get(field)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidArgument(f"{_field(field)}: expected true or false, got {quote(value)}")
    return value


def _positive_int(value: Any, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgument(f"{_field(field)}: expected a positive integer, got {quote(value)}")
    return value


def _finite_number(value: Any, field: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidArgument(f"{_field(field)}: expected a finite number, got {quote(value)}")
    return float(value)


def _lora_alpha(cfg: dict[str, Any]) -> float:
    alpha = _finite_number(cfg.get("lora_alpha", 8), "lora_alpha")
    if alpha == 0:
        # The adapter's one scaling would be 0, and alpha_pattern could not be folded into B.
        raise InvalidArgument(f"{_field('lora_alpha')}: must be non-zero")
    return alpha


# Switches that make PEFT's forward something other than W x + s * B A x.
_UNSUPPORTED_FLAGS = {
    "use_dora": "DoRA rescales each merged weight by a learned magnitude",
    "fan_in_fan_out": "weights stored transposed (Conv1D models) are not Llama-family projections",
    "lora_bias": "a bias on lora_B is not applied",
    "use_qalora": "QALoRA pools the input before lora_A",
}
# Settings that are unsupported whenever they hold anything but null, false, {}, [] or "".
_UNSUPPORTED_SETTINGS = {
    "modules_to_save": "fully trained copies of base modules are not served",
    "layer_replication": "the base model's layers are not replicated",
    "loftq_config": "LoftQ replaces the base weights",
    "target_parameters": "LoRA on raw parameters (MoE experts) is not supported",
    "trainable_token_indices": "trained embedding rows are not served",
    "alora_invocation_tokens": "activated LoRA applies only after its invocation tokens",
    "megatron_config": "Megatron parallel layers are not supported",
    "use_bdlora": "block-diagonal LoRA is not supported",
    "arrow_config": "Arrow routing is not supported",
    "kasa_config": "KaSA truncates the base weights",
    "monteclora_config": "Monte Carlo LoRA is not supported",
    "velora_config": "VeLoRA is not supported",
}
_OFF_VALUES = (None, False, {}, [], "")
# String inits that leave the base weights untouched; true/false are PEFT's default and random inits.
# PiSSA, OLoRA, LoftQ, CorDA and LoRA-GA subtract their init from the base weights instead.
_SAFE_INITS = ("gaussian", "eva", "orthogonal", "mica")


def _reject_unsupported(cfg: dict[str, Any]) -> None:
    for field, why in _UNSUPPORTED_FLAGS.items():
        if _flag(cfg, field):
            raise FailedPrecondition(f"{_field(field)}: not supported ({why})")
    for field, why in _UNSUPPORTED_SETTINGS.items():
        if cfg.get(field) not in _OFF_VALUES:
            raise FailedPrecondition(f"{_field(field)}: not supported ({why})")
    _check_bias(cfg.get("bias"))
    _check_init(cfg.get("init_lora_weights", True))


def _check_bias(bias: Any) -> None:
    if bias is None or bias == "none":
        return
    if not isinstance(bias, str):
        raise InvalidArgument(f"{_field('bias')}: expected a string, got {bias!r}")
    raise FailedPrecondition(f"{_field('bias')}: {bias!r} is not supported (only 'none')")


def _check_init(init: Any) -> None:
    if isinstance(init, bool) or (isinstance(init, str) and init.lower() in _SAFE_INITS):
        return
    if not isinstance(init, str):
        raise InvalidArgument(f"{_field('init_lora_weights')}: unexpected value {init!r}")
    raise FailedPrecondition(
        f"{_field('init_lora_weights')}: {init!r} is not supported, since it changes the "
        "base weights; convert the adapter to plain LoRA (PEFT: save_pretrained(..., "
        "path_initial_model_for_weight_conversion=...))"
    )


def _target_modules(value: Any) -> tuple[str, ...] | str:
    field = "target_modules"
    if value is None:
        raise InvalidArgument(f"{_field(field)}: missing")
    if isinstance(value, str):
        return _ALL_LINEAR if value.lower() == _ALL_LINEAR else _target_regex(value)
    names = _name_list(value, field)
    if not names:
        raise InvalidArgument(f"{_field(field)}: empty")
    for name in names:
        # PEFT matches a list entry as a dotted suffix, so its last component is the module it adapts.
        if name.rsplit(".", 1)[-1] not in SUPPORTED_MODULES:
            raise FailedPrecondition(_unsupported_target(name))
    return names


def _target_regex(pattern: str) -> str:
    _checked_regex(pattern, "target_modules")
    for path in ("lm_head", "model.embed_tokens"):
        if fullmatch(pattern, path):
            raise FailedPrecondition(_unsupported_target(path))
    return pattern


def _unsupported_target(name: str) -> str:
    return (
        f"{_field('target_modules')}: {name!r} is not a supported module "
        f"(supported: {', '.join(SUPPORTED_MODULES)})"
    )


def _name_list(value: Any, field: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgument(f"{_field(field)}: expected a string or a list of strings")
    return tuple(value)


def _checked_regex(pattern: str, field: str, *wrappers) -> str:
    """`pattern` once RE2 compiles it, and each form it is matched in (`wrappers`)."""
    check_pattern(pattern, _field(field))
    for wrap in wrappers:
        check_pattern(wrap(pattern), _field(field))
    return pattern


def _names_or_regex(value: Any, field: str) -> tuple[str, ...] | str | None:
    if value in _OFF_VALUES:
        return None
    if isinstance(value, str):
        return _checked_regex(value, field)
    return _name_list(value, field)


def _layers_to_transform(value: Any) -> tuple[int, ...] | None:
    if value is None or value == []:
        return None
    values = value if isinstance(value, list) else [value]
    return tuple(_index(v) for v in values)


def _index(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(f"{_field('layers_to_transform')}: bad layer index {value!r}")
    return value


def _layers_pattern(value: Any) -> tuple[str, ...] | None:
    if value in _OFF_VALUES:
        return None
    names = (value,) if isinstance(value, str) else _name_list(value, "layers_pattern")
    return tuple(_checked_regex(name, "layers_pattern", _layer_pattern) for name in names)


def _patterns(cfg: dict[str, Any], field: str, convert: Any) -> tuple[tuple[str, Any], ...]:
    value = cfg.get(field)
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidArgument(f"{_field(field)}: expected an object")
    return tuple(
        (_checked_regex(key, f"{field}[{quote(key)}]", _suffix_pattern), convert(v, f"{field}[{quote(key)}]"))
        for key, v in value.items()
    )


# ---- target resolution: PEFT's rules (peft.tuners.tuners_utils.check_target_module_exists) ----


def resolve_targets(spec: LoraSpec, shape: ModelShape) -> frozenset[str]:
    """The module paths (`model.layers.3.self_attn.q_proj`) the config adapts in this base model."""
    supported = set(shape.lora_module_paths())
    # PEFT's "all-linear" is every Linear except the output head: exactly the supported projections.
    candidates = supported if spec.target_modules == _ALL_LINEAR else shape.all_module_paths()
    matched = {p for p in candidates if _is_targeted(spec, p) and not _is_excluded(spec, p)}
    unsupported = sorted(matched - supported)
    if unsupported:
        raise FailedPrecondition(_unsupported_target(unsupported[0]))
    if not matched:
        raise FailedPrecondition(f"{_field('target_modules')}: matches no module of the base model")
    return frozenset(matched)


def _is_targeted(spec: LoraSpec, path: str) -> bool:
    targets = spec.target_modules
    if targets == _ALL_LINEAR:
        return True
    if isinstance(targets, str):
        return fullmatch(targets, path)
    if path in targets:
        return True  # a full name skips the layer filter, as in PEFT
    if not any(path.endswith(f".{t}") for t in targets):
        return False
    return spec.layers_to_transform is None or _layer_index(spec, path) in spec.layers_to_transform


def _layer_index(spec: LoraSpec, path: str) -> int | None:
    # The first numbered segment after the layers module, e.g. 3 in model.layers.3.mlp.up_proj.
    patterns = [_layer_pattern(p) for p in spec.layers_pattern or ()]
    for pattern in patterns or [r".*?\.[^.]*\.(?P<idx>\d+)\."]:
        found = match(pattern, path)
        if found:
            return int(found.group("idx"))
    return None


def _is_excluded(spec: LoraSpec, path: str) -> bool:
    excluded = spec.exclude_modules
    if excluded is None:
        return False
    if isinstance(excluded, str):
        return fullmatch(excluded, path)
    return path in excluded or any(path.endswith(f".{e}") for e in excluded)
