"""benchmarks/front_step.py runs, and every token event of every step reaches its handler's queue."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_front_step_benchmark_smoke():
    out = subprocess.run(
        [sys.executable, "benchmarks/front_step.py", "--batch", "6", "--steps", "12"],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=True,
    )  # fmt: skip
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["batch"] == 6 and row["front_step_ms"] > 0
    assert row["events_delivered"] == row["events_expected"] == 6 * 12


def test_front_step_benchmark_with_adapters_waiting_requests_and_overlap():
    """--adapters 3 --waiting 4 --overlap --metrics: 6 running requests over 3 adapters, 4 more queued behind them
    with adapters of their own; the 3 load at admission and the 4 ahead (2 a step), and every decode
    step after the first is a chained plan."""
    out = subprocess.run(
        [sys.executable, "benchmarks/front_step.py", "--batch", "6", "--steps", "12", "--adapters", "3", "--waiting", "4", "--overlap", "--metrics"],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=True,
    )  # fmt: skip
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert (row["adapters"], row["waiting"], row["overlap"], row["metrics"]) == (3, 4, True, True)
    assert row["events_delivered"] == row["events_expected"] == 6 * 12  # the queued requests never ran
    assert row["slot_loads"] == 3 + 4
    assert row["chained_steps"] == 12 - 2  # all but the prefill and the first decode, planned after it
