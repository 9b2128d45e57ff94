"""The model-server metrics (loramux/metrics.py ModelServerMetrics) read with the endpoint picker's rules.

The rules are those of the Gateway API Inference Extension's endpoint picker, read in
kubernetes-sigs/gateway-api-inference-extension, pkg/epp/backend/metrics/metrics.go
(`promToPodMetrics`, `getLatestLoraMetric`, `getMetric` / `getLatestMetric`), and its model-server
protocol, docs/proposals/003-model-server-protocol/README.md. Written here in Python, from reading them:

1. the exposition is parsed as Prometheus text; a family it needs must exist and hold >= 1 series;
2. queue gauges: the first series of `vllm:num_requests_waiting` / `vllm:num_requests_running` (no
   label filter, timestamps absent), its value truncated to an int; KV usage: the value as a float;
3. LoRA: among the `vllm:lora_requests_info` series, those whose `running_lora_adapters` and
   `waiting_lora_adapters` are both empty are skipped; the one with the largest value (a timestamp)
   wins; its running and waiting labels are split on "," (no trimming: names must not carry spaces);
   `max_lora` is parsed as an integer (an error if it is not one).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loramux.metrics import EngineMetrics, ModelServerMetrics


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _first_value(families: dict, name: str) -> float:
    family = families.get(name)
    assert family is not None and family.samples, f"metric family {name!r} not found or empty"
    return family.samples[0].value


def parse_lora_info(text: str) -> dict | None:
    """The picker's view of `vllm:lora_requests_info`: {running, waiting, max_lora}, or None."""
    family = _families(text).get("vllm:lora_requests_info")
    assert family is not None, "metric family 'vllm:lora_requests_info' not found"
    latest, latest_value = None, 0.0
    for sample in family.samples:
        running = sample.labels.get("running_lora_adapters", "")
        waiting = sample.labels.get("waiting_lora_adapters", "")
        if running == "" and waiting == "":
            continue
        if sample.value > latest_value:
            latest, latest_value = sample, sample.value
    if latest is None:
        return None
    labels = latest.labels
    return {
        "running": labels["running_lora_adapters"].split(",") if labels["running_lora_adapters"] else [],
        "waiting": labels["waiting_lora_adapters"].split(",") if labels["waiting_lora_adapters"] else [],
        "max_lora": int(labels["max_lora"]),
    }


def parse_pod_metrics(text: str) -> dict:
    families = _families(text)
    return {
        "waiting": int(_first_value(families, "vllm:num_requests_waiting")),
        "running": int(_first_value(families, "vllm:num_requests_running")),
        "kv_usage": _first_value(families, "vllm:kv_cache_usage_perc"),
        "kv_usage_legacy": _first_value(families, "vllm:gpu_cache_usage_perc"),
        "lora": parse_lora_info(text),
    }


def _metrics() -> tuple[CollectorRegistry, ModelServerMetrics]:
    registry = CollectorRegistry()
    return registry, ModelServerMetrics(registry, "base-model")


def test_queue_kv_and_cache_config_as_the_picker_reads_them():
    registry, m = _metrics()
    m.set_queue(num_waiting=3, num_running=5)
    m.set_kv_usage(0.25)
    m.set_cache_config(block_size=16, num_blocks=4096)
    text = generate_latest(registry).decode()
    parsed = parse_pod_metrics(text)
    assert (parsed["waiting"], parsed["running"], parsed["kv_usage"], parsed["kv_usage_legacy"]) == (3, 5, 0.25, 0.25)
    config = _families(text)["vllm:cache_config_info"].samples
    assert [(s.labels, s.value) for s in config] == [({"block_size": "16", "num_gpu_blocks": "4096"}, 1.0)]


def test_lora_info_keeps_one_series_whose_value_is_the_last_change():
    registry, m = _metrics()
    m.set_lora_requests(8, [], [], now=100.0)
    assert parse_lora_info(generate_latest(registry).decode()) is None  # both empty: skipped by the picker
    m.set_lora_requests(8, ["b", "a", "a"], ["c"], now=200.0)
    text = generate_latest(registry).decode()
    assert parse_lora_info(text) == {"running": ["a", "b"], "waiting": ["c"], "max_lora": 8}
    m.set_lora_requests(8, ["a", "b"], ["c"], now=300.0)  # no change: the timestamp stays
    m.set_lora_requests(8, ["c"], [], now=400.0)
    text = generate_latest(registry).decode()
    samples = _families(text)["vllm:lora_requests_info"].samples
    assert len(samples) == 1 and samples[0].value == 400.0
    assert parse_lora_info(text) == {"running": ["c"], "waiting": [], "max_lora": 8}


def test_engine_metrics_carry_the_model_server_families():
    metrics = EngineMetrics(base_model_name="tiny")
    metrics.set_queue(2, 1)
    metrics.model_server.set_kv_usage(0.5)
    metrics.model_server.set_lora_requests(4, ["x"], [])
    parsed = parse_pod_metrics(generate_latest(metrics.registry).decode())
    assert parsed == {"waiting": 2, "running": 1, "kv_usage": 0.5, "kv_usage_legacy": 0.5,
                      "lora": {"running": ["x"], "waiting": [], "max_lora": 4}}
