"""One reader of the event log per registry process, fanned out to every WatchAdapters stream.

The event table stays the source of truth; this is only how its new rows reach watchers quickly and
cheaply:
- one task reads new rows when woken and holds the most recent ones in memory, so N idle watchers cost
  one database read per wake-up, not N;
- it is woken by this process's own commits (`wake`), by PostgreSQL `NOTIFY` when another replica on
  the same database commits (a LISTEN connection on its own thread), and by a slow poll that covers a
  lost notification;
- a watcher whose cursor is older than the buffer catches up from the table itself.

Invariant: `buffer` holds every event with id in (`base_id`, `last_id`], in id order. Ids commit in id
order (see `catalog._log_event`), so a reader that has seen id n never later finds a smaller one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable

from registry.catalog import NOTIFY_CHANNEL, Catalog
from registry.types import AdapterEventInfo

log = logging.getLogger(__name__)

BUFFER_EVENTS = 4096
READ_BATCH = 500
LISTEN_TIMEOUT_S = 0.5  # how often the LISTEN thread looks up from the socket to notice a stop


class EventFeed:
    def __init__(self, catalog: Catalog, poll_s: float = 1.0):
        self.catalog = catalog
        self.poll_s = poll_s
        self.buffer: collections.deque[AdapterEventInfo] = collections.deque()
        self.base_id = 0
        self.last_id = 0
        self.num_reads = 0  # database reads of the event table by the feed (one per wake-up)
        self.num_watchers = 0
        self._woken = asyncio.Event()
        self._changed = asyncio.Event()
        self._reader: asyncio.Task | None = None
        self._listener: _PostgresListener | None = None

    async def start(self) -> None:
        self.base_id = self.last_id = await asyncio.to_thread(self.catalog.last_event_id)
        self._reader = asyncio.create_task(self._read_forever())
        if self.catalog.engine.dialect.name == "postgresql":
            self._listener = _PostgresListener(self.catalog, self._wake_threadsafe(asyncio.get_running_loop()))
            self._listener.start()

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._listener is not None:
            await asyncio.to_thread(self._listener.stop)

    def wake(self) -> None:
        """A change may have committed: read the table now (call on the server's event loop)."""
        self._woken.set()

    async def watch(self, after: int) -> AsyncIterator[list[AdapterEventInfo]]:
        """Batches of events with id > after, forever; from memory when the buffer covers the cursor."""
        self.num_watchers += 1
        if self.num_watchers == 1:
            self.wake()  # the feed polls only while someone watches: start the clock
        try:
            while True:
                changed = self._changed
                if after < self.base_id:
                    events = await asyncio.to_thread(self.catalog.events_after, after, "", READ_BATCH)
                else:
                    events = [e for e in self.buffer if e.event_id > after]
                if events:
                    after = events[-1].event_id
                    yield events
                else:
                    await changed.wait()
        finally:
            self.num_watchers -= 1

    async def _read_forever(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), self.poll_s if self.num_watchers else None)
            self._woken.clear()
            try:
                await self._read_new()
            except Exception:  # the database may be down for a while; the next wake-up retries
                log.warning("reading the event log failed", exc_info=True)

    async def _read_new(self) -> None:
        while True:
            self.num_reads += 1
            events = await asyncio.to_thread(self.catalog.events_after, self.last_id, "", READ_BATCH)
            if not events:
                return
            self.buffer.extend(events)
            while len(self.buffer) > BUFFER_EVENTS:
                self.base_id = self.buffer.popleft().event_id
            self.last_id = events[-1].event_id
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()
            if len(events) < READ_BATCH:
                return

    def _wake_threadsafe(self, loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop has closed
                loop.call_soon_threadsafe(self.wake)

        return wake


class _PostgresListener:
    """LISTEN on its own connection and thread; every notification (or reconnect) wakes the feed."""

    def __init__(self, catalog: Catalog, wake: Callable[[], None]):
        self.url = catalog.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        self.wake = wake
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="event-listen", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psycopg

        while not self._stop.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    self.wake()  # anything committed while we were not listening
                    while not self._stop.is_set():
                        for _ in conn.notifies(timeout=LISTEN_TIMEOUT_S):
                            self.wake()
            except psycopg.Error:
                log.warning("LISTEN %s failed; retrying", NOTIFY_CHANNEL, exc_info=True)
                self._stop.wait(1.0)
