"""Programmatic dependent launch (PDL) for the small decode kernels that follow a GEMM or each other.

A decode step is a chain of short kernels: each of RMSNorm, RoPE with the KV write, attention, SiLU-mul
waits for the launch of its grid after the kernel before it ends. Launched with PDL (Hopper and later),
a kernel's programs are scheduled while the previous kernel's last programs drain, and each waits at
`wait_for_producer` (griddepcontrol.wait: the previous grid complete, its writes visible) before it
reads anything; so the gap between the two shrinks to the wait. Every kernel here waits first thing, so
what it reads and writes is ordered as without PDL.

Off unless `set_enabled(True)` (EngineConfig.kernel_pdl, set by each model worker when it builds); on a
device older than compute capability 9 or a Triton without grid dependency control, `launch` gives the
plain launch.
"""

from __future__ import annotations

import torch
import triton

try:
    from triton.language.extra.cuda import gdc_wait

    HAS_GDC = True
except ImportError:  # a Triton before grid dependency control
    HAS_GDC = False

_enabled = False


if HAS_GDC:

    @triton.jit
    def wait_for_producer():
        gdc_wait()

else:

    @triton.jit
    def wait_for_producer():
        pass


def set_enabled(on: bool) -> None:
    """Launch the decode kernels with PDL in this process (where the device supports it)."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


def launch(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch that takes `USE_PDL`: PDL on where enabled and supported,
    else none (the kernel's default, a plain launch)."""
    if not _enabled or not HAS_GDC or device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return {}
    return {"USE_PDL": True, "launch_pdl": True}
