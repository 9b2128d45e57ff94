"""Registrations in flight: the cap on concurrent uploads, the gate before each commit, and the wait
for worker threads at shutdown.

A registration's blocking work (compile, store, commit) runs in a worker thread that a cancelled
handler cannot stop. Its `CommitGate` is checked in that thread just before the commit: a client whose
deadline passed, or whose handler was cancelled (client gone, or the shutdown grace over), is never
told "failed" about a row that was committed anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator

from registry.errors import Code, RegistryError, ResourceExhausted

COMMIT_MARGIN_S = 0.2  # a commit takes less than this: the client must still be waiting after it


class CommitGate:
    def __init__(self, time_remaining: float | None):
        self.deadline = None if time_remaining is None else time.monotonic() + time_remaining - COMMIT_MARGIN_S
        self.is_cancelled = False

    def check(self) -> None:
        if self.is_cancelled:
            raise RegistryError("the registration was cancelled before its commit; nothing was stored", Code.UNAVAILABLE)
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise RegistryError(
                "the client's deadline passed before the commit; nothing was registered", Code.DEADLINE_EXCEEDED
            )


class Registrations:
    """Uploads in flight (at most `max_uploads`) and their worker-thread work."""

    def __init__(self, max_uploads: int):
        self.max_uploads = max_uploads
        self.num_uploads = 0
        self.workers: set[asyncio.Future] = set()

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        if self.num_uploads >= self.max_uploads:
            raise ResourceExhausted(
                f"{self.num_uploads} uploads are in flight, the registry's limit"
                " (--max-concurrent-uploads); retry later"
            )
        self.num_uploads += 1
        try:
            yield
        finally:
            self.num_uploads -= 1

    async def run(self, gate: CommitGate, func: Callable, *args):
        """func(*args) in a worker thread; when the caller is cancelled, close the gate and let it end."""
        work = asyncio.ensure_future(asyncio.to_thread(func, *args))
        self.workers.add(work)
        work.add_done_callback(self._forget)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            gate.is_cancelled = True
            raise

    async def wait_workers(self) -> None:
        """Wait for worker threads still running: each commits, or stops at its gate."""
        if self.workers:
            await asyncio.wait(list(self.workers))

    def _forget(self, work: asyncio.Future) -> None:
        self.workers.discard(work)
        if not work.cancelled():
            work.exception()  # retrieved: a registration whose client left fails quietly
