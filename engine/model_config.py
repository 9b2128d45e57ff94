"""The engine's view of a dense decoder's config.json (Llama 2/3, Mistral, Qwen2, Qwen3), frozen once read.

Which families exist and what each has (biases, q/k norms) is the family's `ArchSpec`
(loraformat.architectures), shared with the registry."""

from dataclasses import dataclass, field

from loraformat.architectures import ArchSpec, Dims, spec_for_config

SUPPORTED_ROPE_TYPES = ("linear", "llama3")  # plus plain RoPE, stored as rope_scaling None


@dataclass(frozen=True)
class ModelConfig(Dims):
    arch: ArchSpec
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # {"rope_type": "linear" | "llama3", "factor": ..., ...}; None is plain RoPE. Not hashed (a dict).
    rope_scaling: dict | None = field(default=None, hash=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False  # Llama's attention_bias biases o_proj too; Qwen2 biases q/k/v only
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Stored, not applied: attention is full causal, exact while contexts stay within the window.
    sliding_window: int | None = None

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Read a Hugging Face config.json dict. An unsupported architecture raises FailedPrecondition
        (one line naming it); a supported one with settings this engine cannot run raises ValueError."""
        arch = spec_for_config(cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be silu, got {cfg['hidden_act']!r}")
        num_heads = cfg["num_attention_heads"]
        rope_theta, rope_scaling = _rope_params(cfg)
        biases = arch.biases(cfg)
        return cls(
            arch=arch,
            model_type=cfg["model_type"],
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=biases.qkv,
            o_bias=biases.o,
            mlp_bias=biases.mlp,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_ids(cfg.get("eos_token_id")),
            sliding_window=_sliding_window(cfg, arch),
        )


def _rope_params(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from the old keys (rope_theta, rope_scaling) or transformers 5's
    rope_parameters; the "type" alias becomes "rope_type" and a "default" type becomes None."""
    params = dict(cfg.get("rope_parameters") or {})
    params.update(cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if params.get("partial_rotary_factor", 1.0) != 1.0 or cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type must be default or one of {SUPPORTED_ROPE_TYPES}, got {rope_type!r}")
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    return theta, {"rope_type": rope_type, **params}


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list | tuple) else (value,)


def _sliding_window(cfg: dict, arch: ArchSpec) -> int | None:
    if arch.window_needs_flag and not cfg.get("use_sliding_window", False):
        return None
    return cfg.get("sliding_window")
