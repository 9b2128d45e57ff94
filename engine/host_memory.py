"""How much memory this process may use, without torch: the pinned arena's default size
(engine/pinned_arena.py) and the fetch process's bound on a declared artifact size
(engine/fetch_process.py) both ask."""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1


def host_memory_bytes(limits: tuple[str, ...] = CGROUP_LIMITS) -> int:
    """The memory this process may use: the host's physical memory, or its container's (cgroup) limit
    where that is lower; 0 where the OS does not say."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        total = 0
    for path in limits:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) or a huge number (v1): no limit
            total = min(total, int(text)) if total else int(text)
    return total
