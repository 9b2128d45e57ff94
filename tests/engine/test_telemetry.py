"""The loop's metrics sampler (engine/telemetry.py): it skips recomputing adapter names and residency
when the slots', the host cache's and the queue's state has not changed since its last step, so after
every change its gauges must equal those of a sampler that never sampled before."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.adapter_cache import HostAdapterCache
from engine.adapter_slots import AdapterSlots
from engine.kv_pool import PageAllocator, ReqToTokenPool
from engine.lora_manager import LoraManager
from engine.lora_pool import PackedAdapter
from engine.radix_cache import RadixCache
from engine.request_kv import RequestKV
from engine.scheduler import Scheduler, SchedulerConfig
from engine.telemetry import StepSampler
from loramux.metrics import EngineMetrics

FAMILIES = (
    "loramux_engine_lora_adapter_loaded", "loramux_engine_lora_adapter_pinned", "loramux_engine_lora_adapter_rank",
    "loramux_engine_lora_slots_used", "loramux_engine_lora_slots_pinned", "loramux_engine_lora_slots_total",
    "loramux_engine_host_cache_adapters", "vllm:lora_requests_info", "loramux_engine_requests_waiting",
)  # fmt: skip
DIGESTS = {name: name * 64 for name in "abcd"}
REFS = {digest: f"adapter-{name}@1" for name, digest in DIGESTS.items()}


def gauges(metrics: EngineMetrics) -> set[tuple]:
    """The sampled series of FAMILIES: (name, labels, value); lora_requests_info's value is the time of
    its latest change, so only its labels count."""
    found, series = set(), set()
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        if family.name in FAMILIES:
            found.add(family.name)
            for sample in family.samples:
                value = None if family.name == "vllm:lora_requests_info" else sample.value
                series.add((sample.name, tuple(sorted(sample.labels.items())), value))
    assert found == set(FAMILIES), set(FAMILIES) - found  # the names above are the families' real names
    return series


def assert_same(sampled: set[tuple], fresh: set[tuple], what: str) -> None:
    """A sampler's series equal a fresh one's, but for the adapters it saw before that are gone now,
    whose series it keeps at 0 (their rank at its last value)."""
    present = {dict(labels).get("adapter") for _, labels, _ in fresh}
    gone = {s for s in sampled if dict(s[1]).get("adapter") not in present}
    assert all(value == 0 for name, _, value in gone if not name.endswith("_rank")), (what, gone)
    assert sampled - gone == fresh, what


def packed(name: str, rank: int = 8) -> PackedAdapter:
    return PackedAdapter(DIGESTS[name], rank, 2.0, {}, {})


def request(name: str = "") -> SimpleNamespace:
    return SimpleNamespace(adapter_ref=REFS[DIGESTS[name]] if name else "")


@pytest.fixture
def engine():
    allocator = PageAllocator(64, 4)
    kv = RequestKV(allocator, ReqToTokenPool(4, 64), RadixCache(4, allocator))
    lora = LoraManager(AdapterSlots(2), HostAdapterCache(1))
    return Scheduler(SchedulerConfig(4, 64), kv, lora=lora), lora


def test_the_sampler_equals_a_fresh_one_after_every_change(engine):
    scheduler, lora = engine
    sampler = StepSampler(EngineMetrics(base_model_name="m"), scheduler, lora, REFS)
    a, b, c, d = (packed(n, rank) for n, rank in zip("abcd", (8, 4, 16, 2), strict=True))
    changes = [
        ("nothing yet", lambda: None),
        ("a cached", lambda: lora.host_cache.put(a)),
        ("a loaded for a running request", lambda: (lora.acquire(a.digest, a), scheduler.running.append(request("a")))),
        ("b queued, loaded ahead", lambda: (scheduler.waiting.append(request("b")), lora.load_ahead([(b.digest, b)], 1))),
        ("b pinned", lambda: lora.pin(b.digest, b)),
        ("the same step again", lambda: None),
        ("c cached, evicting nothing a slot holds", lambda: lora.host_cache.put(c)),
        ("d cached, evicting c", lambda: lora.host_cache.put(d)),
        ("b unpinned", lambda: lora.unpin(b.digest)),
        ("b's request runs", lambda: (lora.acquire(b.digest, b), scheduler.running.append(scheduler.waiting.popleft()))),
        ("a's request ends, a released and evicted", lambda: (scheduler.running.pop(0), lora.release(a.digest), lora.slots.evict(a.digest))),
        ("d discarded", lambda: lora.host_cache.discard(d.digest)),
        ("a base-model request queued", lambda: scheduler.waiting.append(request())),
        ("c loaded into the free slot", lambda: lora.acquire(c.digest, c)),
        ("b's request ends, b retired", lambda: (scheduler.running.pop(0), lora.release(b.digest), lora.retire(b.digest))),
    ]  # fmt: skip
    for what, change in changes:
        change()
        sampler()
        fresh = StepSampler(EngineMetrics(base_model_name="m"), scheduler, lora, REFS)
        fresh()
        assert_same(gauges(sampler.metrics), gauges(fresh.metrics), what)


def test_an_unchanged_step_recomputes_neither_names_nor_residency(engine, monkeypatch):
    scheduler, lora = engine
    sampler = StepSampler(EngineMetrics(base_model_name="m"), scheduler, lora, REFS)
    lora.acquire(DIGESTS["a"], packed("a"))
    scheduler.running.append(request("a"))
    sampler()
    calls = []
    monkeypatch.setattr(sampler.metrics, "set_residency", lambda rows: calls.append("residency"))
    monkeypatch.setattr(sampler.metrics.model_server, "set_lora_requests", lambda *args: calls.append("names"))
    sampler()
    sampler()
    assert calls == []
    scheduler.waiting.append(request("b"))
    sampler()
    assert calls == ["names"]
    lora.host_cache.put(packed("b"))
    sampler()
    assert calls == ["names", "residency"]
