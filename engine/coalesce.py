"""Coalesced calls: concurrent callers for one key share one call, and every caller gets an answer from
a call that started after it asked (never a stale in-flight one).

Callers that arrive while a call for their key runs wait for the next call, which starts when the
running one ends: at most one call per key in flight, at most two per caller's wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class CoalescedCalls(Generic[K, V]):
    def __init__(self, call: Callable[[K], Awaitable[V]]):
        self.call = call
        self._running: dict[K, asyncio.Task[V]] = {}
        self._next: dict[K, asyncio.Task[V]] = {}  # not started yet: newcomers join it

    async def get(self, key: K) -> V:
        task = self._next.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._after_running(key))
            task.add_done_callback(_retrieve)  # no "never retrieved" warning when every caller left
            self._next[key] = task
        return await asyncio.shield(task)

    async def _after_running(self, key: K) -> V:
        running = self._running.get(key)
        if running is not None:
            await asyncio.wait([running])  # its outcome belongs to its own callers
        me = self._next.pop(key)
        self._running[key] = me
        try:
            return await self.call(key)
        finally:
            if self._running.get(key) is me:
                del self._running[key]


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()
