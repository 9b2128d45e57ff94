"""Assembles and runs the engine service: the engine core, its loop thread, and the gRPC host."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from pathlib import Path

from engine.adapter_admin import AdapterAdmin
from engine.admission import Admission
from engine.auth import KeyChecker
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.http_front import HttpFront
from engine.registry_link import RegistryLink
from engine.request import TokenDelta
from engine.sampling import SamplingParams
from engine.servicer import EngineServicer
from engine.telemetry import StepSampler
from loramux.grpc_server import ServiceHost, serve_until_stopped
from loramux.metrics import EngineMetrics
from loramux.security import check_exposure
from loramux.v1 import engine_pb2, engine_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name


def warm_up(core: EngineCore, timeout: float = 600.0) -> None:
    """Run one short generation through the loop so the first client does not pay for start-up."""
    done = threading.Event()
    events = []

    def sink(event) -> None:
        events.append(event)
        if not isinstance(event, TokenDelta):
            done.set()

    prompt = core.tokenizer.encode("warm up")
    core.loop.submit(core.new_request(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True), sink, rid="warm-up"))
    if not done.wait(timeout):
        raise RuntimeError("the engine did not finish its warm-up generation")
    log.info("engine warm: a %d-token warm-up generation ran", len(prompt) + 2)


class EngineServer:
    """A started engine; create it in the event loop's thread, with a core built off the loop."""

    def __init__(self, config: EngineConfig, core: EngineCore):
        check_exposure(config.host, config.auth, config.allow_unauthenticated, "engine")
        if config.auth and not (config.registry and config.api_key):
            raise ValueError(
                "engine: --auth needs --registry and the engine's own key (--api-key or --api-key-file, role"
                " engine): clients' keys are checked through the registry"
            )
        self.config = config
        self.core = core
        self._frozen = False  # this engine froze the startup heap (freeze_startup_heap) and has not thawed it
        self.admin = AdapterAdmin(core)
        self.admission = Admission(core)
        self.metrics = EngineMetrics(base_model_name=core.base_model_name)
        core.metrics = self.metrics
        core.loop.after_step = StepSampler(
            self.metrics, core.loop.scheduler, core.lora, core.refs, core.workers.local.runner.recent_load_seconds
        )
        allocator = core.loop.scheduler.kv.allocator
        self.metrics.model_server.set_cache_config(allocator.page_size, allocator.num_usable_pages)
        if core.lora is not None:
            self.metrics.model_server.set_lora_requests(len(core.lora.slots.slots), [], [])
        # Prompts over max_prompt_bytes get a clear INVALID_ARGUMENT rather than gRPC's size error.
        self.host = ServiceHost([SERVICE_NAME], max_receive_bytes=max(16 << 20, 2 * config.max_prompt_bytes))
        self.host.add_servicer(engine_pb2_grpc.add_EngineServicer_to_server, EngineServicer(core, self.admin, self.admission))
        credentials = config.tls.server_credentials() if config.tls.is_on else None
        self.port = self.host.bind(config.host, config.port, credentials)
        self.http: HttpFront | None = None
        # A dead model worker ends the engine: health NOT_SERVING, admission closed, `failed` set (the
        # serving function then stops and exits non-zero). The loop reports it from another thread.
        self.failure: str | None = None
        self.failed = asyncio.Event()
        event_loop = asyncio.get_running_loop()
        core.loop.on_fatal = lambda message: event_loop.call_soon_threadsafe(self._on_fatal, message)

    def _on_fatal(self, message: str) -> None:
        self.failure = message
        self.admission.is_open = False
        self.failed.set()
        self._health_task = asyncio.ensure_future(self.host.set_serving(False))

    @property
    def address(self) -> str:
        return self.host.address

    async def start(self) -> None:
        """Serve at once (health says NOT_SERVING), then SERVING once the loop has warmed up."""
        await self.host.start()
        await self.host.set_serving(False)
        if self.config.registry:
            config_json = (Path(self.config.model_dir) / "config.json").read_text()
            self.core.link = RegistryLink(
                self.config.registry, self.core.base_model_name, config_json, self.core.on_registry_event,
                api_key=self.config.api_key, tls=self.config.tls, max_concurrent_fetches=self.config.max_concurrent_fetches,
                fetch_process=not self.config.disable_fetch_process, fetch_processes=self.config.fetch_processes,
            )
            if self.config.auth:
                self.admission.auth = KeyChecker(self.core.link.check_key, self.config.key_cache_s)
            try:
                await self.core.link.start()
            except BaseException:
                await self.host.stop(0)
                await self.core.link.close()
                raise
        self.core.loop.start()
        await asyncio.to_thread(warm_up, self.core)
        freeze_startup_heap()
        self._frozen = True
        self.admission.is_open = True
        await self.host.set_serving(True)

    async def start_http(self, port: int) -> int:
        """Serve the OpenAI-compatible HTTP front on the engine's host (0 = pick a free port)."""
        self.http = HttpFront(self.admission, self.admin, self.metrics.registry, 2 * self.config.max_prompt_bytes)
        return await self.http.start(self.config.host, port, self.config.tls.ssl_context() if self.config.tls.is_on else None)

    async def stop(self, grace: float | None = None) -> None:
        """Stop generating first, so every in-flight stream ends at once with UNAVAILABLE, then the hosts."""
        try:
            self.admission.is_open = False
            await self.host.set_serving(False)
            await asyncio.to_thread(self.core.close)  # the loop, the model workers, the packing threads
            await (self.host.stop() if grace is None else self.host.stop(grace))
            if self.http is not None:
                await self.http.stop()
            if self.core.link is not None:
                await self.core.link.close()
        finally:
            if self._frozen:
                self._frozen = False
                thaw_startup_heap()


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now (imported modules, the model, the tokenizer, the
    graphs' Python side: hundreds of thousands of objects) to the collector's permanent generation, so
    that the full collections serving triggers scan only what serving creates. Each full collection
    holds the GIL, so both the engine loop and the gRPC threads stop for it: with the startup heap in
    it, 100-400 ms on the 2-core VM (440k objects; BENCHMARKS.md), the inter-token latency spikes of
    the Zipf runs. vLLM freezes its startup heap the same way. Returns the objects frozen."""
    global _num_frozen
    with _freeze_lock:
        gc.collect()
        gc.freeze()
        _num_frozen += 1
        frozen = gc.get_freeze_count()
    log.info("engine: %d startup objects frozen out of garbage collection", frozen)
    return frozen


def thaw_startup_heap() -> None:
    """One started engine fewer; once none is left, every frozen object is collectable again (in a
    process that goes on: tests, benchmarks), since freezing is process-wide."""
    global _num_frozen
    with _freeze_lock:
        _num_frozen -= 1
        if _num_frozen == 0:
            gc.unfreeze()


_freeze_lock = threading.Lock()
_num_frozen = 0  # engines of this process that froze the heap and have not stopped


async def start_engine(config: EngineConfig) -> EngineServer:
    core = await asyncio.to_thread(EngineCore.build, config)
    try:
        server = EngineServer(config, core)
        await server.start()
    except BaseException:
        await asyncio.to_thread(core.close)  # spawned model workers must not outlive a failed start
        raise
    return server


def stop_on_failure(server: EngineServer, stop: asyncio.Event) -> asyncio.Task:
    """Set `stop` when the engine fails (a model worker died)."""

    async def relay() -> None:
        await server.failed.wait()
        stop.set()

    return asyncio.create_task(relay())


async def serve(config: EngineConfig, stop: asyncio.Event, metrics_port: int | None = None, http_port: int | None = None) -> None:
    """Run until `stop` is set, then stop gracefully; /metrics on config.host:metrics_port and the
    OpenAI-compatible HTTP front on config.host:http_port if given. Exits non-zero (SystemExit) when
    the engine failed (a model worker died) rather than was stopped."""
    server = await start_engine(config)
    if http_port is not None:
        await server.start_http(http_port)
    relay = stop_on_failure(server, stop)
    await serve_until_stopped("engine", server, stop, metrics_port)
    relay.cancel()
    if server.failure is not None:
        raise SystemExit(f"engine failed: {server.failure}")
