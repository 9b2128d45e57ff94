"""Assembles the engine from an EngineConfig: model, tokenizer, KV pools, scheduler, runner, loop;
and turns validated inputs into Requests."""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import json
import logging
import os
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.adapter_cache import HostAdapterCache, pack_adapter, packed_bytes
from engine.adapter_slots import AdapterSlots, SlotsExhausted
from engine.adapters import AdapterRecord, LocalAdapters, check_within, read_canonical_within
from engine.config import EngineConfig
from engine.drain import StarvationDrain
from engine.engine_loop import EngineLoop
from engine.errors import FailedPrecondition, NotFound, Unavailable
from engine.host_memory import host_memory_bytes
from engine.kv_pool import PageAllocator, ReqToTokenPool
from engine.lora_manager import LoraManager
from engine.lora_pool import PackedAdapter, fused_targets, served_modules
from engine.model_config import ModelConfig
from engine.parallel import TensorParallel, local_config
from engine.pinned_arena import PinnedArena, auto_arena_bytes
from engine.radix_cache import RadixCache
from engine.registry_link import RegistryLink
from engine.request import Request, Sink
from engine.request_kv import RequestKV
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.text import IncrementalDetokenizer, StopMatcher, Tokenizer
from engine.weights import default_dtype
from engine.worker import WorkerSpec, read_model_config, start_workers
from loraformat.model_shapes import ModelShape
from loramux.metrics import EngineMetrics

log = logging.getLogger(__name__)


class InvalidPrompt(ValueError):
    """A prompt the engine refuses (INVALID_ARGUMENT); the message names the field."""


@dataclass(frozen=True)
class LoadTiming:
    """Where one adapter load into the host cache spent its time, in seconds: getting the bytes (a
    registry fetch, its wait for a fetch turn included, or a local read), waiting for a packing thread,
    and checking and packing on it."""

    fetch: float
    pack_wait: float
    pack: float


MAX_LOAD_TIMINGS = 4096  # the newest loads EngineCore.load_timings keeps


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
    # the newest loads' LoadTiming, oldest first (benchmarks/serve.py reads them)
    load_timings: collections.deque[LoadTiming] = field(default_factory=lambda: collections.deque(maxlen=MAX_LOAD_TIMINGS))
    _closed: bool = False  # close() ran: no more adapter loads

    @classmethod
    def build(cls, config: EngineConfig) -> EngineCore:
        if config.gil_switch_interval_ms > 0:  # process-wide, as the GIL is
            sys.setswitchinterval(config.gil_switch_interval_ms / 1e3)
        model_config = read_model_config(config.model_dir)
        tp = TensorParallel(0, config.tensor_parallel_size)
        local_config(model_config, tp)  # a size that does not divide the model fails here, before any rank starts
        tokenizer = Tokenizer.from_dir(config.model_dir)
        max_context = config.max_context or model_config.max_position_embeddings
        served_modules(model_config, config.lora_target_modules)  # a name that is no projection fails here
        adapters = _local_adapters(config, model_config)
        workers = start_workers(WorkerSpec(config, max_context, tp))
        allocator = PageAllocator(workers.info.num_kv_slots // config.page_size, config.page_size)
        req_pool = ReqToTokenPool(config.max_running_requests, max_context)
        kv = RequestKV(allocator, req_pool, RadixCache(config.page_size, allocator))
        scheduler_config = SchedulerConfig(
            config.max_running_requests, config.max_batch_tokens, max_lora_load_ahead=config.lora_load_ahead
        )
        lora = None
        if config.max_loras_per_batch > 0:
            slots = AdapterSlots(config.max_loras_per_batch, config.lora_eviction_policy)
            lora = LoraManager(slots, HostAdapterCache(config.max_host_adapters))
        drain = StarvationDrain(config.lora_drain_wait_s) if lora is not None and config.lora_drain_wait_s > 0 else None
        overlap = config.device.startswith("cuda") and not config.disable_overlap_schedule  # on the CPU a launch runs the step
        loop = EngineLoop(Scheduler(scheduler_config, kv, lora=lora, drain=drain), workers, overlap=overlap)
        log.info(
            "engine: %s on %s x%d, %d KV slots (page %d), context %d, %s attention",
            config.model_dir, config.device, tp.size, allocator.num_slots, config.page_size, max_context, workers.info.attention_backend,
        )  # fmt: skip
        shape = ModelShape.from_config(json.loads((Path(config.model_dir) / "config.json").read_text()))
        core = cls(config, model_config, tokenizer, loop, max_context, adapters, lora, shape)
        if core.pinned_arena is not None:  # page-locked now, before serving, not by the first pack
            log.info("engine: %d MiB of pinned host memory for packed adapters", core.pinned_arena.capacity >> 20)
        return core

    @functools.cached_property
    def served(self) -> frozenset[str]:
        """The projections this engine's slots hold LoRA for (--lora-target-modules)."""
        return served_modules(self.model_config, self.config.lora_target_modules)

    @property
    def workers(self):
        return self.loop.workers

    def close(self) -> None:
        """Stop the loop and every model worker, and the adapter packing threads (a pack not yet started
        is dropped: its callers get UNAVAILABLE)."""
        self._closed = True
        self.loop.stop()
        if "_prep" in self.__dict__:
            self._prep.shutdown(wait=False, cancel_futures=True)

    @functools.cached_property
    def _prep(self) -> ThreadPoolExecutor:
        """The threads that read, check and pack adapters (--adapter-prep-threads), apart from asyncio's
        default threads: however many adapters arrive at once, only this many pack at a time, so the
        engine loop's launches wait for the GIL behind that many packers at most."""
        return ThreadPoolExecutor(self.config.adapter_prep_threads, thread_name_prefix="adapter-prep")

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

    def check_base_model(self, record: AdapterRecord, ref: str) -> None:
        """FailedPrecondition for an adapter made for another base model. Callers ask only once the
        caller may see the adapter: the answer names its base model."""
        if record.base_model and record.base_model != self.base_model_name:
            raise FailedPrecondition(
                f"adapter {ref!r} is for base model {record.base_model!r}; this engine serves {self.base_model_name!r}"
            )

    async def prepare(self, record: AdapterRecord) -> PackedAdapter:
        """The adapter's packed host copy: from the host cache, its local file, or a registry fetch.
        Concurrent callers for one digest share one load (fetch, check, pack, cache): the cache counts
        one miss for the caller that starts it and a joined lookup for each caller that waits on it."""
        packed = self.lora.host_cache.get(record.digest)
        if packed is not None:
            return packed
        # what the registry's metadata already says this engine refuses, before fetching (the artifact's
        # own check in _pack stays the authority)
        check_within(f"adapter {record.ref!r}", record.rank, record.target_modules, self.config.max_lora_rank, self.served)
        task = self._loading.get(record.digest)
        self.lora.host_cache.count_miss(joined=task is not None)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(record))
            self._loading[record.digest] = task
            task.add_done_callback(lambda _: self._loading.pop(record.digest, None))
        return await asyncio.shield(task)

    async def _load(self, record: AdapterRecord) -> PackedAdapter:
        """The one loading path of local and registry adapters: artifact bytes -> checked -> packed -> cached."""
        started = time.perf_counter()
        if record.path is not None:
            data, _, _ = await self._on_prep_thread(_read_artifact, record.path)
        else:
            data = await self.link.fetch(record)
            if self.metrics is not None:
                self.metrics.adapter_fetch_bytes.inc(len(data))
                self.metrics.adapter_fetch_latency.observe(time.perf_counter() - started)
        fetched = time.perf_counter()
        packed, wait_s, pack_s = await self._on_prep_thread(self._pack, record, data)
        self.lora.host_cache.put(packed)
        self.load_timings.append(LoadTiming(fetched - started, wait_s, pack_s))
        if self.metrics is not None:
            self.metrics.lora_load_latency.labels("cpu").observe(time.perf_counter() - started)
            self.metrics.adapter_prep_latency.labels("wait").observe(wait_s)
            self.metrics.adapter_prep_latency.labels("run").observe(pack_s)
        return packed

    async def _on_prep_thread(self, fn, *args) -> tuple[Any, float, float]:
        """fn(*args) on a packing thread -> (its result, seconds it waited for the thread, seconds it ran);
        UNAVAILABLE once the engine is closing (also for a call that close() dropped before it started)."""
        stopping = Unavailable("the engine is stopping: adapters are no longer loaded")
        if self._closed:
            raise stopping
        submitted = time.perf_counter()

        def timed():
            started = time.perf_counter()
            result = fn(*args)
            return result, started - submitted, time.perf_counter() - started

        try:
            return await asyncio.get_running_loop().run_in_executor(self._prep, timed)
        except RuntimeError:  # the executor was shut down between the check and the submit
            if self._closed:
                raise stopping from None
            raise
        except asyncio.CancelledError:
            if self._closed and not _current_task_cancelling():
                raise stopping from None
            raise

    def _pack(self, record: AdapterRecord, artifact: memoryview) -> PackedAdapter:
        digest = record.digest
        adapter = read_canonical_within(artifact, self.shape, self.config.max_lora_rank, f"adapter {record.ref!r}", self.served)
        targets = {t.name: t for t in fused_targets(self.model_config, self.config.lora_target_modules)}
        device = torch.device(self.config.device)
        dtype = self.adapter_dtype
        # One rank copies from pinned memory (async); several read one shared-memory copy across processes.
        shared = self.config.tensor_parallel_size > 1
        pin = device.type == "cuda" and not shared
        return pack_adapter(digest, adapter, targets, dtype, pin=pin, share=shared, arena=self.pinned_arena)

    @functools.cached_property
    def pinned_arena(self) -> PinnedArena | None:
        """--host-pinned-gb of page-locked memory for packed adapters (one GPU rank only), taken once;
        by default (None) `auto_arena_bytes` of it."""
        gb = self.config.host_pinned_gb
        if gb == 0:
            return None
        if self.lora is None or not self.config.device.startswith("cuda") or self.config.tensor_parallel_size > 1:
            if gb is not None:
                log.warning("--host-pinned-gb has no effect here: it serves one CUDA rank with LoRA on")
            return None
        if gb is None:
            cached = self.config.max_loras_per_batch + self.config.max_host_adapters  # the host cache's most
            nbytes = auto_arena_bytes(self.max_packed_bytes(), cached, host_memory_bytes())
            if nbytes <= 0:
                log.warning("no pinned arena: this host's memory size is unknown; --host-pinned-gb sets one")
                return None
            try:
                return PinnedArena(nbytes)
            except RuntimeError as exc:  # the driver would not page-lock it: adapters are pinned one by one
                log.warning("no pinned arena (%s): adapters are pinned as they are packed; --host-pinned-gb sets a size", exc)
                return None
        return PinnedArena(int(gb * (1 << 30)))

    def max_packed_bytes(self) -> int:
        """The most an adapter this engine serves packs to: its targets at --max-lora-rank."""
        targets = fused_targets(self.model_config, self.config.lora_target_modules)
        return packed_bytes(targets, self.model_config.num_layers, self.config.max_lora_rank, self.adapter_dtype)

    @property
    def adapter_dtype(self) -> torch.dtype:
        """The dtype adapters are packed in (the model's)."""
        return getattr(torch, self.config.dtype) if self.config.dtype else default_dtype(torch.device(self.config.device))

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
            try:  # an adapter this engine refuses (rank, projections) or no slot left: others still serve
                packed = await self.prepare(record)
                await asyncio.wrap_future(self.loop.call(lambda: lora.pin(record.digest, packed)))
            except (SlotsExhausted, FailedPrecondition) as exc:
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
            eos_token_ids=frozenset(itertools.chain(self.tokenizer.eos_token_ids, self.model_config.eos_token_ids)),
            deadline=deadline,
            tenant=tenant,
        )


def _current_task_cancelling() -> bool:
    """Whether the running task itself was asked to cancel (not just an awaited future it holds)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _read_artifact(path: Path) -> memoryview:
    """A local artifact's bytes in a writable buffer, which the safetensors reader keeps as it is; its
    pages are first touched by the read, which lets go of the GIL (a bytearray's zeroing holds it)."""
    with path.open("rb") as f:
        data = memoryview(np.empty(os.fstat(f.fileno()).st_size, np.uint8))
        size = f.readinto(data)
    return data[:size]


def _local_adapters(config: EngineConfig, model_config: ModelConfig) -> LocalAdapters:
    if not config.adapters:
        return LocalAdapters([])
    work_dir = Path(config.work_dir) if config.work_dir else Path(tempfile.mkdtemp(prefix="loramux-adapters-"))
    base_model = config.resolved_base_model_name
    specs = [(name, Path(path)) for name, path in config.adapters]
    served = served_modules(model_config, config.lora_target_modules)
    return LocalAdapters.compile_all(specs, Path(config.model_dir), base_model, config.max_lora_rank, work_dir, served)
