"""benchmarks/copy_rate.py: the copy rate benchmarks divide by, given or measured on their device."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import copy_rate

ROOT = Path(__file__).resolve().parents[2]


def test_a_given_rate_is_kept_and_zero_measures_on_the_device(monkeypatch):
    measured = []
    monkeypatch.setattr(copy_rate, "measure_copy_gbps", lambda device, nbytes: measured.append((device.type, nbytes)) or 1234.5)
    assert copy_rate.resolve_copy_gbps(3350.0, torch.device("cpu")) == 3350.0 and not measured
    assert copy_rate.resolve_copy_gbps(0.0, torch.device("cpu")) == 1234.5
    assert measured == [("cpu", 64 << 20)]
    with pytest.raises(ValueError, match="must be >= 0"):
        copy_rate.resolve_copy_gbps(-1.0, torch.device("cpu"))


def test_the_rate_counts_bytes_read_and_written_over_the_median_copy(monkeypatch):
    ticks = iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])  # copies of 1, 3 and 2 s: the median 2 s
    monkeypatch.setattr(copy_rate.time, "perf_counter", lambda: next(ticks))
    assert copy_rate.measure_copy_gbps(torch.device("cpu"), nbytes=10**9, reps=3) == pytest.approx(1.0)


def test_the_script_prints_its_device_s_rate():
    done = subprocess.run(
        [sys.executable, "benchmarks/copy_rate.py", "--device", "cpu", "--mib", "16", "--reps", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)
    assert row["device"] == "cpu" and row["mib"] == 16 and row["copy_gbps"] > 0
