"""What one forward step reads besides token ids and positions: attention metadata and the KV buffers;
the substitution of a chained plan's placeholder ids (engine/step_plan.py)."""

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.model_config import ModelConfig


@dataclass
class AttentionInputs:
    """Where this step's tokens write their K/V, and the attention backend's metadata for the step.

    The T tokens of the step are B requests' new tokens back to back; the metadata (engine/attention.py)
    knows which cached tokens each request attends to. Invariant: out_cache_loc[t] is the KV slot the
    request-to-token table names for token t's (row, position).
    """

    out_cache_loc: torch.Tensor  # [T] int64: KV slot each new token's K/V is written to
    metadata: AttentionMetadata

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, out: torch.Tensor | None = None
    ) -> torch.Tensor:  # [T, H, D]: out when given (a view into a wider tensor, say)
        if out is None:
            return self.metadata.attend(q, k_cache, v_cache, scale)
        attend_into = getattr(self.metadata, "attend_into", None)  # a backend that writes out itself
        if attend_into is not None:
            return attend_into(q, k_cache, v_cache, scale, out)
        return out.copy_(self.metadata.attend(q, k_cache, v_cache, scale))


@dataclass
class KVBuffers:
    """Per-layer K and V pools indexed by KV slot; allocated once, written in place by every forward."""

    k: list[torch.Tensor]  # num_layers x [num_slots, num_kv_heads, head_dim]
    v: list[torch.Tensor]  # num_layers x [num_slots, num_kv_heads, head_dim]

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str
    ) -> "KVBuffers":
        shape = (num_slots, config.num_kv_heads, config.head_dim)
        layers = range(config.num_layers)
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in layers],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in layers],
        )

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]


def resolve_previous(ids: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """ids with each placeholder -1 - i replaced by previous[i] (on the device, no sync)."""
    return torch.where(ids < 0, previous[(-1 - ids).clamp(min=0)], ids)


class StagingFence:
    """A pinned host staging buffer refilled every step: with the overlapped schedule the next step's
    inputs are written while the device may not yet have copied this step's out of it. `refill` waits
    for the copies `copied` last marked (at once in practice: they open the step now running)."""

    def __init__(self, device: torch.device):
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._pending = False

    def refill(self) -> None:
        if self._pending:
            self._event.synchronize()
            self._pending = False

    def copied(self) -> None:
        if self._event is not None:
            self._event.record()
            self._pending = True
