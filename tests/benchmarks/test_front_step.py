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
