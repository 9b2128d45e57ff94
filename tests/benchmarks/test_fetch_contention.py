"""benchmarks/fetch_contention.py on a tiny shape: every pass fetches every adapter twice, whole, at
the switch interval it names, and the process's interval is put back."""

import sys

from benchmarks import fetch_contention


def test_fetch_contention_smoke():
    before = sys.getswitchinterval()
    rows = fetch_contention.main(["--shape", "tiny", "--adapters", "2", "--concurrency", "1", "2", "--switch-interval-ms", "1"])
    assert [(r["busy_thread"], r["concurrency"]) for r in rows] == [(False, 1), (False, 2), (True, 1), (True, 2)]
    assert all(r["switch_interval_ms"] == 1.0 for r in rows if r["busy_thread"])
    assert len({r["mb"] for r in rows}) == 1 and rows[0]["mb"] > 0
    assert all(r["mb_s"] > 0 for r in rows)
    assert sys.getswitchinterval() == before
