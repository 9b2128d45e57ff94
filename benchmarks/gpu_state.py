"""What the GPU was doing while a benchmark measured: its SM and memory clocks, power draw, temperature and
the reasons NVML gives for holding the clocks back, read a few times during a measurement.

Two processes of the same setting on one H100 read a batch-64 decode step at 6.9 and at 8.2-8.35 ms
(BENCHMARKS.md, 2026-12-05); batch 32 never did. These fields tell a clock held back by power or heat
from the same clocks and a slower path. NVML comes from nvidia-ml-py (`pynvml`); without it, or off
CUDA, a measurement simply has none of these fields.
"""

from __future__ import annotations

from typing import Any

import torch

# NVML's clocks-event (throttle) reason bits, nvml.h's nvmlClocksEventReason* / nvmlClocksThrottleReason*
CLOCK_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def reason_names(mask: int) -> list[str]:
    names = [name for bit, name in CLOCK_REASONS.items() if mask & bit]
    unknown = mask & ~sum(CLOCK_REASONS)
    return [*names, f"0x{unknown:x}"] if unknown else names


def _nvml_index(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:  # CUDA_VISIBLE_DEVICES may renumber the devices NVML sees in full
        return torch.cuda._get_nvml_device_index(index)
    except Exception:
        return index


class GpuState:
    """Samples of one CUDA device's clocks and limits; `summary()` gives a measurement's fields."""

    def __init__(self, device: torch.device, nvml: Any = None):
        self.samples: list[dict] = []
        self.error = ""  # why readings stopped, if NVML refused one
        self._nvml, self._handle = None, None
        if device.type != "cuda":
            return
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError:
                return
        try:
            nvml.nvmlInit()
            self._handle = nvml.nvmlDeviceGetHandleByIndex(_nvml_index(device))
            self._nvml = nvml
        except Exception:  # no driver library, no permission: measure without
            self._handle = None

    @property
    def available(self) -> bool:
        return self._handle is not None

    def reset(self) -> None:
        self.samples = []

    def sample(self) -> None:
        if self._handle is None:
            return
        nvml, h = self._nvml, self._handle
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        try:
            reading = {
                "sm_mhz": nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),
                "mem_mhz": nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM),
                "power_w": nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                "temp_c": nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
                "reasons": reasons(h),
            }
        except Exception as exc:  # a reading NVML refuses (a virtualised GPU, say) ends the readings, not the benchmark
            self._handle, self.error = None, f"{type(exc).__name__}: {exc}"
            return
        self.samples.append(reading)

    def summary(self) -> dict:
        """The samples since the last reset: the lowest clocks, the highest power and temperature, and every
        reason but idle that held the clocks back in any sample ({} without samples); why readings
        stopped, if NVML refused one."""
        fields = {}
        if self.samples:
            mask = 0
            for s in self.samples:
                mask |= s["reasons"]
            fields = {
                "gpu_samples": len(self.samples),
                "sm_mhz_min": min(s["sm_mhz"] for s in self.samples),
                "sm_mhz_max": max(s["sm_mhz"] for s in self.samples),
                "mem_mhz_min": min(s["mem_mhz"] for s in self.samples),
                "power_w_max": round(max(s["power_w"] for s in self.samples), 1),
                "temp_c_max": max(s["temp_c"] for s in self.samples),
                "clock_limits": [name for name in reason_names(mask) if name != "gpu_idle"],
            }
        if self.error:
            fields["gpu_state_error"] = self.error
        return fields
