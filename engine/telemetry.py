"""Feeding the engine's Prometheus metrics: per-request outcomes from the servicer, and per-step
gauges and counter deltas sampled on the loop thread (owners keep plain integer counters)."""

from __future__ import annotations

from engine.lora_manager import LoraManager
from engine.scheduler import Scheduler
from loramux.metrics import EngineMetrics


class StepSampler:
    """Called after every engine step; turns the owners' running totals into metric increments."""

    def __init__(self, metrics: EngineMetrics, scheduler: Scheduler, lora: LoraManager | None):
        self.metrics = metrics
        self.scheduler = scheduler
        self.lora = lora
        self._seen: dict[str, int] = {}

    def __call__(self) -> None:
        m, scheduler, lora = self.metrics, self.scheduler, self.lora
        m.set_queue(len(scheduler.waiting), len(scheduler.running))
        drain = getattr(scheduler, "drain", None)
        if drain is not None:
            self._add(m.drain_events, "drains", drain.num_drains)
        if lora is None:
            return
        slots = lora.slots.slots
        m.set_slots(sum(s.digest is not None for s in slots), sum(s.is_pinned for s in slots), len(slots))
        m.host_cache_size.set(len(lora.host_cache))
        self._add(m.host_cache_hits, "hits", lora.host_cache.num_hits)
        self._add(m.host_cache_misses, "misses", lora.host_cache.num_misses)
        self._add(m.adapter_loads, "loads", lora.slots.num_loads)
        self._add(m.adapter_evictions, "evictions", lora.slots.num_evictions)

    def _add(self, counter, key: str, total: int) -> None:
        delta = total - self._seen.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._seen[key] = total
