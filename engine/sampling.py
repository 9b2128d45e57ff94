"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds.

Reproducibility: a request with a seed draws only from its own `torch.Generator`, so its tokens do not
depend on which other requests share the batch or where it sits in it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

DEFAULT_MAX_NEW_TOKENS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
_MAX_SEED = 2**64  # torch.Generator.manual_seed takes any uint64
# Below this the scaled softmax is practically one-hot, and dividing by a tinier temperature can overflow
# the logits to inf (NaN probabilities): such rows take the argmax.
_GREEDY_BELOW = 1e-5


class InvalidSampling(ValueError):
    """A sampling value the engine refuses (INVALID_ARGUMENT); `field` names it, and so does the message."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"sampling.{field}: {reason}")
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings; defaults mirror the wire's zero values.

    temperature 0 (anything below 1e-5) is greedy; top_k 0 and top_p 1 disable those filters;
    max_new_tokens 0 means "the default" until `resolve` replaces it; seed None draws from a generator
    seeded at random.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        # Callers pass the wire's repeated fields (lists); tuples keep the params hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_BELOW

    def resolve(self, prompt_len: int, max_context: int) -> SamplingParams:
        """max_new_tokens 0 -> DEFAULT_MAX_NEW_TOKENS, capped by the context left after the prompt."""
        if self.max_new_tokens != 0:
            return self
        return replace(self, max_new_tokens=min(DEFAULT_MAX_NEW_TOKENS, max_context - prompt_len))

    def validate(self, vocab_size: int, max_context: int, prompt_len: int = 0) -> None:
        """Raise InvalidSampling naming the first bad field; call after `resolve`."""
        _check_temperature(self.temperature)
        _check_filters(self.top_p, self.top_k)
        _check_seed(self.seed)
        _check_max_new_tokens(self.max_new_tokens, prompt_len, max_context)
        _check_stop(self.stop)
        _check_stop_token_ids(self.stop_token_ids, vocab_size)


def _check_temperature(temperature: float) -> None:
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidSampling("temperature", f"must be finite and >= 0, got {temperature}")


def _check_filters(top_p: float, top_k: int) -> None:
    if not 0.0 < top_p <= 1.0:  # also refuses NaN
        raise InvalidSampling("top_p", f"must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise InvalidSampling("top_k", f"must be >= 0 (0 disables it), got {top_k}")


def _check_seed(seed: int | None) -> None:
    if seed is not None and not 0 <= seed < _MAX_SEED:
        raise InvalidSampling("seed", f"must be in [0, 2**64), got {seed}")


def _check_max_new_tokens(max_new_tokens: int, prompt_len: int, max_context: int) -> None:
    if max_new_tokens <= 0:
        left = max_context - prompt_len
        raise InvalidSampling(
            "max_new_tokens",
            f"must be > 0, got {max_new_tokens} ({left} of {max_context} context tokens left)",
        )
    if prompt_len + max_new_tokens > max_context:
        raise InvalidSampling(
            "max_new_tokens",
            f"{max_new_tokens} new tokens after a {prompt_len}-token prompt exceed the context of {max_context}",
        )


def _check_stop(stop: tuple[str, ...]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidSampling("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for i, text in enumerate(stop):
        if not text:
            raise InvalidSampling("stop", f"stop[{i}] is empty")
        if len(text) > MAX_STOP_STRING_CHARS:
            raise InvalidSampling(
                "stop", f"stop[{i}] has {len(text)} characters, over {MAX_STOP_STRING_CHARS}"
            )


def _check_stop_token_ids(stop_token_ids: tuple[int, ...], vocab_size: int) -> None:
    # Every decode step checks the new token against them: millions of ids slowed every other request.
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidSampling(
            "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(stop_token_ids)}"
        )
    for i, token_id in enumerate(stop_token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidSampling(
                "stop_token_ids", f"stop_token_ids[{i}] = {token_id} is outside [0, {vocab_size})"
            )


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A generator on `device` seeded with `seed`, or with fresh OS randomness when seed is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Next token ids [B] (int64) for logits [B, V] (the model's dtype), one SamplingParams and generator
    per row.

    Greedy rows take the argmax (of the logits as they are: the first of equal maxima, as of their fp32
    copy). Other rows, in fp32, are scaled by 1/temperature, filtered by top-k then top-p (the top token
    always survives) and drawn with the row's own generator (None: torch's default one).
    """
    next_ids = logits.argmax(dim=-1)  # [B]
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if rows:
        probs = _filtered_probs(logits[rows].float(), [params[i] for i in rows])  # [R, V]
        noise = _exponential_noise(probs, [generators[i] for i in rows])  # [R, V]
        next_ids[rows] = (probs / noise).argmax(dim=-1)
    return next_ids


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities [R, V] after temperature, top-k and top-p; filtered tokens are 0, rows not renormalised."""
    # logits: [R, V]
    vocab_size = logits.shape[-1]
    device = logits.device
    temperatures = torch.tensor([p.temperature for p in params], device=device)  # [R]
    top_ks = torch.tensor([p.top_k or vocab_size for p in params], device=device)  # [R]
    top_ps = torch.tensor([p.top_p for p in params], device=device)  # [R]
    # Stable, so among equal logits the lowest id ranks first, as in argmax.
    sorted_logits, order = (logits / temperatures[:, None]).sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab_size, device=device)  # [V]
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_ks[:, None], -math.inf)
    sorted_probs = sorted_logits.softmax(dim=-1)  # [R, V]
    # Drop a token once the tokens ranked above it already hold top_p of the mass; rank 0 sees 0 < top_p.
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_above >= top_ps[:, None], 0.0)
    return torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)


def _exponential_noise(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise [R, V], row r drawn from generators[r] alone; argmax(probs / noise) ~ probs.

    Clamped away from 0 so that a filtered token (0 / 0) can never become NaN, which argmax would pick.
    """
    noise = torch.empty_like(probs)
    for row, generator in enumerate(generators):
        noise[row].exponential_(generator=generator)
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)
