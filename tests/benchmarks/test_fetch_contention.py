"""benchmarks/fetch_contention.py on a tiny shape: every pass fetches every adapter once a round, whole,
at the switch interval it names, beside a busy thread or a busy event loop, and the process's interval
is put back; the rate counts the bytes the fetches received."""

import sys

import pytest

from benchmarks import fetch_contention
from engine.fetch_process import fetch_process_supported
from engine.registry_link import RegistryLink


def test_fetch_contention_smoke():
    before = sys.getswitchinterval()
    rows = fetch_contention.main(["--shape", "tiny", "--adapters", "2", "--concurrency", "1", "2", "--switch-interval-ms", "1"])
    assert [(r["busy_thread"], r["busy_loop_ms"], r["concurrency"]) for r in rows] == [
        (False, 0, 1), (False, 0, 2), (False, 1.0, 1), (False, 1.0, 2), (True, 0, 1), (True, 0, 2),
    ]  # fmt: skip
    assert all(r["switch_interval_ms"] == 1.0 for r in rows if r["busy_thread"])
    assert len({r["mb"] for r in rows}) == 1 and rows[0]["mb"] > 0
    assert all(r["mb_s"] > 0 for r in rows)
    assert sys.getswitchinterval() == before


@pytest.mark.skipif(not fetch_process_supported(), reason="the fetch process needs Linux")
def test_fetch_contention_through_the_fetch_process_too():
    rows = fetch_contention.main([
        "--shape", "tiny", "--adapters", "2", "--concurrency", "2", "--switch-interval-ms", "1", "--busy-loop-ms", "0",
        "--fetchers", "loop", "process",
    ])  # fmt: skip
    assert [(r["fetcher"], r["busy_thread"]) for r in rows] == [("loop", False), ("process", False), ("loop", True), ("process", True)]
    # /proc counts CPU in 10 ms ticks: a tiny pass may use less than one
    assert all(r["fetch_process_cpu_s_per_gb"] >= 0 and r["fetch_process_faults_per_mb"] >= 0 for r in rows if r["fetcher"] == "process")
    assert len({r["mb"] for r in rows}) == 1 and all(r["mb_s"] > 0 for r in rows)


def test_fetch_contention_without_the_busy_loop():
    rows = fetch_contention.main(["--shape", "tiny", "--adapters", "1", "--concurrency", "1", "--switch-interval-ms", "1", "--busy-loop-ms", "0"])
    assert [(r["busy_thread"], r["busy_loop_ms"]) for r in rows] == [(False, 0), (True, 0)]


def test_the_rate_counts_each_fetch_once(monkeypatch):
    """A pass's bytes are what its fetches received: 2 rounds x 2 adapters, the warm-up fetch not counted
    (two calls for one digest at once share one fetch, which a pass once counted twice)."""
    received = []
    fetch_once = RegistryLink._fetch_once

    async def counted(self, record):
        fetched = await fetch_once(self, record)
        received.append(len(fetched.data))
        return fetched

    monkeypatch.setattr(RegistryLink, "_fetch_once", counted)
    rows = fetch_contention.main([
        "--shape", "tiny", "--adapters", "2", "--concurrency", "2", "--switch-interval-ms", "1", "--busy-loop-ms", "0",
        "--rounds", "2",
    ])  # fmt: skip
    assert len(rows) == 2 and len(received) == 2 * (1 + 2 * 2)  # per pass: the warm-up, then 2 rounds of 2
    per_pass = sum(received[1:5])
    assert rows[0]["mb"] == round(per_pass / 1e6, 3) and rows[0]["fetches"] == 4
    if sys.platform.startswith("linux"):  # what each process spent, from /proc
        assert rows[0]["registry_cpu_s_per_gb"] >= 0 and rows[0]["engine_cpu_s_per_gb"] >= 0  # 10 ms ticks
        assert "fetch_process_cpu_s_per_gb" not in rows[0]  # the event loop's fetches: no child
    seconds = rows[0]["seconds"]  # rounded to 1 ms
    assert rows[0]["mb_s"] == pytest.approx(per_pass / 1e6 / seconds, rel=0.0006 / seconds + 0.001)


def test_fetch_contention_refuses_no_rounds():
    with pytest.raises(SystemExit):
        fetch_contention.main(["--rounds", "0"])


@pytest.mark.skipif(not fetch_process_supported(), reason="the fetch process needs Linux")
def test_fetch_contention_over_several_fetch_processes(monkeypatch):
    """A pass per number of fetch processes and concurrency (never more processes than fetches at once);
    the fetch processes' usage is the sum over all of them: each process's reading here goes up by one
    CPU second a pass, so two processes report twice the registry's CPU a GB."""
    readings: dict[int, int] = {}

    def usage(pid: int) -> tuple[float, int]:
        readings[pid] = readings.get(pid, 0) + 1
        return float(readings[pid]), 0

    monkeypatch.setattr(fetch_contention, "process_usage", usage)
    rows = fetch_contention.main([
        "--shape", "tiny", "--adapters", "2", "--concurrency", "1", "2", "--switch-interval-ms", "--busy-loop-ms", "0",
        "--fetchers", "process", "--fetch-processes", "1", "2",
    ])  # fmt: skip
    assert [(r["fetch_processes"], r["concurrency"]) for r in rows] == [(1, 1), (1, 2), (2, 2)]
    for row in rows:
        assert row["fetch_process_cpu_s_per_gb"] == pytest.approx(row["fetch_processes"] * row["registry_cpu_s_per_gb"], rel=1e-3)
        assert row["mb_s"] > 0 and row["fetches"] == 4
    with pytest.raises(SystemExit):
        fetch_contention.main(["--fetch-processes", "0"])
