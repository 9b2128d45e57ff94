"""A generation request's state inside the engine loop, and the events it emits to its stream.

Token bookkeeping (one vocabulary everywhere):
- `all_ids = prompt_ids + output_ids`;
- `kv_len`: tokens whose K/V sit in `kv_slots` (the first `cached_len` came from the prefix cache);
- a request is in a step with `extend_len = len(all_ids) - kv_len` tokens, clipped by the step's
  token budget (chunked prefill); it samples only when the step brings kv_len up to len(all_ids).
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.errors import Code
from engine.sampling import SamplingParams
from engine.text import IncrementalDetokenizer, StopMatcher


class FinishReason(enum.Enum):
    LENGTH = "LENGTH"
    EOS = "EOS"
    STOP_SEQUENCE = "STOP_SEQUENCE"
    CANCELLED = "CANCELLED"


@dataclass(frozen=True)
class TokenDelta:
    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    matched_stop: str
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class Failed:
    """The request ended with an error; `code` is its kind (Code.DEADLINE_EXCEEDED, ...), which each
    front maps to its protocol's status."""

    code: Code
    message: str


Event = TokenDelta | Finished | Failed
Sink = Callable[[Event], None]
_uids = itertools.count()


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    namespace: str  # adapter digest; "" = the base model (also the prefix-cache namespace)
    sink: Sink
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopMatcher
    eos_token_ids: frozenset[int]
    deadline: float | None = None  # time.monotonic() seconds
    adapter_ref: str = ""  # the resolved "name@version" reported in GenerateComplete
    # The key of the request's sampling generator on the worker: unique for the process's life, unlike rid.
    uid: int = field(default_factory=_uids.__next__)
    tenant: str = ""  # who asked (fair share between tenants); "" without authentication
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    kv_slots: list[int] = field(default_factory=list)
    owned_pages: list[int] = field(default_factory=list)  # pages this request allocated
    prefix_node: object | None = None  # locked radix node of the matched prefix
    req_row: int = -1  # row in the request-to-token table; -1 when not resident
    lora_slot: int = -1  # GPU adapter slot while running with an adapter; -1 otherwise
    packed_adapter: object | None = None  # the adapter's host copy, fetched before submission
    cached_len: int = 0  # tokens taken from the prefix cache at the latest admission
    first_cached_len: int = -1  # cached prompt tokens at the first admission (Usage)
    is_cancelled: bool = False
    is_finished: bool = False

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids_between(self, start: int, end: int) -> list[int]:
        """all_ids[start:end], without joining the prompt and the output (a step plans each running
        request's next token this way)."""
        num_prompt = len(self.prompt_ids)
        if end <= num_prompt:
            return self.prompt_ids[start:end]
        if start >= num_prompt:
            return self.output_ids[start - num_prompt : end - num_prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - num_prompt]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def kv_len(self) -> int:
        return len(self.kv_slots)

    @property
    def num_pending(self) -> int:
        """Tokens whose K/V still have to be computed before the next sample."""
        return self.seq_len - self.kv_len

    def emit(self, event: Event) -> None:
        self.sink(event)
