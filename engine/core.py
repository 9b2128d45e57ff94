"""Assembles the engine from an EngineConfig: model, tokenizer, KV pools, scheduler, runner, loop;
and turns validated inputs into Requests."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.adapter_cache import HostAdapterCache, pack_adapter
from engine.adapter_slots import AdapterSlots, SlotsExhausted
from engine.adapters import AdapterRecord, LocalAdapters, read_canonical_within
from engine.config import EngineConfig
from engine.drain import StarvationDrain
from engine.engine_loop import EngineLoop
from engine.errors import NotFound
from engine.forward_inputs import KVBuffers
from engine.kv_pool import PageAllocator, ReqToTokenPool, num_slots_for_memory
from engine.lora_manager import LoraManager
from engine.lora_pool import LoraSlotPool, PackedAdapter
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.radix_cache import RadixCache
from engine.registry_link import RegistryLink
from engine.request import Request, Sink
from engine.request_kv import RequestKV
from engine.sampling import SamplingParams, make_generator
from engine.scheduler import Scheduler, SchedulerConfig
from engine.text import IncrementalDetokenizer, StopMatcher, Tokenizer
from engine.weights import load_model
from loraformat.model_shapes import ModelShape
from loraformat.peft_compile import read_canonical
from loramux.metrics import EngineMetrics

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
    adapters: LocalAdapters
    lora: LoraManager | None
    shape: ModelShape
    link: RegistryLink | None = None  # set by the server once it has an event loop
    refs: dict[str, str] = field(default_factory=dict)  # digest -> "name@version" of adapters seen
    metrics: EngineMetrics | None = None
    _loading: dict[str, asyncio.Task] = field(default_factory=dict)  # digest -> load in progress

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
        adapters = _local_adapters(config)
        lora = _lora_manager(config, model_config, adapters, next(model.parameters()).dtype, device)
        lora_pool = lora.pool if lora is not None else None
        runner = ModelRunner(
            model, kv_buffers, req_pool.table, device, _attention_backend(config, device), lora_pool, _lora_backend(config, device)
        )
        drain = StarvationDrain(config.lora_drain_wait_s) if lora is not None and config.lora_drain_wait_s > 0 else None
        if device.type == "cuda" and config.cuda_graph_max_batch > 0:
            runner.enable_cuda_graphs(min(config.cuda_graph_max_batch, config.max_running_requests))
        loop = EngineLoop(Scheduler(scheduler_config, kv, lora=lora, drain=drain), runner)
        log.info("engine: %s on %s, %d KV slots (page %d), context %d, %s attention", config.model_dir, device, allocator.num_slots, config.page_size, max_context, runner.attention_backend)
        shape = ModelShape.from_config(json.loads((Path(config.model_dir) / "config.json").read_text()))
        return cls(config, model_config, tokenizer, loop, max_context, adapters, lora, shape)

    @property
    def base_model_name(self) -> str:
        return self.config.resolved_base_model_name

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

    def resolve_adapter(self, ref: str) -> AdapterRecord | None:
        """Local adapters only: '' -> None (the base model); 'name' / 'name@N' -> its record."""
        if not ref:
            return None
        if self.lora is None:
            raise NotFound(f"adapter {ref!r}: this engine serves no adapters (--max-loras-per-batch 0)")
        return self.adapters.resolve(ref)

    async def resolve(self, ref: str) -> AdapterRecord | None:
        """Local adapters first, then the registry; an unknown adapter is NotFound, never the base model."""
        try:
            record = self.resolve_adapter(ref)
        except NotFound:
            if self.link is None or self.lora is None:
                raise
            record = await self.link.resolve(ref)
        if record is not None:
            self.refs[record.digest] = record.ref
        return record

    async def prepare(self, record: AdapterRecord) -> PackedAdapter:
        """The adapter's packed host copy: from the host cache, its local file, or a registry fetch.
        Concurrent callers for one digest share one load (fetch, check, pack, cache)."""
        packed = self.lora.host_cache.get(record.digest)
        if packed is not None:
            return packed
        task = self._loading.get(record.digest)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(record))
            self._loading[record.digest] = task
            task.add_done_callback(lambda _: self._loading.pop(record.digest, None))
        return await asyncio.shield(task)

    async def _load(self, record: AdapterRecord) -> PackedAdapter:
        started = time.monotonic()
        if record.path is not None:
            packed = await asyncio.to_thread(self.lora.fetch, record.digest)
        else:
            data = await self.link.fetch(record)
            if self.metrics is not None:
                self.metrics.adapter_fetch_bytes.inc(len(data))
                self.metrics.adapter_fetch_latency.observe(time.monotonic() - started)
            packed = await asyncio.to_thread(self._pack, record.digest, data)
        self.lora.host_cache.put(packed)
        if self.metrics is not None:
            self.metrics.lora_load_latency.labels("cpu").observe(time.monotonic() - started)
        return packed

    def _pack(self, digest: str, artifact: bytes) -> PackedAdapter:
        adapter = read_canonical_within(artifact, self.shape, self.config.max_lora_rank, f"adapter {digest[:12]}")
        pool = self.lora.pool
        return pack_adapter(digest, adapter, pool.targets, pool.a["qkv"].dtype, pool.device.type == "cuda")

    async def on_registry_event(self, kind: str, record: AdapterRecord) -> None:
        """WatchAdapters events, in order: deletions, pins and unpins (RegistryLink filters deletes of
        content that another name or version still uses)."""
        if self.lora is None:
            return
        lora = self.lora
        self.refs.setdefault(record.digest, record.ref)
        if kind == "DELETED":
            await asyncio.wrap_future(self.loop.call(lambda: lora.retire(record.digest)))
        elif kind == "UNPINNED":
            await asyncio.wrap_future(self.loop.call(lambda: lora.unpin(record.digest)))
        elif kind == "PINNED":
            packed = await self.prepare(record)
            try:
                await asyncio.wrap_future(self.loop.call(lambda: lora.pin(record.digest, packed)))
            except SlotsExhausted as exc:
                log.warning("cannot pin %s: %s", record.ref, exc)


    def new_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        *,
        rid: str = "",
        adapter: AdapterRecord | None = None,
        packed: PackedAdapter | None = None,
        deadline: float | None = None,
        tenant: str = "",
    ) -> Request:
        params = params.resolve(len(prompt_ids), self.max_context)
        params.validate(self.model_config.vocab_size, self.max_context, len(prompt_ids))
        return Request(
            rid=rid or uuid.uuid4().hex,
            prompt_ids=prompt_ids,
            params=params,
            namespace=adapter.digest if adapter else "",
            adapter_ref=adapter.ref if adapter else "",
            packed_adapter=packed,
            sink=sink,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids),
            stop_matcher=StopMatcher(params.stop),
            generator=None if params.is_greedy else make_generator(params.seed, self.config.device),
            eos_token_ids=frozenset(itertools.chain(self.tokenizer.eos_token_ids, self.model_config.eos_token_ids)),
            deadline=deadline,
            tenant=tenant,
        )


def _local_adapters(config: EngineConfig) -> LocalAdapters:
    if not config.adapters:
        return LocalAdapters([])
    work_dir = Path(config.work_dir) if config.work_dir else Path(tempfile.mkdtemp(prefix="loramux-adapters-"))
    base_model = config.resolved_base_model_name
    specs = [(name, Path(path)) for name, path in config.adapters]
    return LocalAdapters.compile_all(specs, Path(config.model_dir), base_model, config.max_lora_rank, work_dir)


def _lora_manager(config: EngineConfig, model_config: ModelConfig, adapters: LocalAdapters, dtype: torch.dtype, device: torch.device) -> LoraManager | None:
    if config.max_loras_per_batch <= 0:
        return None
    pool = LoraSlotPool(model_config, config.max_loras_per_batch, config.max_lora_rank, dtype, device)
    slots = AdapterSlots(pool, config.lora_eviction_policy)
    pin = device.type == "cuda"

    def fetch(digest: str) -> PackedAdapter:  # local files; registry adapters arrive packed (EngineCore.prepare)
        canonical = read_canonical(adapters.by_digest(digest).path)
        return pack_adapter(digest, canonical, pool.targets, dtype, pin)

    return LoraManager(pool, slots, HostAdapterCache(config.max_host_adapters), fetch)


def _lora_backend(config: EngineConfig, device: torch.device) -> str:
    return config.lora_backend or ("triton" if device.type == "cuda" else "ref")


def _auto_kv_slots(model_config: ModelConfig, device: torch.device, dtype: torch.dtype, config: EngineConfig) -> int:
    if device.type != "cuda":
        return CPU_KV_SLOTS
    free, _ = torch.cuda.mem_get_info(device)
    c = model_config
    return num_slots_for_memory(free, config.kv_memory_fraction, c.num_layers, c.num_kv_heads, c.head_dim, dtype)


def _attention_backend(config: EngineConfig, device: torch.device) -> str:
    if config.attention_backend not in ("", "ref", "sdpa"):
        raise ValueError(f"attention_backend must be '', 'ref' or 'sdpa', not {config.attention_backend!r}")
    return config.attention_backend or ("sdpa" if device.type == "cuda" else "ref")
