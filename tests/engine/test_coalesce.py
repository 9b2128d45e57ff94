"""CoalescedCalls: one call per key for callers that arrive together, and never an answer from a call
that started before the caller asked."""

from __future__ import annotations

import asyncio

import pytest

from engine.coalesce import CoalescedCalls


class _Source:
    """A call whose answers count up; each call waits until released."""

    def __init__(self):
        self.num_calls = 0
        self.release = asyncio.Event()

    async def __call__(self, key: str) -> tuple[str, int]:
        self.num_calls += 1
        number = self.num_calls
        await self.release.wait()
        if key == "bad":
            raise KeyError(key)
        return key, number


async def test_callers_that_arrive_together_share_one_call():
    source = _Source()
    calls = CoalescedCalls(source)
    waiting = [asyncio.create_task(calls.get("a")) for _ in range(10)]
    other = asyncio.create_task(calls.get("b"))
    await asyncio.sleep(0.01)
    source.release.set()
    assert {await w for w in waiting} == {("a", 1)}
    assert (await other)[0] == "b" and source.num_calls == 2


async def test_a_caller_arriving_during_a_call_gets_the_next_one():
    source = _Source()
    calls = CoalescedCalls(source)
    early = asyncio.create_task(calls.get("a"))
    await asyncio.sleep(0.01)  # call 1 is in flight
    late = [asyncio.create_task(calls.get("a")) for _ in range(5)]
    await asyncio.sleep(0.01)
    assert source.num_calls == 1  # the late callers wait: at most one call per key in flight
    source.release.set()
    assert await early == ("a", 1)
    assert {await t for t in late} == {("a", 2)}  # one call for all of them, started after they asked
    assert source.num_calls == 2


async def test_errors_reach_every_caller_and_a_cancelled_caller_leaves_the_call_alone():
    source = _Source()
    calls = CoalescedCalls(source)
    failing = [asyncio.create_task(calls.get("bad")) for _ in range(3)]
    leaving = asyncio.create_task(calls.get("a"))
    staying = asyncio.create_task(calls.get("a"))
    await asyncio.sleep(0.01)
    leaving.cancel()
    source.release.set()
    for task in failing:
        with pytest.raises(KeyError):
            await task
    assert (await staying)[0] == "a"
