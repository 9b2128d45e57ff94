"""benchmarks/profile_step.py's prefill mode on the CPU (the tiny shape): prefill steps of whole prompts,
profiled."""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from benchmarks import profile_step

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU smoke run; the GPU profiles for real")


def test_prefill_steps_take_whole_prompts(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["profile_step.py", "--shape", "tiny", "--batch", "3", "--adapters", "2", "--prefill-len", "24", "--rows", "5"])
    profile_step.main()
    out = capsys.readouterr().out
    assert "(72 tokens a step)" in out  # 3 prompts of 24 tokens in one step
    assert "aten::mm" in out  # the profiler's table of the profiled steps


def test_a_prompt_left_running_stops_the_profile(monkeypatch):
    # max_new_tokens 1 finishes every request with its prefill step; one that needs more steps means the
    # step did not take the whole prompt, and the figures would not be a prefill step's
    real = profile_step.make_request
    monkeypatch.setattr(profile_step, "make_request", lambda i, n, vocab, max_new, ns="": real(i, n, vocab, 2, ns))
    monkeypatch.setattr(sys, "argv", ["profile_step.py", "--shape", "tiny", "--batch", "1", "--prefill-len", "8"])
    with pytest.raises(RuntimeError, match="still running"):
        profile_step.main()


def test_device_time_counts_each_kernel_once():
    # a host op (aten::mm, a graph launch) carries its kernels' time as its own self device time too
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(key, device_type, us):
        return SimpleNamespace(key=key, device_type=device_type, self_device_time_total=us)

    averages = [
        event("aten::mm", DeviceType.CPU, 30.0), event("nvjet_gemm", DeviceType.CUDA, 30.0),
        event("cudaGraphLaunch", DeviceType.CPU, 15.0), event("_sgmv_kernel", DeviceType.CUDA, 10.0),
        event("_split_sum_kernel", DeviceType.CUDA, 2.0), event("_silu_mul_expand_kernel", DeviceType.CUDA, 3.0),
    ]  # fmt: skip
    total, lora = profile_step.lora_kernel_times(averages)
    assert total == 45.0
    assert lora == {"_sgmv_kernel": 10.0, "_split_sum_kernel": 2.0, "_silu_mul_expand_kernel": 3.0}
