"""Events from the engine thread reach the handlers' asyncio queues in order, with one wake-up of the
server's loop per step (inside `batched()`) or per burst (outside), never one per event."""

from __future__ import annotations

import asyncio
import threading

from engine.delivery import EventDelivery, batched


class RecordingLoop:
    """Stands in for a server's event loop: records the callbacks handed to it and runs them on demand."""

    def __init__(self, closed: bool = False):
        self.callbacks = []
        self.closed = closed

    def call_soon_threadsafe(self, callback, *args):
        if self.closed:
            raise RuntimeError("Event loop is closed")
        self.callbacks.append((callback, args))

    def run_pending(self):
        callbacks, self.callbacks = self.callbacks, []
        for callback, args in callbacks:
            callback(*args)


def drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def test_outside_a_batch_one_wake_up_per_burst_and_order_kept():
    loop = RecordingLoop()
    delivery = EventDelivery(loop)
    a, b = asyncio.Queue(), asyncio.Queue()
    for i in range(50):
        delivery.put(a if i % 2 else b, i)
    assert len(loop.callbacks) == 1  # the first put woke the loop; the rest rode along
    loop.run_pending()
    assert drain(a) == list(range(1, 50, 2)) and drain(b) == list(range(0, 50, 2))
    delivery.put(a, "next")  # the flush ran: a new burst wakes the loop again
    assert len(loop.callbacks) == 1
    loop.run_pending()
    assert drain(a) == ["next"]


def test_inside_a_batch_the_wake_up_waits_for_the_block_end_once_per_loop():
    loops = RecordingLoop(), RecordingLoop()
    deliveries = [EventDelivery(loop) for loop in loops]
    queues = [asyncio.Queue() for _ in range(4)]
    with batched():
        for i in range(64):
            deliveries[i % 2].put(queues[i % 4], i)
        assert all(not loop.callbacks for loop in loops)  # nothing woken mid-step
    assert [len(loop.callbacks) for loop in loops] == [1, 1]
    for loop in loops:
        loop.run_pending()
    assert [drain(q) for q in queues] == [list(range(k, 64, 4)) for k in range(4)]
    with batched():
        pass  # a step without events wakes nobody
    assert all(not loop.callbacks for loop in loops)


def test_a_batch_on_one_thread_does_not_hold_another_threads_events():
    loop = RecordingLoop()
    delivery = EventDelivery(loop)
    queue = asyncio.Queue()
    with batched():
        other = threading.Thread(target=delivery.put, args=(queue, "from elsewhere"))
        other.start()
        other.join()
        assert len(loop.callbacks) == 1  # that thread is not in a batch: it woke the loop itself
    loop.run_pending()
    assert drain(queue) == ["from elsewhere"]


def test_a_closed_loop_drops_its_events_and_is_not_retried_forever():
    loop = RecordingLoop(closed=True)
    delivery = EventDelivery(loop)
    queue = asyncio.Queue()
    delivery.put(queue, 1)  # no error reaches the engine thread
    delivery.put(queue, 2)
    with batched():
        delivery.put(queue, 3)
    assert not delivery._pending and not delivery._scheduled


def test_of_gives_one_delivery_per_loop():
    first, second = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        assert EventDelivery.of(first) is EventDelivery.of(first)
        assert EventDelivery.of(first) is not EventDelivery.of(second)
    finally:
        first.close()
        second.close()


def test_a_real_loop_receives_every_event_in_order_from_the_engine_thread():
    """An asyncio loop in its own thread, consumers awaiting three queues, the 'engine' thread putting
    steps of events inside batched() blocks and single events outside them."""
    loop = asyncio.new_event_loop()
    server = threading.Thread(target=loop.run_forever, daemon=True)
    server.start()
    try:
        queues = asyncio.run_coroutine_threadsafe(_make_queues(3), loop).result(10)
        delivery = EventDelivery.of(loop)
        consumers = [asyncio.run_coroutine_threadsafe(_consume(q, 300), loop) for q in queues]

        def engine() -> None:
            for step in range(100):
                with batched():
                    for k, queue in enumerate(queues):
                        delivery.put(queue, (step, k))
            for step in range(100, 300):
                for k, queue in enumerate(queues):
                    delivery.put(queue, (step, k))

        worker = threading.Thread(target=engine)
        worker.start()
        worker.join(30)
        assert [c.result(30) for c in consumers] == [[(step, k) for step in range(300)] for k in range(3)]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        server.join(10)
        loop.close()


async def _make_queues(n: int) -> list[asyncio.Queue]:
    return [asyncio.Queue() for _ in range(n)]


async def _consume(queue: asyncio.Queue, count: int) -> list:
    return [await queue.get() for _ in range(count)]
