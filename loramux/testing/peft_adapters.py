"""Real PEFT LoRA adapters for tests, made and loaded by `peft` itself (the oracle, never our code).

Test-only: imports transformers and peft, which the runtime never needs.
"""

import math
from collections.abc import Iterable
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel

# B's std is this over sqrt(r), so B @ A @ x has about this RMS per output for a unit-RMS input x (the
# base projection's output has RMS 1): on the demo model a perturbation that changes most greedy tokens
# (logits move by about half their std at alpha/r = 2) without blowing them up.
_LORA_B_RMS = 0.1


def make_peft_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    r: int = 8,
    lora_alpha: int = 16,
    target_modules: Iterable[str] = ("q_proj", "v_proj"),
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, int] | None = None,
    use_rslora: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **extra_lora_config,
) -> Path:
    """Save a PEFT LoRA adapter of the base model in `model_dir` to `out_dir`; return `out_dir`.

    out_dir holds adapter_config.json and adapter_model.safetensors. Every lora_A `[r, in_dim]` and
    lora_B `[out_dim, r]` is drawn from one generator seeded with `seed`, in module-name order, so equal
    arguments give equal tensors; B is never zero. Saved LoRA tensors have `dtype`. `extra_lora_config`
    goes to LoraConfig unchanged (use_dora, bias, modules_to_save, layers_to_transform, ...).
    """
    lora_config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules),
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
        **extra_lora_config,
    )
    model = get_peft_model(_load_base(model_dir), lora_config)
    _randomize_lora(model, seed)
    _cast_lora(model, dtype)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def load_peft_model(model_dir: str | Path, adapter_dirs: dict[str, Path]) -> PeftModel:
    """The fp32 base model in eval mode with each adapter loaded under its name.

    Mixed batches: `model(input_ids, adapter_names=[...])` or `model.generate(..., adapter_names=[...])`
    with one name per row, "__base__" for the base model.
    """
    if not adapter_dirs:
        raise ValueError("adapter_dirs must name at least one adapter")
    (first_name, first_dir), *rest = adapter_dirs.items()
    model = PeftModel.from_pretrained(_load_base(model_dir), first_dir, adapter_name=first_name)
    for name, adapter_dir in rest:
        model.load_adapter(adapter_dir, adapter_name=name)
    return model.eval()


def _load_base(model_dir: str | Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _randomize_lora(model: PeftModel, seed: int) -> None:
    """A ~ N(0, 1/in_dim) so A @ x has unit RMS; B ~ N(0, _LORA_B_RMS^2 / r)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if ".lora_A." in name:  # [r, in_dim]
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[1]))
            elif ".lora_B." in name:  # [out_dim, r]
                param.copy_(
                    torch.randn(param.shape, generator=generator) * _LORA_B_RMS / math.sqrt(param.shape[1])
                )


def _cast_lora(model: PeftModel, dtype: torch.dtype) -> None:
    for name, param in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            param.data = param.data.to(dtype)
