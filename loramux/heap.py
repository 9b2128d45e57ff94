"""glibc's heap settings for the processes that stream artifacts in 1 MiB chunks: the registry's server
and the engine's fetch process.

Each chunk is a fresh 1 MiB bytes object (a file read, its framing, a gRPC message). glibc serves an
allocation that big from a new mapping, or trims the heap's top once it is freed, so every chunk's
pages fault in again: 256 page faults a MiB, each zeroing its page before the copy writes it. On the
2-core VM, fetching 8 q/v Llama-3-8B artifacts 4 at a time went from about 6.2 to 4.2 CPU seconds a GB
between the two processes, and from 240 to 350 MB/s, once allocations below 4 MiB came from the heap
and up to 64 MiB of its freed top was kept for the next chunks (BENCHMARKS.md, 2026-12-03).
"""

from __future__ import annotations

import ctypes
import platform
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 4 << 20  # allocations below this come from the heap (a chunk and its framing)
TRIM_THRESHOLD_BYTES = 64 << 20  # freed memory at the heap's top kept before any is given back


def keep_freed_chunks() -> bool:
    """Serve chunk-sized allocations from the heap and keep freed ones for the next (glibc only;
    elsewhere nothing changes). True when applied. Call it once, early, in a streaming process."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
