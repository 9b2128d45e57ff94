"""Prometheus metrics: bounded adapter labels, families, the HTTP endpoint, and the registry's counts."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import urllib.error
import urllib.request

import grpc
import prometheus_client
import pytest

from loramux.metrics import AdapterLabels, EngineMetrics, RegistryMetrics, start_metrics_server
from loramux.v1 import registry_pb2 as pb
from registry.config import RegistryConfig
from registry.server import serve
from tests.registry.harness import running_registry

ENGINE_FAMILIES = {
    "loramux_engine_requests": "counter",
    "loramux_engine_prompt_tokens": "counter",
    "loramux_engine_generated_tokens": "counter",
    "loramux_engine_cached_prompt_tokens": "counter",
    "loramux_engine_time_to_first_token_seconds": "histogram",
    "loramux_engine_time_per_output_token_seconds": "histogram",
    "loramux_engine_request_latency_seconds": "histogram",
    "loramux_engine_requests_waiting": "gauge",
    "loramux_engine_requests_running": "gauge",
    "loramux_engine_lora_slots_used": "gauge",
    "loramux_engine_lora_slots_pinned": "gauge",
    "loramux_engine_lora_slots_total": "gauge",
    "loramux_engine_host_cache_hits": "counter",
    "loramux_engine_host_cache_misses": "counter",
    "loramux_engine_host_cache_joined": "counter",
    "loramux_engine_host_cache_adapters": "gauge",
    "loramux_engine_adapter_loads": "counter",
    "loramux_engine_adapter_loads_ahead": "counter",
    "loramux_engine_adapter_evictions": "counter",
    "loramux_engine_adapter_fetch_bytes": "counter",
    "loramux_engine_adapter_fetch_seconds": "histogram",
    "loramux_engine_lora_drain_events": "counter",
    "loramux_engine_lora_adapter_loaded": "gauge",
    "loramux_engine_lora_adapter_pinned": "gauge",
    "loramux_engine_lora_adapter_rank": "gauge",
    "loramux_engine_lora_load_seconds": "histogram",
    "loramux_engine_adapter_prep_seconds": "histogram",
    # the model-server protocol, with vLLM's names (tests/test_model_server_metrics.py reads them)
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:lora_requests_info": "gauge",
}
REGISTRY_FAMILIES = {
    "loramux_registry_rpcs": "counter",
    "loramux_registry_registration_seconds": "histogram",
    "loramux_registry_uploaded_bytes": "counter",
    "loramux_registry_fetched_bytes": "counter",
    "loramux_registry_adapters_registered": "counter",
    "loramux_registry_adapters_deleted": "counter",
    "loramux_registry_watchers": "gauge",
}


def families(metrics) -> dict[str, str]:
    return {family.name: family.type for family in metrics.registry.collect()}


def http_get(url: str) -> tuple[str, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
    with opener.open(url, timeout=5) as response:
        return response.headers["Content-Type"], response.read().decode()


async def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


# ---- adapter labels ------------------------------------------------------------------------------


def test_first_n_names_keep_their_label_and_later_ones_become_other():
    labels = AdapterLabels(max_names=3)
    assert [labels(n) for n in ("a", "b", "c", "d", "e")] == ["a", "b", "c", "other", "other"]
    assert labels("a") == "a" and labels("d") == "other"  # stable on repeat
    assert labels.num_kept == 3


def test_base_model_and_versions():
    labels = AdapterLabels(max_names=1, base_model_name="tiny")
    assert labels("") == "base"
    assert labels("tiny") == "base"
    assert labels("qv@3") == "qv"
    assert labels("qv@4") == "qv"  # versions share the name's series
    assert labels("mlp") == "other"
    assert AdapterLabels()("x") == "x" and AdapterLabels().max_names == 64


def test_labels_are_bounded_and_consistent_under_threads():
    labels = AdapterLabels(max_names=64)
    names = [f"adapter-{i}" for i in range(500)]
    barrier = threading.Barrier(8)
    seen: list[dict[str, str]] = [{} for _ in range(8)]

    def worker(index: int) -> None:
        order = names[:]
        random.Random(index).shuffle(order)
        barrier.wait()
        for _ in range(3):
            for name in order:
                seen[index][name] = labels(name)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(s == seen[0] for s in seen), "a name got different labels in different threads"
    kept = {name for name, label in seen[0].items() if label == name}
    assert len(kept) == 64 == labels.num_kept
    assert all(label == "other" for name, label in seen[0].items() if name not in kept)


# ---- families and registries ---------------------------------------------------------------------


def test_engine_and_registry_families_have_the_right_types():
    assert families(EngineMetrics()) == ENGINE_FAMILIES
    assert families(RegistryMetrics()) == REGISTRY_FAMILIES


def test_metrics_objects_do_not_collide_or_touch_the_default_registry():
    first, second = EngineMetrics(), EngineMetrics()
    RegistryMetrics(), RegistryMetrics()  # constructing twice in one process must not raise
    first.adapter_loads.inc(2)
    assert first.registry.get_sample_value("loramux_engine_adapter_loads_total") == 2
    assert second.registry.get_sample_value("loramux_engine_adapter_loads_total") == 0
    assert prometheus_client.REGISTRY.get_sample_value("loramux_engine_adapter_loads_total") is None


def test_record_finished_counts_tokens_and_timings_per_bounded_adapter():
    metrics = EngineMetrics(max_adapter_labels=1)
    for name in ("qv", "mlp"):
        metrics.record_finished(
            name, "stop", num_prompt_tokens=10, num_cached_tokens=4, num_generated_tokens=5,
            latency_s=0.5, first_token_s=0.1,
        )
    metrics.record_finished("", "CANCELLED", num_prompt_tokens=3, num_cached_tokens=0,
                            num_generated_tokens=0, latency_s=0.2)
    get = metrics.registry.get_sample_value
    assert get("loramux_engine_requests_total", {"adapter": "qv", "outcome": "stop"}) == 1
    assert get("loramux_engine_requests_total", {"adapter": "other", "outcome": "stop"}) == 1
    assert get("loramux_engine_requests_total", {"adapter": "base", "outcome": "CANCELLED"}) == 1
    assert get("loramux_engine_prompt_tokens_total", {"adapter": "qv"}) == 10
    assert get("loramux_engine_cached_prompt_tokens_total", {"adapter": "other"}) == 4
    assert get("loramux_engine_generated_tokens_total", {"adapter": "qv"}) == 5
    assert get("loramux_engine_request_latency_seconds_count") == 3
    assert get("loramux_engine_time_to_first_token_seconds_count") == 2
    assert get("loramux_engine_time_per_output_token_seconds_sum") == pytest.approx(2 * 0.4 / 4)
    metrics.set_queue(num_waiting=7, num_running=2)
    metrics.set_slots(num_used=3, num_pinned=1, num_total=4)
    assert get("loramux_engine_requests_waiting") == 7 and get("loramux_engine_lora_slots_total") == 4


# ---- HTTP endpoint -------------------------------------------------------------------------------


def test_endpoint_serves_the_text_format_on_a_free_loopback_port(capsys):
    metrics = EngineMetrics()
    metrics.requests.labels("qv", "length").inc()
    server, port = start_metrics_server(metrics, "127.0.0.1", 0)
    try:
        assert port > 0 and server.port == port
        assert capsys.readouterr().out == f"metrics listening on 127.0.0.1:{port}\n"
        content_type, text = http_get(f"http://127.0.0.1:{port}/metrics")
        assert content_type.startswith("text/plain")
        assert "# TYPE loramux_engine_requests_total counter" in text
        assert 'loramux_engine_requests_total{adapter="qv",outcome="length"} 1.0' in text
        assert "loramux_registry_" not in text and "python_gc_" not in text  # only this object's registry
    finally:
        server.shutdown()
    with pytest.raises(urllib.error.URLError):
        http_get(f"http://127.0.0.1:{port}/metrics")


def test_endpoint_serves_several_services_on_one_port(capsys):
    engine, registry = EngineMetrics(), RegistryMetrics()
    engine.adapter_loads.inc()
    registry.watchers.set(2)
    server, port = start_metrics_server([engine, registry], "127.0.0.1", 0)
    try:
        _, text = http_get(f"http://127.0.0.1:{port}/metrics")
    finally:
        server.shutdown()
    assert "loramux_engine_adapter_loads_total 1.0" in text
    assert "loramux_registry_watchers 2.0" in text


async def test_serve_starts_the_metrics_endpoint_when_given_a_port(tmp_path, capsys):
    stop = asyncio.Event()
    task = asyncio.create_task(serve(RegistryConfig(data_dir=tmp_path / "data", port=0), stop, metrics_port=0))
    printed: list[str] = []

    def announced() -> bool:
        printed.append(capsys.readouterr().out)
        return task.done() or "metrics listening" in "".join(printed)

    await wait_until(announced, 30)
    lines = "".join(printed).splitlines()
    line = next(line for line in lines if line.startswith("metrics listening on 127.0.0.1:"))
    _, text = http_get(f"http://{line.rsplit(' ', 1)[1]}/metrics")
    assert "# TYPE loramux_registry_rpcs_total counter" in text
    stop.set()
    await asyncio.wait_for(task, 30)


# ---- the registry's counts -----------------------------------------------------------------------


async def test_registry_counts_rpcs_bytes_and_registrations(tmp_path, tiny_llama_dir, make_adapter):
    adapter_dir = make_adapter("qv-r8", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    upload_size = sum(p.stat().st_size for p in adapter_dir.iterdir() if p.name.startswith("adapter_"))
    async with running_registry(tmp_path / "data", max_lora_rank=32) as harness:
        get = harness.server.metrics.registry.get_sample_value
        await harness.register_base("tiny", tiny_llama_dir)
        await harness.register("qv", adapter_dir, base_model="tiny")
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await harness.stub.GetAdapter(pb.GetAdapterRequest(name="nope"))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        _, artifact, _ = await harness.fetch("qv")
        with pytest.raises(grpc.aio.AioRpcError):
            await harness.fetch("nope")
        await harness.stub.DeleteAdapter(pb.DeleteAdapterRequest(name="qv"))

        def rpcs(method: str, code: str) -> float | None:
            return get("loramux_registry_rpcs_total", {"method": method, "code": code})

        assert rpcs("RegisterBaseModel", "OK") == 1
        assert rpcs("RegisterAdapter", "OK") == 1
        assert rpcs("GetAdapter", "NOT_FOUND") == 1
        assert rpcs("GetAdapter", "OK") is None
        assert rpcs("FetchAdapter", "OK") == 1
        assert rpcs("FetchAdapter", "NOT_FOUND") == 1
        assert rpcs("DeleteAdapter", "OK") == 1
        assert get("loramux_registry_fetched_bytes_total") == len(artifact) > 0
        assert get("loramux_registry_uploaded_bytes_total") == upload_size > 0
        assert get("loramux_registry_adapters_registered_total") == 1
        assert get("loramux_registry_adapters_deleted_total") == 1
        assert get("loramux_registry_registration_seconds_count") == 1


async def test_registry_counts_failed_registrations_and_open_watchers(tmp_path):
    async with running_registry(tmp_path / "data") as harness:
        get = harness.server.metrics.registry.get_sample_value
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await harness.register_files("x", {"adapter_model.bin": b"pickle"})
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        labels = {"method": "RegisterAdapter", "code": "INVALID_ARGUMENT"}
        assert get("loramux_registry_rpcs_total", labels) == 1
        assert get("loramux_registry_registration_seconds_count") == 0
        assert get("loramux_registry_adapters_registered_total") == 0

        stream = harness.stub.WatchAdapters(pb.WatchAdaptersRequest())
        await wait_until(lambda: get("loramux_registry_watchers") == 1)
        stream.cancel()
        await wait_until(lambda: get("loramux_registry_watchers") == 0)
        labels = {"method": "WatchAdapters", "code": "CANCELLED"}
        await wait_until(lambda: get("loramux_registry_rpcs_total", labels) == 1)
