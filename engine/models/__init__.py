"""One model class per family, chosen through the family's spec (`ArchSpec.model_file`), never by an
if-chain over names."""

import torch

from engine.model_config import ModelConfig
from engine.models.blocks import DecoderModel
from engine.models.llama import LlamaModel
from engine.models.qwen3 import Qwen3Model
from engine.parallel import SINGLE, TensorParallel

MODEL_CLASSES: dict[str, type[DecoderModel]] = {
    "llama": LlamaModel,
    "qwen3": Qwen3Model,
}


def build_model(
    config: ModelConfig, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", tp: TensorParallel = SINGLE
) -> DecoderModel:
    """The family's model (this rank's shard) with uninitialised weights (on "meta": no memory until
    they are assigned)."""
    return MODEL_CLASSES[config.arch.model_file](config, dtype=dtype, device=device, tp=tp)
