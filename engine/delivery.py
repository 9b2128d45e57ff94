"""Events from the engine thread to asyncio loops, one wake-up per step rather than one per event.

A decode step produces a token event for every running request, and the handlers that stream them wait
on asyncio queues of the server's loop. Each `call_soon_threadsafe` writes to that loop's wake-up socket:
a profile of a 64-request decode step on the front spent most of its host time in those writes. So
`EventDelivery.put` appends to a pending list, and the loop is woken once for the lot:

- inside `batched()` (the engine loop wraps each of its iterations in it), at the end of the block,
  once per loop that got events;
- anywhere else, at once, unless a wake-up for that loop is already queued and has not run yet.

Order is kept per queue (one FIFO list per loop). Events for a loop that has closed are dropped: nobody
listens any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

_state = threading.local()  # .held: the deliveries with events put inside this thread's batched() block
_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EventDelivery] = weakref.WeakKeyDictionary()
_by_loop_lock = threading.Lock()


class EventDelivery:
    """The pending events of one asyncio loop; `of(loop)` gives the loop's one instance."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[Any], Any]] = []
        self._scheduled = False  # a flush is queued on the loop and has not run yet

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> EventDelivery:
        with _by_loop_lock:
            delivery = _by_loop.get(loop)
            if delivery is None:
                delivery = _by_loop[loop] = cls(loop)
            return delivery

    def put(self, queue: asyncio.Queue[Any], event: Any) -> None:
        """Thread-safe: `queue.put_nowait(event)` on the loop, soon (see the module doc for when)."""
        with self._lock:
            self._pending.append((queue, event))
        held = getattr(_state, "held", None)
        if held is not None:
            held.add(self)
        else:
            self.wake()

    def wake(self) -> None:
        """Queue a flush on the loop unless one is queued already."""
        with self._lock:
            if self._scheduled or not self._pending:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop has closed
            with self._lock:
                self._pending.clear()
                self._scheduled = False

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, [], False
        for queue, event in pending:
            queue.put_nowait(event)


@contextlib.contextmanager
def batched() -> Iterator[None]:
    """Hold the wake-ups of events put by this thread until the block ends (not re-entrant)."""
    _state.held = held = set()
    try:
        yield
    finally:
        _state.held = None
        for delivery in held:
            delivery.wake()
