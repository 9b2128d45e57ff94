"""Assembles the engine from an EngineConfig: model, tokenizer, KV pools, scheduler, runner, loop;
and turns validated inputs into Requests."""

from __future__ import annotations

import itertools
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.forward_inputs import KVBuffers
from engine.kv_pool import PageAllocator, ReqToTokenPool
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.radix_cache import RadixCache
from engine.request import Request, Sink
from engine.request_kv import RequestKV
from engine.sampling import SamplingParams, make_generator
from engine.scheduler import Scheduler, SchedulerConfig
from engine.text import IncrementalDetokenizer, StopMatcher, Tokenizer
from engine.weights import load_model

log = logging.getLogger(__name__)
CPU_KV_SLOTS = 16384


class InvalidPrompt(ValueError):
    """A prompt the engine refuses (INVALID_ARGUMENT); the message names the field."""


@dataclass
class EngineCore:
    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Tokenizer
    loop: EngineLoop
    max_context: int

    @classmethod
    def build(cls, config: EngineConfig) -> EngineCore:
        device = torch.device(config.device)
        dtype = getattr(torch, config.dtype) if config.dtype else None
        model, model_config = load_model(config.model_dir, device=device, dtype=dtype)
        tokenizer = Tokenizer.from_dir(config.model_dir)
        max_context = config.max_context or model_config.max_position_embeddings
        num_slots = config.num_kv_slots or _auto_kv_slots(model_config, device, next(model.parameters()).dtype, config)
        num_pages = max(2, num_slots // config.page_size)
        allocator = PageAllocator(num_pages, config.page_size)
        req_pool = ReqToTokenPool(config.max_running_requests, max_context, device=device)
        kv_buffers = KVBuffers.allocate(model_config, allocator.num_slots, next(model.parameters()).dtype, device)
        kv = RequestKV(allocator, req_pool, RadixCache(config.page_size, allocator))
        scheduler_config = SchedulerConfig(config.max_running_requests, config.max_batch_tokens)
        runner = ModelRunner(model, kv_buffers, req_pool.table, device, _attention_backend(config, device))
        loop = EngineLoop(Scheduler(scheduler_config, kv), runner)
        log.info("engine: %s on %s, %d KV slots (page %d), context %d, %s attention", config.model_dir, device, allocator.num_slots, config.page_size, max_context, runner.attention_backend)
        return cls(config, model_config, tokenizer, loop, max_context)

    @property
    def base_model_name(self) -> str:
        return self.config.base_model_name or Path(self.config.model_dir).resolve().name

    def prompt_ids(self, text: str | None, token_ids: list[int] | None) -> list[int]:
        """Tokenize or check a prompt; raises InvalidPrompt naming the problem."""
        if text is not None:
            if len(text.encode()) > self.config.max_prompt_bytes:
                raise InvalidPrompt(f"text: the prompt is {len(text.encode())} bytes; at most {self.config.max_prompt_bytes}")
            ids = self.tokenizer.encode(text)
        else:
            ids = list(token_ids or [])
            bad = next((t for t in ids if not 0 <= t < self.model_config.vocab_size), None)
            if bad is not None:
                raise InvalidPrompt(f"token_ids: {bad} is outside the vocabulary [0, {self.model_config.vocab_size})")
        if not ids or (text is not None and not text):
            raise InvalidPrompt("prompt: the prompt is empty")
        if len(ids) >= self.max_context:
            raise InvalidPrompt(f"prompt: {len(ids)} tokens leave no room in the context of {self.max_context}")
        return ids

    def new_request(self, prompt_ids: list[int], params: SamplingParams, sink: Sink, *, rid: str = "", namespace: str = "", deadline: float | None = None) -> Request:
        params = params.resolve(len(prompt_ids), self.max_context)
        params.validate(self.model_config.vocab_size, self.max_context, len(prompt_ids))
        return Request(
            rid=rid or uuid.uuid4().hex,
            prompt_ids=prompt_ids,
            params=params,
            namespace=namespace,
            sink=sink,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids),
            stop_matcher=StopMatcher(params.stop),
            generator=None if params.is_greedy else make_generator(params.seed, self.config.device),
            eos_token_ids=frozenset(itertools.chain(self.tokenizer.eos_token_ids, self.model_config.eos_token_ids)),
            deadline=deadline,
        )


def _auto_kv_slots(model_config: ModelConfig, device: torch.device, dtype: torch.dtype, config: EngineConfig) -> int:
    if device.type != "cuda":
        return CPU_KV_SLOTS
    free, _ = torch.cuda.mem_get_info(device)
    bytes_per_slot = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * dtype.itemsize
    return int(free * config.kv_memory_fraction) // bytes_per_slot


def _attention_backend(config: EngineConfig, device: torch.device) -> str:
    if config.attention_backend not in ("", "ref", "sdpa"):
        raise ValueError(f"attention_backend must be '', 'ref' or 'sdpa', not {config.attention_backend!r}")
    return config.attention_backend or ("sdpa" if device.type == "cuda" else "ref")
