"""The registry's spool: where uploads and compiled artifacts wait before they reach the object store.

Each registry process spools under its own directory `<data_dir>/spool/proc-*`, holding an exclusive
`flock` on the `.lock` file inside for as long as it runs. A process killed mid-upload leaves its
directory behind with the lock released by the kernel, so `reclaim` (at every start, and in `registry
gc`) can tell leftovers from live uploads without guessing by age: a directory whose lock it can take
belongs to no live process. The lock's creation time also bounds when any live upload started.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

LOCK_NAME = ".lock"
PREFIX = "proc-"
# A directory of another process may exist a moment before its lock does; and entries of the old
# layout (bare temp dirs under spool/) have no lock at all: both are left alone this young.
_UNLOCKED_GRACE_S = 60.0


@dataclass(frozen=True)
class Reclaimed:
    num_entries: int
    num_bytes: int
    oldest_live_start: float  # creation time of the oldest live process's spool (this one included)


class Spool:
    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.path = Path(tempfile.mkdtemp(dir=root, prefix=PREFIX))
        self._lock = (self.path / LOCK_NAME).open("w")
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.started_at = os.fstat(self._lock.fileno()).st_mtime

    def close(self) -> None:
        """Remove this process's spool (nothing may be in flight)."""
        if not self._lock.closed:
            shutil.rmtree(self.path, ignore_errors=True)
            self._lock.close()

    def entries(self) -> list[Path]:
        """What this process has spooled now (the lock aside): empty between registrations."""
        return sorted(p for p in self.path.iterdir() if p.name != LOCK_NAME)

    def reclaim(self) -> Reclaimed:
        """Remove the spools of dead processes; keep every live one's."""
        num_entries = num_bytes = 0
        oldest = self.started_at
        for entry in sorted(self.root.iterdir()):
            if entry == self.path:
                continue
            live_since = _live_since(entry)
            if live_since is not None:
                oldest = min(oldest, live_since)
                continue
            num_bytes += _size(entry)
            _remove(entry)
            num_entries += 1
        return Reclaimed(num_entries, num_bytes, oldest)


def _live_since(entry: Path) -> float | None:
    """When a live process created `entry`, or None when no live process owns it."""
    lock_path = entry / LOCK_NAME
    try:
        lock = lock_path.open("r")
    except (FileNotFoundError, NotADirectoryError):
        young = time.time() - entry.lstat().st_mtime < _UNLOCKED_GRACE_S
        return entry.lstat().st_mtime if young else None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.fstat(lock.fileno()).st_mtime
        return None  # we got the lock: its owner is gone (closing the file releases it)


def _size(entry: Path) -> int:
    if not entry.is_dir() or entry.is_symlink():
        return entry.lstat().st_size
    total = 0
    for dirpath, _, filenames in os.walk(entry):
        for name in filenames:
            with contextlib.suppress(FileNotFoundError):
                total += (Path(dirpath) / name).lstat().st_size
    return total


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)
