"""Prometheus metrics of both services and the HTTP endpoint that serves them.

Each `*Metrics` object owns its own `CollectorRegistry`, never the process-wide default one: `loramux up`
runs both services in one process, and tests build many servers, so families must not collide.
Counters are exposed with the `_total` suffix prometheus_client adds (`requests` -> `..._requests_total`).
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from loramux.ready import announce

DEFAULT_MAX_ADAPTER_LABELS = 64
BASE_LABEL = "base"
OTHER_LABEL = "other"

# Seconds. Time to first token spans a cached decode (ms) to a long prefill behind a queue (s).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
FETCH_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LORA_LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REGISTRATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class AdapterLabels:
    """Maps adapter names to a bounded set of label values, so a thousand adapters stay few series.

    Invariants: "" and the base model's name map to "base"; a version suffix ("name@3") is dropped;
    the first `max_names` distinct names keep their own label for the life of the object, and every
    later name maps to "other". Safe to call from any thread.
    """

    def __init__(self, max_names: int = DEFAULT_MAX_ADAPTER_LABELS, base_model_name: str = ""):
        if max_names < 0:
            raise ValueError(f"max_names must be >= 0, not {max_names}")
        self.max_names = max_names
        self.base_model_name = base_model_name
        self._kept: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, adapter_name: str) -> str:
        name = adapter_name.partition("@")[0]
        if not name or name == self.base_model_name:
            return BASE_LABEL
        if name in self._kept:  # set membership is atomic under the GIL; the lock guards growth
            return name
        with self._lock:
            if name in self._kept or len(self._kept) < self.max_names:
                self._kept.add(name)
                return name
        return OTHER_LABEL

    @property
    def num_kept(self) -> int:
        return len(self._kept)


class EngineMetrics:
    """Metrics of the engine: its own families are named `loramux_engine_*`; the model-server protocol's
    (ModelServerMetrics) carry vLLM's names.

    Per-adapter families take `adapter=self.adapter_label(name)`, never a raw name.
    """

    def __init__(self, max_adapter_labels: int = DEFAULT_MAX_ADAPTER_LABELS, base_model_name: str = ""):
        self.registry = CollectorRegistry()
        self.adapter_label = AdapterLabels(max_adapter_labels, base_model_name)
        self._add_request_families()
        self._add_adapter_families()
        self._add_residency_families()
        self.model_server = ModelServerMetrics(self.registry, base_model_name)

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(f"loramux_engine_{name}", doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(f"loramux_engine_{name}", doc, registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(f"loramux_engine_{name}", doc, buckets=buckets, registry=self.registry)

    def _add_request_families(self) -> None:
        self.requests = self._counter(
            "requests", "Finished requests by adapter and outcome (finish reason or gRPC error code).",
            ("adapter", "outcome"),
        )
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of finished requests.", ("adapter",))
        self.generated_tokens = self._counter("generated_tokens", "Generated tokens.", ("adapter",))
        self.cached_prompt_tokens = self._counter(
            "cached_prompt_tokens", "Prompt tokens served from the prefix cache.", ("adapter",)
        )
        self.time_to_first_token = self._histogram(
            "time_to_first_token_seconds", "From arrival to the first generated token.", TTFT_BUCKETS
        )
        self.time_per_output_token = self._histogram(
            "time_per_output_token_seconds", "Mean time between generated tokens of a request.", TPOT_BUCKETS
        )
        self.request_latency = self._histogram(
            "request_latency_seconds", "From arrival to the last token or error.", LATENCY_BUCKETS
        )
        self.num_waiting = self._gauge("requests_waiting", "Requests queued, not yet scheduled.")
        self.num_running = self._gauge("requests_running", "Requests in the running batch.")

    def _add_adapter_families(self) -> None:
        self.slots_used = self._gauge("lora_slots_used", "GPU LoRA slots holding an adapter.")
        self.slots_pinned = self._gauge("lora_slots_pinned", "GPU LoRA slots holding a pinned adapter.")
        self.slots_total = self._gauge("lora_slots_total", "GPU LoRA slots allocated at start.")
        self.host_cache_hits = self._counter("host_cache_hits", "Adapter lookups found in the host cache.")
        self.host_cache_misses = self._counter(
            "host_cache_misses", "Adapter lookups missing the host cache; each started one fetch."
        )
        self.host_cache_joined = self._counter(
            "host_cache_joined", "Adapter lookups that waited for the same adapter's fetch already in flight."
        )
        self.host_cache_size = self._gauge("host_cache_adapters", "Adapters held in the host cache.")
        self.adapter_loads = self._counter("adapter_loads", "Adapters loaded into a GPU slot.")
        self.adapter_loads_ahead = self._counter(
            "adapter_loads_ahead", "Of adapter_loads, those planned for a waiting request before its turn."
        )
        self.adapter_evictions = self._counter("adapter_evictions", "Adapters evicted from a GPU slot.")
        self.adapter_fetch_bytes = self._counter("adapter_fetch_bytes", "Artifact bytes fetched from the registry.")
        self.adapter_fetch_latency = self._histogram(
            "adapter_fetch_seconds", "Fetching one adapter from the registry.", FETCH_BUCKETS
        )
        self.drain_events = self._counter(
            "lora_drain_events", "Starvation drains: a running adapter stopped admitting to free its slot."
        )

    def _add_residency_families(self) -> None:
        labels = ("adapter",)
        self.adapter_loaded = Gauge(
            "loramux_engine_lora_adapter_loaded", "1 when the adapter is loaded at `location` (gpu: a slot; cpu: the host cache).",
            ("adapter", "location"), registry=self.registry,
        )
        self.adapter_pinned = Gauge("loramux_engine_lora_adapter_pinned", "1 when the adapter is pinned in a GPU slot.", labels, registry=self.registry)
        self.adapter_rank = Gauge("loramux_engine_lora_adapter_rank", "The adapter's LoRA rank.", labels, registry=self.registry)
        self.lora_load_latency = Histogram(
            "loramux_engine_lora_load_seconds", "Loading one adapter: into the host cache (cpu: fetch, check, pack) or into a GPU slot (gpu).",
            ("location",), buckets=LORA_LOAD_BUCKETS, registry=self.registry,
        )
        self.adapter_prep_latency = Histogram(
            "loramux_engine_adapter_prep_seconds", "Checking and packing one fetched adapter on a packing thread (--adapter-prep-threads): waiting for a thread (wait) and running on it (run).",
            ("stage",), buckets=LORA_LOAD_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._resident: set[str] = set()

    def set_residency(self, adapters: Sequence[AdapterResidence]) -> None:
        """Every adapter on the GPU or in the host cache now; labels seen before and absent now drop to 0."""
        rows: dict[str, list] = {}
        for a in adapters:  # several names may share the "other" label: any loaded, any pinned, the largest rank
            row = rows.setdefault(self.adapter_label(a.name), [False, False, False, 0])
            row[0], row[1], row[2], row[3] = row[0] or a.on_gpu, row[1] or a.on_cpu, row[2] or a.pinned, max(row[3], a.rank)
        for label in self._resident - rows.keys():
            rows[label] = [False, False, False, None]
        for label, (on_gpu, on_cpu, pinned, rank) in rows.items():
            self.adapter_loaded.labels(label, "gpu").set(on_gpu)
            self.adapter_loaded.labels(label, "cpu").set(on_cpu)
            self.adapter_pinned.labels(label).set(pinned)
            if rank is not None:
                self.adapter_rank.labels(label).set(rank)
        self._resident = {label for label, row in rows.items() if row[3] is not None}

    def record_finished(
        self,
        adapter_name: str,
        outcome: str,
        *,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        num_generated_tokens: int,
        latency_s: float,
        first_token_s: float | None = None,
    ) -> None:
        """Record one finished request, time to first token included (observe it nowhere else).

        `first_token_s` (arrival -> first token) is None when no token came; time per output token is
        (latency - first token) / (tokens - 1), recorded only for >= 2 tokens."""
        label = self.adapter_label(adapter_name)
        self.requests.labels(label, outcome).inc()
        self.prompt_tokens.labels(label).inc(num_prompt_tokens)
        self.cached_prompt_tokens.labels(label).inc(num_cached_tokens)
        self.generated_tokens.labels(label).inc(num_generated_tokens)
        self.request_latency.observe(latency_s)
        if first_token_s is None:
            return
        self.time_to_first_token.observe(first_token_s)
        if num_generated_tokens >= 2:
            self.time_per_output_token.observe((latency_s - first_token_s) / (num_generated_tokens - 1))

    def set_queue(self, num_waiting: int, num_running: int) -> None:
        self.num_waiting.set(num_waiting)
        self.num_running.set(num_running)
        self.model_server.set_queue(num_waiting, num_running)

    def set_slots(self, num_used: int, num_pinned: int, num_total: int) -> None:
        self.slots_used.set(num_used)
        self.slots_pinned.set(num_pinned)
        self.slots_total.set(num_total)


@dataclass(frozen=True)
class AdapterResidence:
    name: str
    on_gpu: bool
    on_cpu: bool
    pinned: bool
    rank: int


class ModelServerMetrics:
    """The model-server protocol of the Kubernetes Gateway API Inference Extension (its
    docs/proposals/003-model-server-protocol), with vLLM's names and semantics, so its endpoint picker
    (and llm-d's) scores loramux pods by queue, KV use and LoRA affinity with no custom plugin:

    - `vllm:num_requests_waiting`, `vllm:num_requests_running`: gauges;
    - `vllm:kv_cache_usage_perc` (and its older name `vllm:gpu_cache_usage_perc`): KV pages held by
      requests over usable pages, 0-1 (pages the prefix cache could evict count as free, as in vLLM);
    - `vllm:cache_config_info{block_size, num_gpu_blocks}`: value 1;
    - `vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}`: the adapter
      names (as clients write them in `model`, without a version) of running and waiting requests,
      comma-separated with no spaces, sorted; the value is the Unix time of the last change, since the
      picker takes the series with the largest value. Only the current series is exported.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.model_name = model_name
        model = ("model_name",)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", model, registry=registry)
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", model, registry=registry)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every page is held.", model, registry=registry)
        # The name the protocol's table and older endpoint pickers read by default; the same value.
        self.kv_usage_legacy = Gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (older name).", model, registry=registry)
        self.cache_config = Gauge(
            "vllm:cache_config_info", "KV-cache configuration.", ("block_size", "num_gpu_blocks"), registry=registry
        )
        self.lora_info = Gauge(
            "vllm:lora_requests_info", "Adapters of running and waiting requests; the value is the time of the last change.",
            ("max_lora", "running_lora_adapters", "waiting_lora_adapters"), registry=registry,
        )
        self._lora_labels: tuple[str, str, str] | None = None
        self._lock = threading.Lock()

    def set_queue(self, num_waiting: int, num_running: int) -> None:
        self.waiting.labels(self.model_name).set(num_waiting)
        self.running.labels(self.model_name).set(num_running)

    def set_kv_usage(self, fraction: float) -> None:
        self.kv_usage.labels(self.model_name).set(fraction)
        self.kv_usage_legacy.labels(self.model_name).set(fraction)

    def set_cache_config(self, block_size: int, num_blocks: int) -> None:
        self.cache_config.labels(str(block_size), str(num_blocks)).set(1)

    def set_lora_requests(self, max_lora: int, running: Iterable[str], waiting: Iterable[str], now: float | None = None) -> None:
        labels = (str(max_lora), ",".join(sorted(set(running))), ",".join(sorted(set(waiting))))
        with self._lock:
            if labels == self._lora_labels:
                return
            if self._lora_labels is not None:
                self.lora_info.remove(*self._lora_labels)
            self.lora_info.labels(*labels).set(time.time() if now is None else now)
            self._lora_labels = labels


class RegistryMetrics:
    """Metrics of the registry; every family is named `loramux_registry_*`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.rpcs = Counter(
            "loramux_registry_rpcs", "Finished RPCs by method and gRPC status code.", ("method", "code"),
            registry=r,
        )
        self.registration_latency = Histogram(
            "loramux_registry_registration_seconds", "Successful RegisterAdapter calls, upload included.",
            buckets=REGISTRATION_BUCKETS, registry=r,
        )
        self.uploaded_bytes = Counter("loramux_registry_uploaded_bytes", "Adapter file bytes received.", registry=r)
        self.fetched_bytes = Counter("loramux_registry_fetched_bytes", "Artifact bytes streamed out.", registry=r)
        self.adapters_registered = Counter(
            "loramux_registry_adapters_registered", "Adapter versions registered or imported.", registry=r
        )
        self.adapters_deleted = Counter("loramux_registry_adapters_deleted", "Adapter versions deleted.", registry=r)
        self.watchers = Gauge("loramux_registry_watchers", "Open WatchAdapters streams.", registry=r)

    def count_rpc(self, method: str, code: str) -> None:
        """`code` is a gRPC status name: "OK", "NOT_FOUND", ..."""
        self.rpcs.labels(method, code).inc()


def _registry_of(metrics: EngineMetrics | RegistryMetrics | Sequence) -> CollectorRegistry:
    if isinstance(metrics, EngineMetrics | RegistryMetrics):
        return metrics.registry
    combined = CollectorRegistry()  # collects from each registry; family names differ by prefix
    for one in metrics:
        combined.register(one.registry)
    return combined


class MetricsServer:
    """The HTTP endpoint (GET /metrics) of one metrics object, served from a daemon thread."""

    def __init__(self, httpd: WSGIServer, thread: threading.Thread):
        self.httpd = httpd
        self.thread = thread

    @property
    def port(self) -> int:
        return self.httpd.server_port

    def shutdown(self) -> None:
        """Stop serving and close the socket; blocks up to one poll interval (0.5 s)."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


def start_metrics_server(
    metrics: EngineMetrics | RegistryMetrics | Sequence[EngineMetrics | RegistryMetrics], host: str, port: int
) -> tuple[MetricsServer, int]:
    """Serve the metrics on host:port (0 = pick a free port) and print the ready line.

    A sequence serves several services' metrics on one port (`loramux up --metrics-port`)."""
    try:
        httpd, thread = start_http_server(port, addr=host, registry=_registry_of(metrics))
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise OSError(f"cannot listen on {host}:{port} (metrics): the port is taken; pick another --metrics-port") from None
    server = MetricsServer(httpd, thread)
    announce("metrics", host, server.port)
    return server, server.port
