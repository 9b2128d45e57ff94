"""Validate a PEFT LoRA adapter against a base model and compile it into the canonical artifact.

Input: `adapter_config.json` + `adapter_model.safetensors` as PEFT saves them. Output: one safetensors
file (DESIGN section 5) that an engine places without knowing PEFT:

    layers.{i}.{module}.lora_A   [R, in_dim]    R = the adapter's max rank over its modules
    layers.{i}.{module}.lora_B   [out_dim, R]
    delta_W(i, module) = scaling * lora_B @ lora_A   (== PEFT's s_m * B_m @ A_m, exactly up to rounding)

with one `scaling` per adapter. Only the (layer, module) pairs the PEFT weights hold have tensors; every
other pair contributes zero. The config is parsed and its targets resolved in `loraformat.peft_config`.
Pure code: no databases, object stores or gRPC; the registry and the engine both import it.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loraformat.errors import FailedPrecondition, InvalidArgument, quote
from loraformat.model_shapes import MODULE_GROUPS, SUPPORTED_MODULES, ModelShape, module_path
from loraformat.peft_config import LoraSpec, parse_peft_config, resolve_targets
from loraformat.peft_files import is_pickle_weights, pickle_refusal
from loraformat.safetensors_io import (
    SafetensorsFile,
    SafetensorsLimits,
    TensorSpec,
    write_safetensors_lazy,
)

FORMAT = "loramux.lora"
FORMAT_VERSION = "1"
DEFAULT_LIMITS = SafetensorsLimits()


# ---- adapter_model.safetensors: names, pairs and shapes ----

# PEFT's saved names, e.g. base_model.model.model.layers.3.self_attn.q_proj.lora_A[.<adapter>].weight
_LORA_NAME = re.compile(
    r"base_model\.model\.(?P<path>.+)\.lora_(?P<part>[AB])(?:\.(?P<adapter>[^.]+))?\.weight"
)
_LAYER_PATH = re.compile(
    r"model\.layers\.(?P<layer>0|[1-9][0-9]*)\.(?P<group>self_attn|mlp)\.(?P<module>\w+)"
)
# Tensors PEFT saves for features the engine cannot serve.
_UNSERVABLE_TENSORS = {
    "lora_embedding_A": "embedding LoRA",
    "lora_embedding_B": "embedding LoRA",
    "lora_magnitude_vector": "the DoRA magnitude vector",
}


@dataclass(frozen=True)
class _ModulePlan:
    """One adapted projection: where its source tensors are and how they become canonical."""

    layer: int
    module: str
    a_name: str  # A: [rank, in_dim]
    b_name: str  # B: [out_dim, rank]
    rank: int  # r_m, from rank_pattern or r
    fold: float  # s_m / scaling: folded into B so one scaling serves every module


def _locate(name: str, shape: ModelShape) -> tuple[int, str, str]:
    """(layer, module, "A" | "B") of a PEFT tensor name."""
    for marker, what in _UNSERVABLE_TENSORS.items():
        if f".{marker}" in name:
            raise FailedPrecondition(f"tensor {quote(name)}: {what} is not supported")
    if name.endswith(".bias"):
        raise FailedPrecondition(f"tensor {quote(name)}: biases are not supported")
    lora = _LORA_NAME.fullmatch(name)
    if lora is None:
        raise InvalidArgument(f"tensor {quote(name)}: not a LoRA weight (expected e.g. {_example_name()!r})")
    layer_path = _LAYER_PATH.fullmatch(lora["path"])
    if layer_path is None or MODULE_GROUPS.get(layer_path["module"]) != layer_path["group"]:
        raise _unknown_module(name, lora["path"], shape)
    layer = int(layer_path["layer"])
    if layer >= shape.num_layers:
        raise FailedPrecondition(
            f"tensor {quote(name)}: layer {layer} is out of range (the base model has {shape.num_layers})"
        )
    return layer, layer_path["module"], lora["part"]


def _example_name() -> str:
    return "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _unknown_module(name: str, path: str, shape: ModelShape) -> Exception:
    # A real module of the base model that LoRA cannot adapt here (lm_head, embed_tokens, ...) can't be
    # served; a path the model does not have at all is a malformed name.
    if path in shape.all_module_paths():
        return FailedPrecondition(
            f"tensor {quote(name)}: LoRA on {path!r} is not supported (supported: {', '.join(SUPPORTED_MODULES)})"
        )
    return InvalidArgument(f"tensor {quote(name)}: {path!r} is not a module of the base model")


def _pair_tensors(
    names: list[str], shape: ModelShape, targets: frozenset[str]
) -> dict[tuple[int, str], dict[str, str]]:
    """(layer, module) -> {"A": name, "B": name}, every name checked against the model and the config."""
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for name in names:
        layer, module, part = _locate(name, shape)
        path = module_path(layer, module)
        if path not in targets:
            raise InvalidArgument(f"tensor {quote(name)}: {path} is not in the config's target_modules")
        pair = pairs.setdefault((layer, module), {})
        if part in pair:
            raise InvalidArgument(f"tensors {quote(pair[part])} and {quote(name)} are both lora_{part} of {path}")
        pair[part] = name
    return pairs


def _plan(
    sf: SafetensorsFile, spec: LoraSpec, shape: ModelShape, targets: frozenset[str]
) -> list[_ModulePlan]:
    if not sf.infos:
        raise InvalidArgument(f"{sf.label}: holds no tensors")
    pairs = _pair_tensors(sf.names, shape, targets)
    order = sorted(pairs, key=lambda key: (key[0], SUPPORTED_MODULES.index(key[1])))
    return [_plan_module(sf, spec, shape, layer, module, pairs[layer, module]) for layer, module in order]


def _plan_module(
    sf: SafetensorsFile, spec: LoraSpec, shape: ModelShape, layer: int, module: str, pair: dict[str, str]
) -> _ModulePlan:
    path = module_path(layer, module)
    for part, other in (("A", "B"), ("B", "A")):
        if part not in pair:
            raise InvalidArgument(f"tensor {quote(pair[other])}: lora_{other} of {path} has no lora_{part}")
    rank = spec.rank_of(path)
    in_dim, out_dim = shape.module_dims(module)
    _check_shape(sf, pair["A"], (rank, in_dim))
    _check_shape(sf, pair["B"], (out_dim, rank))
    return _ModulePlan(layer, module, pair["A"], pair["B"], rank, spec.scale_of(path) / spec.scaling)


def _check_shape(sf: SafetensorsFile, name: str, expected: tuple[int, int]) -> None:
    actual = sf.infos[name].shape
    if actual != expected:
        raise FailedPrecondition(
            f"tensor {quote(name)}: shape {list(actual)} does not match the expected {list(expected)} "
            "(lora_A: [rank, in_dim], lora_B: [out_dim, rank], from the base model and the config's rank)"
        )


def _check_rank(plans: list[_ModulePlan], max_rank: int) -> int:
    top = max(plans, key=lambda p: p.rank)
    if top.rank > max_rank:
        raise FailedPrecondition(
            f"rank: {top.rank} (of {module_path(top.layer, top.module)}) exceeds the max LoRA rank {max_rank}"
        )
    return top.rank


def _common_dtype(sf: SafetensorsFile) -> torch.dtype:
    dtypes = {info.torch_dtype for info in sf.infos.values()}
    # Mixed sources are upcast: fp32 holds every fp16 and bf16 value exactly.
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


# ---- canonical tensors ----


def _canonical_a(a: torch.Tensor, rank: int, dtype: torch.dtype) -> torch.Tensor:
    # A: [r_m, in_dim] -> [R, in_dim], rows r_m.. zero so they add nothing to B @ A.
    if a.shape[0] == rank and a.dtype == dtype:
        return a
    out = torch.zeros((rank, a.shape[1]), dtype=dtype)
    out[: a.shape[0]] = a
    return out


def _canonical_b(b: torch.Tensor, fold: float, rank: int, dtype: torch.dtype) -> torch.Tensor:
    # B: [out_dim, r_m] -> [out_dim, R], columns r_m.. zero, scaled by s_m / scaling.
    folded = _fold(b, fold, dtype)
    if b.shape[1] == rank:
        return folded
    out = torch.zeros((b.shape[0], rank), dtype=dtype)
    out[:, : b.shape[1]] = folded
    return out


def _fold(b: torch.Tensor, fold: float, dtype: torch.dtype) -> torch.Tensor:
    if fold == 1.0:
        return b.to(dtype)
    # float64 so the only rounding is the final cast back to the artifact's dtype.
    return (b.to(torch.float64) * fold).to(dtype)


def _check_finite(sf: SafetensorsFile, plans: list[_ModulePlan], dtype: torch.dtype) -> None:
    """Reads every tensor once, one at a time, before anything is written."""
    for plan in plans:
        for name in (plan.a_name, plan.b_name):
            if not all_finite(sf.tensor(name)):
                raise InvalidArgument(f"tensor {quote(name)}: holds NaN or Inf values")
        if plan.fold != 1.0 and not bool(
            torch.isfinite(_fold(sf.tensor(plan.b_name), plan.fold, dtype)).all()
        ):
            raise FailedPrecondition(
                f"tensor {quote(plan.b_name)}: its alpha_pattern scale overflows {dtype} once folded into lora_B"
            )


# A float is NaN or Inf exactly when its exponent bits are all ones: (the integer view, the exponent mask).
_EXPONENT_BITS = {
    torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00), torch.float32: (torch.int32, 0x7F800000),
    torch.float64: (torch.int64, 0x7FF0000000000000),
}  # fmt: skip


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in t. For the float dtypes adapters come in, a check of the exponent bits in numpy:
    one thread with the GIL let go, where `torch.isfinite` spreads each tensor over torch's threads (the
    registry compiles several uploads at once) and runs bfloat16 element by element, ~9x slower."""
    bits = _EXPONENT_BITS.get(t.dtype)
    if bits is None:
        return bool(torch.isfinite(t).all())
    int_dtype, mask = bits
    exponents = t.detach().cpu().view(int_dtype).numpy() & mask
    return not (exponents == mask).any()


# ---- compile ----


@dataclass(frozen=True)
class CompiledAdapter:
    digest: str  # sha256 hex of the artifact's bytes
    size_bytes: int
    rank: int  # R: the max rank over modules; every tensor is padded to it
    alpha: float  # the config's top-level lora_alpha
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA
    target_modules: tuple[str, ...]  # in SUPPORTED_MODULES order
    num_layers: int
    dtype: str  # "float16" | "bfloat16" | "float32"


def compile_adapter(
    config_raw: bytes,
    weights_path: Path,
    shape: ModelShape,
    *,
    base_model: str,
    max_rank: int,
    out_path: Path,
    limits: SafetensorsLimits = DEFAULT_LIMITS,
) -> CompiledAdapter:
    """Validates the adapter completely, then writes the canonical artifact to `out_path` atomically.

    On any error nothing exists at `out_path`. Tensors are streamed one at a time from a memory map, so
    a large adapter costs at most one extra copy of its largest tensor."""
    spec = parse_peft_config(config_raw)
    targets = resolve_targets(spec, shape)
    _refuse_pickle(Path(weights_path))
    with SafetensorsFile.open(weights_path, limits) as sf:
        plans = _plan(sf, spec, shape, targets)
        rank = _check_rank(plans, max_rank)
        dtype = _common_dtype(sf)
        _check_finite(sf, plans, dtype)
        modules = _module_kinds(targets)
        metadata = _artifact_metadata(spec, shape, base_model, rank, modules)
        specs, produce = _artifact_tensors(sf, plans, shape, rank, dtype)
        digest, size = _write_atomically(Path(out_path), specs, produce, metadata)
    return CompiledAdapter(
        digest=digest,
        size_bytes=size,
        rank=rank,
        alpha=spec.lora_alpha,
        scaling=spec.scaling,
        target_modules=modules,
        num_layers=shape.num_layers,
        dtype=str(dtype).removeprefix("torch."),
    )


def _refuse_pickle(path: Path) -> None:
    if is_pickle_weights(path.name):
        raise InvalidArgument(pickle_refusal(path.name))


def _module_kinds(targets: frozenset[str]) -> tuple[str, ...]:
    return tuple(m for m in SUPPORTED_MODULES if any(path.endswith(f".{m}") for path in targets))


def _artifact_metadata(
    spec: LoraSpec, shape: ModelShape, base_model: str, rank: int, modules: tuple[str, ...]
) -> dict[str, str]:
    # Nothing here may vary between two compiles of the same input (no adapter name, no time).
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "base_model": base_model,
        "num_layers": str(shape.num_layers),
        "rank": str(rank),
        "alpha": repr(spec.lora_alpha),
        "scaling": repr(spec.scaling),
        "use_rslora": "true" if spec.use_rslora else "false",
        "target_modules": ",".join(modules),
    }


def _artifact_tensors(
    sf: SafetensorsFile, plans: list[_ModulePlan], shape: ModelShape, rank: int, dtype: torch.dtype
) -> tuple[dict[str, TensorSpec], Callable[[str], torch.Tensor]]:
    """The artifact's layout, and a function that builds one canonical tensor when the writer asks."""
    specs: dict[str, TensorSpec] = {}
    sources: dict[str, tuple[_ModulePlan, str]] = {}
    for plan in plans:
        in_dim, out_dim = shape.module_dims(plan.module)
        prefix = f"layers.{plan.layer}.{plan.module}"
        specs[f"{prefix}.lora_A"] = TensorSpec(dtype, (rank, in_dim))
        specs[f"{prefix}.lora_B"] = TensorSpec(dtype, (out_dim, rank))
        sources[f"{prefix}.lora_A"] = (plan, "A")
        sources[f"{prefix}.lora_B"] = (plan, "B")

    def produce(name: str) -> torch.Tensor:
        plan, part = sources[name]
        if part == "A":
            return _canonical_a(sf.tensor(plan.a_name), rank, dtype)
        return _canonical_b(sf.tensor(plan.b_name), plan.fold, rank, dtype)

    return specs, produce


def _write_atomically(
    out_path: Path,
    specs: dict[str, TensorSpec],
    produce: Callable[[str], torch.Tensor],
    metadata: dict[str, str],
) -> tuple[str, int]:
    # A temporary file in the same directory, renamed into place only once complete: a failure or a
    # crash mid-write never leaves a partial artifact at out_path.
    fd, tmp = tempfile.mkstemp(dir=out_path.parent, prefix=f".{out_path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            digest, size = write_safetensors_lazy(f, specs, produce, metadata)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out_path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return digest, size


# ---- reading the artifact (engine, tests) ----

_CANONICAL_NAME = re.compile(r"layers\.(?P<layer>0|[1-9][0-9]*)\.(?P<module>\w+)\.lora_(?P<part>[AB])")


@dataclass(frozen=True)
class CanonicalAdapter:
    base_model: str
    num_layers: int
    rank: int
    alpha: float
    scaling: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    metadata: dict[str, str]
    # layers.{i}.{module}.lora_A: [rank, in_dim]; layers.{i}.{module}.lora_B: [out_dim, rank]; a read
    # artifact's are TensorViews (views made on first lookup, bytes without one)
    tensors: Mapping[str, torch.Tensor]

    def adapts(self, layer: int, module: str) -> bool:
        """Whether the adapter changes this projection (no tensor view is made)."""
        return f"layers.{layer}.{module}.lora_A" in self.tensors

    def module_weights(self, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A, B) of one projection, or None when the adapter leaves it unchanged."""
        a = self.tensors.get(f"layers.{layer}.{module}.lora_A")
        return None if a is None else (a, self.tensors[f"layers.{layer}.{module}.lora_B"])


def read_canonical(
    source: str | os.PathLike[str] | bytes | bytearray | memoryview,
    shape: ModelShape | None = None,
    limits: SafetensorsLimits = DEFAULT_LIMITS,
) -> CanonicalAdapter:
    """Reads and checks an artifact; with `shape`, also checks it fits that base model."""
    if isinstance(source, bytes | bytearray | memoryview):
        sf = SafetensorsFile.from_buffer(source, "artifact", limits)
    else:
        sf = SafetensorsFile.open(source, limits)
    views = sf.views()

    def checked() -> dict[str, Any]:
        fields = _canonical_fields(sf.label, sf.metadata)
        _check_canonical_tensors(sf, CanonicalAdapter(**fields, metadata=sf.metadata, tensors=views), shape)
        return fields

    # what the header says and its check against `shape`: once per distinct header (ParsedHeader.derive)
    fields = sf.header.derive(("canonical", shape), checked)
    return CanonicalAdapter(**fields, metadata=dict(sf.metadata), tensors=views)


def _canonical_fields(label: str, metadata: dict[str, str]) -> dict[str, Any]:
    for key, expected in (("format", FORMAT), ("format_version", FORMAT_VERSION)):
        if metadata.get(key) != expected:
            raise InvalidArgument(
                f"{label}: metadata {quote(key)} is {metadata.get(key)!r}, expected {expected!r}"
            )
    return {
        "base_model": _meta(label, metadata, "base_model", str),
        "num_layers": _meta(label, metadata, "num_layers", int),
        "rank": _meta(label, metadata, "rank", int),
        "alpha": _meta(label, metadata, "alpha", float),
        "scaling": _meta(label, metadata, "scaling", float),
        "use_rslora": _meta(label, metadata, "use_rslora", {"true": True, "false": False}.__getitem__),
        "target_modules": _meta(label, metadata, "target_modules", _module_list),
    }


def _meta(label: str, metadata: dict[str, str], key: str, convert: Callable[[str], Any]) -> Any:
    if key not in metadata:
        raise InvalidArgument(f"{label}: metadata {quote(key)} is missing")
    try:
        return convert(metadata[key])
    except (KeyError, ValueError):
        raise InvalidArgument(f"{label}: metadata {quote(key)} has a bad value {metadata[key]!r}") from None


def _module_list(value: str) -> tuple[str, ...]:
    modules = tuple(value.split(","))
    if not all(m in SUPPORTED_MODULES for m in modules):
        raise ValueError(value)
    return modules


def _check_canonical_tensors(
    sf: SafetensorsFile, adapter: CanonicalAdapter, shape: ModelShape | None
) -> None:
    if shape is not None and shape.num_layers != adapter.num_layers:
        raise FailedPrecondition(
            f"{sf.label}: metadata 'num_layers' is {adapter.num_layers}, the base model has {shape.num_layers}"
        )
    for name, info in sf.infos.items():
        layer, module, part = _canonical_location(sf.label, name, adapter)
        other = f"layers.{layer}.{module}.lora_{'B' if part == 'A' else 'A'}"
        if other not in sf.infos:
            raise InvalidArgument(f"{sf.label}: tensor {quote(name)} has no {other!r}")
        rank_dim = 0 if part == "A" else 1  # A: [rank, in_dim], B: [out_dim, rank]
        if len(info.shape) != 2 or info.shape[rank_dim] != adapter.rank:
            raise InvalidArgument(
                f"{sf.label}: tensor {quote(name)} has shape {list(info.shape)}, not 2-D with rank {adapter.rank}"
            )
        if shape is not None:
            _check_canonical_dims(sf.label, name, info.shape, module, part, shape)


def _canonical_location(label: str, name: str, adapter: CanonicalAdapter) -> tuple[int, str, str]:
    match = _CANONICAL_NAME.fullmatch(name)
    if match is None or match["module"] not in adapter.target_modules:
        raise InvalidArgument(f"{label}: tensor {quote(name)} does not name a target module's lora_A or lora_B")
    layer = int(match["layer"])
    if layer >= adapter.num_layers:
        raise InvalidArgument(
            f"{label}: tensor {quote(name)}: layer {layer} is out of range ({adapter.num_layers})"
        )
    return layer, match["module"], match["part"]


def _check_canonical_dims(
    label: str, name: str, actual: tuple[int, ...], module: str, part: str, shape: ModelShape
) -> None:
    in_dim, out_dim = shape.module_dims(module)
    expected = (actual[0], in_dim) if part == "A" else (out_dim, actual[1])
    if actual != expected:
        raise FailedPrecondition(
            f"{label}: tensor {quote(name)} has shape {list(actual)}, the base model needs {list(expected)}"
        )
