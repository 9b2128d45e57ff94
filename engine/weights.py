"""Load a Hugging Face checkpoint of a supported family into its model, or make random weights for
benchmarks.

HF tensors map to our fused parameters by the family spec's fused targets (q/k/v -> qkv_proj, gate/up ->
gate_up_proj, concatenated along the output dimension); every other name only loses its leading "model.".
"""

import json
import math
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model_config import ModelConfig
from engine.models import build_model
from engine.models.blocks import DecoderModel
from engine.named_shapes import NAMED_SHAPES
from engine.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel
from loraformat.architectures import FusedTarget

_LM_HEAD = "lm_head.weight"


def default_dtype(device: torch.device | str) -> torch.dtype:
    """fp32 on the CPU, bf16 on accelerators."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def load_model(
    model_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None, tp: TensorParallel = SINGLE
) -> tuple[DecoderModel, ModelConfig]:
    """Read config.json and model.safetensors (or the shards of model.safetensors.index.json) of
    `model_dir` onto `device`. Ties the embeddings when config.json says so or lm_head is absent.
    Raises ValueError naming every missing, unexpected or misshapen tensor. With tensor parallelism the
    checkpoint is read on the host and each parallel linear keeps its rank's slice (`shard_full`)."""
    model_dir = Path(model_dir)
    dtype = dtype or default_dtype(device)
    config = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    tensors = read_safetensors(model_dir, device if tp.size == 1 else "cpu")
    if _LM_HEAD not in tensors and not config.tie_word_embeddings:
        config = replace(config, tie_word_embeddings=True)
    if config.tie_word_embeddings:
        tensors.pop(_LM_HEAD, None)
    full = build_model(config, dtype=dtype, device="meta")
    state = fuse_hf_tensors(tensors, full.state_dict(), config)
    model = build_model(config, dtype=dtype, device="meta", tp=tp)
    state = shard_state(model, state)
    model.load_state_dict({name: t.to(device=device, dtype=dtype) for name, t in state.items()}, strict=True, assign=True)
    model.set_rope_device(device)
    return model.eval(), config


def shard_state(model: DecoderModel, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full fused tensors -> this rank's: each parallel linear's weight loader slices its own."""
    if model.tp.size == 1:
        return state
    loaders = {
        f"{name}.{kind}": module.shard_full
        for name, module in model.named_modules()
        if isinstance(module, ColumnParallelLinear | RowParallelLinear)
        for kind in ("weight", "bias")
    }
    return {name: loaders[name](t) if name in loaders else t for name, t in state.items()}


def read_safetensors(model_dir: Path, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by HF name, read straight onto `device`."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.exists():
        files = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")
    tensors = {}
    for filename in files:
        with safe_open(model_dir / filename, framework="pt", device=str(device)) as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
    return tensors


def fuse_hf_tensors(
    tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """HF-named tensors -> our parameter names (`expected`'s keys, whose shapes are checked)."""
    parts = _expected_hf_shapes(expected, config)  # HF name -> (our name, part index, shape)
    ignored = {name for name in tensors if name.endswith("rotary_emb.inv_freq")}
    missing = sorted(set(parts) - set(tensors))
    unexpected = sorted(set(tensors) - set(parts) - ignored)
    misshapen = [
        f"{name} {tuple(tensors[name].shape)} != {parts[name][2]}"
        for name in sorted(set(parts) & set(tensors))
        if tuple(tensors[name].shape) != parts[name][2]
    ]
    _raise_if_any(missing=missing, unexpected=unexpected, misshapen=misshapen)
    grouped: dict[str, list] = {name: [None] * _num_parts(name, config) for name in expected}
    for hf_name, (name, part, _) in parts.items():
        grouped[name][part] = tensors[hf_name]
    return {name: torch.cat(group) if len(group) > 1 else group[0] for name, group in grouped.items()}


def _expected_hf_shapes(
    expected: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, tuple[str, int, tuple[int, ...]]]:
    out = {}
    for name, param in expected.items():
        for part, (hf_name, shape) in enumerate(_hf_parts(name, tuple(param.shape), config)):
            out[hf_name] = (name, part, shape)
    return out


def _hf_parts(name: str, shape: tuple[int, ...], config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Our parameter -> its HF tensors and their shapes, e.g. layers.0.self_attn.qkv_proj.weight ->
    model.layers.0.self_attn.{q,k,v}_proj.weight."""
    hf_name = name if name == _LM_HEAD else f"model.{name}"
    module, _, kind = hf_name.rpartition(".")
    prefix, _, proj = module.rpartition(".")
    target = _fused_parts(config).get(proj)
    if target is None:
        return [(hf_name, shape)]
    sizes = [config.arch.projection(m).dims(config)[1] for m in target.modules]
    return [
        (f"{prefix}.{hf_proj}.{kind}", (size, *shape[1:]))
        for hf_proj, size in zip(target.modules, sizes, strict=True)
    ]


def _fused_parts(config: ModelConfig) -> dict[str, FusedTarget]:
    """Our fused linear's leaf name (qkv_proj) -> its target, for targets of more than one projection."""
    return {t.param.rpartition(".")[2]: t for t in config.arch.fused if len(t.modules) > 1}


def _num_parts(name: str, config: ModelConfig) -> int:
    proj = name.rpartition(".")[0].rpartition(".")[2]
    target = _fused_parts(config).get(proj)
    return 1 if target is None else len(target.modules)


def _raise_if_any(**problems: list[str]) -> None:
    lines = [f"{kind}: {', '.join(names[:20])}{' ...' if len(names) > 20 else ''}"
             for kind, names in problems.items() if names]  # fmt: skip
    if lines:
        raise ValueError("checkpoint does not fit the model config; " + "; ".join(lines))


def random_model(
    shape: str | ModelConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    tp: TensorParallel = SINGLE,
) -> DecoderModel:
    """A model of a named shape (NAMED_SHAPES) or config with seeded random weights drawn on `device`:
    linears and embeddings ~ N(0, 1/in_dim), norms 1, biases 0, so activations keep about unit scale."""
    config = NAMED_SHAPES[shape] if isinstance(shape, str) else shape
    dtype = dtype or default_dtype(device)
    model = build_model(config, dtype=dtype, device="meta", tp=tp).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:  # [out_dim, in_dim] linears and the [vocab, hidden] embedding alike
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[1]), generator=generator)
    model.set_rope_device(device)
    return model.eval()


def store_linears_in_out(model: DecoderModel) -> int:
    """Store every parallel linear's weight, and an untied LM head's, transposed in memory: the same
    logical [out, in] tensor with strides (1, out), so `F.linear` hands the GEMM W^T as a contiguous
    row-major [in, out] matrix (EngineConfig.linear_weight_layout "in_out"). A tied LM head is the
    embedding, whose rows the token lookup reads, and stays. One weight is copied at a time. Returns the
    number of weights moved."""
    linears = [m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    if model.lm_head is not None:
        linears.append(model.lm_head)
    with torch.no_grad():
        for module in linears:
            weight = module.weight
            module.weight = torch.nn.Parameter(weight.t().contiguous().t(), requires_grad=weight.requires_grad)
            del weight
    return len(linears)
