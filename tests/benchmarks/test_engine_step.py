"""benchmarks/engine_step.py's repeats and step-time spread; benchmarks/gpu_state.py's clock readings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import engine_step
from benchmarks.gpu_state import GpuState, reason_names

ROOT = Path(__file__).resolve().parents[2]


class FakeNvml:
    """pynvml's calls GpuState makes, answering from a script of readings."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

    def __init__(self, readings, fail_init=False):
        self.readings, self.fail_init, self.index, self.at = readings, fail_init, None, -1

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByIndex(self, index):
        self.index = index
        return "handle"

    def nvmlDeviceGetClockInfo(self, handle, which):
        self.at += which == self.NVML_CLOCK_SM  # each sample reads the SM clock first
        return self.readings[self.at]["sm" if which == self.NVML_CLOCK_SM else "mem"]

    def nvmlDeviceGetPowerUsage(self, handle):
        return self.readings[self.at]["mw"]

    def nvmlDeviceGetTemperature(self, handle, which):
        return self.readings[self.at]["c"]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self.readings[self.at]["reasons"]


READINGS = [
    {"sm": 1980, "mem": 2619, "mw": 512_300, "c": 51, "reasons": 0x1},
    {"sm": 1755, "mem": 2619, "mw": 699_800, "c": 58, "reasons": 0x4},
    {"sm": 1830, "mem": 2619, "mw": 688_000, "c": 60, "reasons": 0x0},
]


def test_gpu_state_gives_the_lowest_clocks_highest_power_and_every_limit_but_idle():
    nvml = FakeNvml(READINGS)
    gpu = GpuState(torch.device("cuda", 0), nvml=nvml)
    assert gpu.available
    for _ in READINGS:
        gpu.sample()
    summary = gpu.summary()
    assert summary == {
        "gpu_samples": 3, "sm_mhz_min": 1755, "sm_mhz_max": 1980, "mem_mhz_min": 2619, "power_w_max": 699.8, "temp_c_max": 60,
        "clock_limits": ["sw_power_cap"],
    }  # fmt: skip
    gpu.reset()
    assert gpu.summary() == {}


def test_gpu_state_off_cuda_or_without_nvml_measures_nothing():
    cpu = GpuState(torch.device("cpu"), nvml=FakeNvml(READINGS))
    broken = GpuState(torch.device("cuda", 0), nvml=FakeNvml(READINGS, fail_init=True))
    for gpu in (cpu, broken):
        assert not gpu.available
        gpu.sample()
        assert gpu.summary() == {}


def test_a_reading_nvml_refuses_ends_the_readings_not_the_benchmark():
    nvml = FakeNvml(READINGS)
    gpu = GpuState(torch.device("cuda", 0), nvml=nvml)
    gpu.sample()

    def refuse(handle):
        raise RuntimeError("Not Supported")

    nvml.nvmlDeviceGetPowerUsage = refuse
    gpu.sample()
    gpu.sample()  # no further reading is tried
    assert nvml.at == 1 and not gpu.available
    summary = gpu.summary()
    assert summary["gpu_samples"] == 1 and summary["sm_mhz_min"] == 1980
    assert summary["gpu_state_error"] == "RuntimeError: Not Supported"


def test_clock_reason_names_keep_bits_they_do_not_know():
    assert reason_names(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert reason_names(0x2000 | 0x8) == ["hw_slowdown", "0x2000"]
    assert reason_names(0) == []


def test_p10_p90_brackets_the_median():
    values = [1.0] * 9 + [5.0]
    low, high = engine_step._p10_p90(values)
    assert low == pytest.approx(1.0) and high == pytest.approx(1.4)
    assert engine_step._p10_p90([2.0]) == (2.0, 2.0)


def run_engine_step(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "benchmarks/engine_step.py", "--device", "cpu", "--batch", "2", "--prompt-len", "8", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_repeats_measure_each_batch_s_adapter_counts_in_turn_with_their_own_ratio():
    # --decode-fused-delta and --graph-segments reach the engine's config (no-ops off CUDA) and each row names them
    done = run_engine_step(
        "--num-decode", "6", "--adapters", "0", "1", "--lora-backend", "ref", "--repeats", "2", "--decode-fused-delta", "o", "down",
        "--graph-segments", "2", "4",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert all(row["decode_fused_delta"] == ["o", "down"] and row["graph_segments"] == [2, 4] for row in rows)
    assert [(r["repeat"], r["num_adapters"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for base, lora in (rows[0:2], rows[2:4]):
        assert lora["throughput_vs_base"] == pytest.approx(base["decode_step_ms"] / lora["decode_step_ms"])
    for row in rows:
        low, high = row["decode_step_ms_p10_p90"]
        assert low <= round(row["decode_step_ms"], 3) <= high
        assert "sm_mhz_min" not in row  # the CPU has no clocks to read


def test_repeats_below_one_are_refused():
    done = run_engine_step("--repeats", "0")
    assert done.returncode == 2 and "--repeats must be at least 1" in done.stderr


def test_step_read_bytes_leave_out_an_untied_embedding_and_add_the_kv_over_the_measured_contexts():
    """A decode step's unavoidable reads: every weight but an untied embedding table, plus K and V of
    every layer over each request's context at the measured steps (the 4th on)."""
    from types import SimpleNamespace

    config = SimpleNamespace(num_layers=2, num_kv_heads=3, head_dim=4)
    embed = torch.nn.Embedding(10, 6, dtype=torch.bfloat16)
    untied = SimpleNamespace(full_config=config, embed_tokens=embed, lm_head=torch.nn.Linear(6, 10))
    kv_per_token = 2 * 2 * 3 * 4 * 2  # K and V, 2 layers, 3 heads of 4, bf16
    # steps 3..6 of 7 attend over 8 + 1 + i tokens: 12, 13, 14, 15 -> 13.5 on average
    assert engine_step.step_read_bytes(untied, 1000, 5, 8, 7) == 1000 - 120 + 5 * 13.5 * kv_per_token
    tied = SimpleNamespace(full_config=config, embed_tokens=embed, lm_head=None)  # the LM head reads it whole
    assert engine_step.step_read_bytes(tied, 1000, 5, 8, 7) == 1000 + 5 * 13.5 * kv_per_token
    assert engine_step.step_read_bytes(tied, 1000, 1, 8, 2) == 1000 + 9.5 * kv_per_token  # too few steps: all of them


def test_rows_report_the_step_read_floor_with_each_adapter_read_once():
    done = run_engine_step("--num-decode", "6", "--adapters", "0", "1", "2", "--lora-backend", "ref")
    assert done.returncode == 0, done.stdout + done.stderr
    base, one, two = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    for row in (base, one, two):  # the copy rate measured once on this device (no --copy-gbps given)
        assert row["copy_gbps"] == base["copy_gbps"] > 0
        assert row["read_floor_ms"] == pytest.approx(row["step_read_gb"] / row["copy_gbps"] * 1e3, rel=1e-2)
    assert 0 < base["step_read_gb"] != base["param_gb"]
    # the tiny shape (hidden 64, MLP 176, 2 layers, 4 heads and 2 KV heads of 16) at rank 16, float32:
    # q/k/v 3 x 16 x 64 + 128 x 16, o 16 x 64 + 64 x 16, gate/up 2 x 16 x 64 + 352 x 16, down 16 x 176 + 64 x 16
    adapter = 2 * (3 * 16 * 64 + 128 * 16 + 16 * 64 + 64 * 16 + 2 * 16 * 64 + 352 * 16 + 16 * 176 + 64 * 16) * 4
    assert (one["step_read_gb"] - base["step_read_gb"]) * 1e9 == pytest.approx(adapter)
    assert (two["step_read_gb"] - base["step_read_gb"]) * 1e9 == pytest.approx(2 * adapter)
    # what the adapters' bytes alone allow against the base step, and the share of it each step reaches
    assert base["floor_vs_base"] == pytest.approx(1.0) and base["of_floor_vs_base"] == pytest.approx(base["throughput_vs_base"])
    for row in (one, two):
        assert row["floor_vs_base"] == pytest.approx(base["step_read_gb"] / row["step_read_gb"], rel=1e-6)
        assert row["of_floor_vs_base"] == pytest.approx(row["throughput_vs_base"] / row["floor_vs_base"])
    assert 1 > one["floor_vs_base"] > two["floor_vs_base"]
