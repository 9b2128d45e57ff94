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

The decode LoRA chain on the side stream (lorakernels/sgmv_decode.py: the split shrink, its reduce, the
expand) has a switch of its own, `set_lora_enabled` (EngineConfig.lora_pdl), and goes further: its
kernels release their dependents first thing (griddepcontrol.launch_dependents), so the reduce's and the
expand's programs are scheduled while the shrink still runs, and before they wait they read what no
kernel of the step writes: the step's SGMV metadata (copied from the host) and the adapters' weights
(written only by slot loads, which the step waits for). The split shrink itself is launched plainly (it
follows the join with the main stream); only what comes after it overlaps.
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
_lora_enabled = False


if HAS_GDC:

    from triton.language.extra.cuda import gdc_launch_dependents

    @triton.jit
    def wait_for_producer():
        gdc_wait()

    @triton.jit
    def release_dependents():
        gdc_launch_dependents()

else:

    @triton.jit
    def wait_for_producer():
        pass

    @triton.jit
    def release_dependents():
        pass


def set_enabled(on: bool) -> None:
    """Launch the decode kernels with PDL in this process (where the device supports it)."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


def set_lora_enabled(on: bool) -> None:
    """Launch the decode LoRA chain with PDL and early release in this process (where supported)."""
    global _lora_enabled
    _lora_enabled = bool(on)


def lora_enabled() -> bool:
    return _lora_enabled


def _supported(device: torch.device) -> bool:
    return HAS_GDC and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def launch(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch that takes `USE_PDL`: PDL on where enabled and supported,
    else none (the kernel's default, a plain launch)."""
    if not _enabled or not _supported(device):
        return {}
    return {"USE_PDL": True, "launch_pdl": True}


def lora_launch(device: torch.device, *, first: bool) -> dict:
    """Keyword arguments for a decode LoRA kernel that takes `RELEASE` and `USE_PDL`, where the LoRA
    switch is on and the device supports it: the chain's first kernel releases its dependents early and
    is launched plainly; the others are launched with PDL, read their weights and metadata, then wait.
    Else none (plain launches)."""
    if not _lora_enabled or not _supported(device):
        return {}
    return {"RELEASE": True} if first else {"RELEASE": True, "USE_PDL": True, "launch_pdl": True}
