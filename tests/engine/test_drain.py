"""The starvation drain: the policy over real slot assignment with a fake clock, and an engine whose one
LoRA slot a steady flow of one adapter's requests would otherwise hold forever."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from engine.adapter_slots import AdapterSlots
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.drain import StarvationDrain
from engine.request import Finished, TokenDelta
from engine.sampling import SamplingParams

WAIT_S = 2.0


def load_nothing():
    """A packed adapter's stand-in: the slots read only its rank; the fake pool copies nothing."""
    return SimpleNamespace(rank=4)


class FakeLora:
    """LoraManager's surface over real AdapterSlots; loads nothing."""

    def __init__(self, num_slots: int):
        self.slots = AdapterSlots(num_slots)

    def can_acquire(self, digest: str) -> bool:
        return self.slots.can_acquire(digest)

    def acquire(self, digest: str) -> int:
        return self.slots.acquire(digest, load_nothing)

    def release(self, digest: str) -> None:
        self.slots.release(digest)

    def pin(self, digest: str) -> int:
        return self.slots.pin(digest, load_nothing)


@dataclass(eq=False)
class FakeReq:
    namespace: str
    arrival: float
    max_new_tokens: int = 10
    output_ids: list[int] = field(default_factory=list)

    @property
    def params(self):
        return SimpleNamespace(max_new_tokens=self.max_new_tokens)


class World:
    """Waiting and running fake requests, slots acquired as a scheduler would, and a fake clock."""

    def __init__(self, num_slots: int):
        self.now = 0.0
        self.lora = FakeLora(num_slots)
        self.waiting: list[FakeReq] = []
        self.running: list[FakeReq] = []
        self.drain = StarvationDrain(WAIT_S, clock=lambda: self.now)

    def run(self, namespace: str, remaining: int) -> FakeReq:
        req = FakeReq(namespace, self.now, max_new_tokens=remaining + 3, output_ids=[0, 0, 0])
        self.lora.acquire(namespace)
        self.running.append(req)
        return req

    def wait(self, namespace: str) -> FakeReq:
        req = FakeReq(namespace, self.now)
        self.waiting.append(req)
        return req

    def finish(self, req: FakeReq) -> None:
        self.running.remove(req)
        self.lora.release(req.namespace)

    def admit(self, req: FakeReq) -> None:
        self.waiting.remove(req)
        self.lora.acquire(req.namespace)
        self.running.append(req)

    def update(self, after_s: float = 0.0) -> None:
        self.now += after_s
        self.drain.update(self.waiting, self.running, self.lora)


def test_no_drain_before_the_threshold():
    w = World(num_slots=1)
    w.run("a", remaining=5)
    w.wait("b")
    w.update(after_s=WAIT_S - 0.1)
    assert w.drain.draining is None and w.drain.num_drains == 0


def test_no_drain_while_a_slot_is_free_or_evictable():
    w = World(num_slots=2)
    w.run("a", remaining=5)
    w.wait("b")
    w.update(after_s=WAIT_S + 1)  # the second slot is empty
    assert w.drain.draining is None
    w.finish(w.run("c", remaining=1))  # c stays resident, unused: evictable
    w.update(after_s=1)
    assert w.drain.draining is None and w.drain.num_drains == 0


def test_drains_the_running_adapter_with_the_fewest_remaining_tokens():
    w = World(num_slots=2)
    w.run("a", remaining=4)
    w.run("a", remaining=4)  # a: 8 tokens left in all
    w.run("c", remaining=6)
    w.update()
    b = w.wait("b")
    w.update(after_s=WAIT_S + 0.1)
    assert w.drain.draining == "c" and w.drain.starving == "b" and w.drain.num_drains == 1
    assert w.drain.blocks(FakeReq("c", w.now)) and not w.drain.blocks(FakeReq("a", w.now))
    assert not w.drain.blocks(b) and not w.drain.blocks(FakeReq("", w.now))


def test_pinned_adapters_are_never_drained():
    w = World(num_slots=3)
    for digest in ("p", "q"):
        w.lora.pin(digest)
        w.run(digest, remaining=1)
    w.run("a", remaining=50)
    w.wait("b")
    w.update(after_s=WAIT_S + 1)
    assert w.drain.draining == "a"


def test_no_drain_when_only_pinned_adapters_run():
    w = World(num_slots=2)
    w.lora.pin("p")
    w.run("p", remaining=1)
    w.lora.acquire("x")  # held by a request outside `running` (e.g. retracted): no candidate to drain
    w.wait("b")
    w.update(after_s=WAIT_S + 1)
    assert w.drain.draining is None and w.drain.num_drains == 0


def test_drain_holds_until_the_starving_adapter_gets_the_slot():
    w = World(num_slots=1)
    a1 = w.run("a", remaining=2)
    b = w.wait("b")
    w.update(after_s=WAIT_S + 1)
    assert w.drain.draining == "a"
    a2 = w.wait("a")  # a new request of the drained adapter waits
    w.update(after_s=1)
    assert w.drain.blocks(a2) and w.drain.num_drains == 1  # still the same drain
    w.finish(a1)
    w.update()
    assert w.drain.draining == "a"  # slot free, but b has not taken it yet
    w.admit(b)
    w.update()
    assert w.drain.draining is None and not w.drain.blocks(a2) and w.drain.num_drains == 1


def test_drain_lifts_when_nobody_starves_any_more():
    w = World(num_slots=1)
    w.run("a", remaining=2)
    b = w.wait("b")
    w.update(after_s=WAIT_S + 1)
    assert w.drain.draining == "a"
    w.waiting.remove(b)  # cancelled
    w.update()
    assert w.drain.draining is None


def test_one_drain_at_a_time_for_the_oldest_starving_adapter():
    w = World(num_slots=2)
    w.run("a", remaining=3)
    w.run("c", remaining=9)
    w.wait("b")
    w.update(after_s=1)
    w.wait("d")
    w.update(after_s=WAIT_S + 1)
    assert (w.drain.draining, w.drain.starving, w.drain.num_drains) == ("a", "b", 1)


def test_wait_must_be_positive():
    with pytest.raises(ValueError, match=r"^drain wait must be > 0 seconds, not 0.0$"):
        StarvationDrain(0.0)
    assert StarvationDrain(0.3).wait_s == 0.3  # sub-second waits are fine


def test_waiting_exactly_the_threshold_is_not_starving():
    w = World(num_slots=1)
    w.run("a", remaining=5)
    w.wait("b")
    w.update(after_s=WAIT_S)
    assert w.drain.draining is None
    w.update(after_s=0.001)
    assert w.drain.draining == "a"


def test_finished_requests_count_no_remaining_tokens():
    """A running request with nothing left to generate counts 0, not 1: a (two such requests) frees its
    slot before c (one token left)."""
    w = World(num_slots=2)
    w.run("a", remaining=0)
    w.run("a", remaining=0)
    w.run("c", remaining=1)
    w.wait("b")
    w.update(after_s=WAIT_S + 1)
    assert w.drain.draining == "a"


def test_drain_lifts_when_the_starving_request_left_while_others_wait():
    w = World(num_slots=1)
    w.run("a", remaining=2)
    b = w.wait("b")
    w.update(after_s=WAIT_S + 1)
    w.wait("a")  # held back by the drain
    w.waiting.remove(b)  # cancelled
    w.update()
    assert w.drain.draining is None and w.drain.num_drains == 1


def test_a_fresh_drain_blocks_nothing():
    drain = StarvationDrain(WAIT_S)
    assert (drain.draining, drain.starving, drain.num_drains) == (None, None, 0)
    assert not drain.blocks(FakeReq("", 0.0)) and not drain.blocks(FakeReq("a", 0.0))


def test_remaining_tokens_count_what_was_already_generated():
    """Guards: remaining = max_new_tokens - tokens already generated. a asked for more tokens than c but
    has generated most of them (2 left against c's 5): a frees its slot sooner. Counting max_new_tokens
    alone would drain c."""
    w = World(num_slots=2)
    for namespace, max_new, generated in (("a", 10, 8), ("c", 5, 0)):
        w.lora.acquire(namespace)
        w.running.append(FakeReq(namespace, w.now, max_new_tokens=max_new, output_ids=[0] * generated))
    w.wait("b")
    w.update(after_s=WAIT_S + 1)
    assert (w.drain.draining, w.drain.starving) == ("a", "b")


def test_drain_ends_when_the_drained_adapter_lost_its_slot():
    """Guards: the end condition "the drained adapter lost its slot". a is drained for b, then a's freed
    slot goes to c before b takes it: draining a frees nothing any more, so the drain must move on to c
    (a new drain), not keep holding a's requests back."""
    w = World(num_slots=1)
    a1 = w.run("a", remaining=2)
    w.wait("b")
    w.update(after_s=WAIT_S + 1)
    assert (w.drain.draining, w.drain.num_drains) == ("a", 1)
    w.finish(a1)
    c = w.wait("c")
    w.admit(c)  # c takes the slot, evicting a
    assert w.lora.slots.slot_of("a") is None
    w.update()
    assert (w.drain.draining, w.drain.starving, w.drain.num_drains) == ("c", "b", 2)
    assert not w.drain.blocks(FakeReq("a", w.now))


# ---- the engine ------------------------------------------------------------------------------------

FLOW_TOKENS = 16  # tokens per flow request; each submits its successor at its first token
B_TOKENS = 8
ENGINE_WAIT_S = 0.3
FLOWS_PAST_B = 20  # A requests that must come and go while B, without the drain, stays unfinished
HANG_S = 120.0  # turns a hang into a failure; no assertion here is about speed


class Flow:
    """A steady flow of adapter-A requests: each request's first token makes a feeder thread submit the
    next one, so A always has running requests (its slot never frees) until `stop`."""

    def __init__(self, core: EngineCore, adapter: str):
        self.core = core
        self.record = core.resolve_adapter(adapter)
        self.packed = asyncio.run(core.prepare(self.record))
        self.prompt = core.prompt_ids("The quick brown fox", None)
        self.submitted_at: list[float] = []
        self.num_finished = 0
        self.num_active = 0
        self.is_flowing = True
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._asks: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._feeder = threading.Thread(target=self._feed, daemon=True)

    def start(self) -> None:
        self._feeder.start()
        self._asks.put(True)

    def stop(self, timeout: float = HANG_S) -> None:
        """Stop submitting and wait for the flow's requests to finish."""
        self.is_flowing = False
        self._asks.put(False)
        self._feeder.join(timeout)
        with self._lock:
            if not self.num_active:
                self._idle.set()
        assert self._idle.wait(timeout)

    def _feed(self) -> None:
        while self._asks.get() and self.is_flowing:
            with self._lock:
                self.num_active += 1
            params = SamplingParams(max_new_tokens=FLOW_TOKENS, ignore_eos=True)
            self.core.loop.submit(self.core.new_request(self.prompt, params, self._sink(), adapter=self.record, packed=self.packed))
            self.submitted_at.append(time.monotonic())

    def _sink(self):
        num_tokens = 0

        def sink(event):
            nonlocal num_tokens
            if isinstance(event, TokenDelta):
                num_tokens += 1
                if num_tokens == 1:
                    self._asks.put(True)
                return
            with self._lock:
                self.num_finished += 1
                self.num_active -= 1
                if not self.is_flowing and not self.num_active:
                    self._idle.set()

        return sink


def submit_b(core: EngineCore) -> dict:
    """Submit one adapter-B request; the dict gets its final event and the time it ended."""
    out: dict = {"done": threading.Event(), "start": time.monotonic()}

    def sink(event):
        if not isinstance(event, TokenDelta):
            out["final"], out["end"] = event, time.monotonic()
            out["done"].set()

    params = SamplingParams(max_new_tokens=B_TOKENS, ignore_eos=True)
    record = core.resolve_adapter("b")
    packed = asyncio.run(core.prepare(record))
    core.loop.submit(core.new_request(core.prompt_ids("Hello world", None), params, sink, adapter=record, packed=packed))
    return out


@pytest.fixture
def engine(tiny_llama_dir, make_adapter, tmp_path):
    cores: list[EngineCore] = []

    def build(drain_wait_s: float | None, num_slots: int = 1) -> EngineCore:
        """drain_wait_s None = the default configuration's threshold."""
        dirs = {name: make_adapter(f"drain-{name}", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=seed)
                for name, seed in (("a", 61), ("b", 62))}
        config = EngineConfig(
            model_dir=str(tiny_llama_dir),
            adapters=tuple((name, str(path)) for name, path in dirs.items()),
            work_dir=str(tmp_path / f"work-{len(cores)}"),
            max_loras_per_batch=num_slots,
            **({} if drain_wait_s is None else {"lora_drain_wait_s": drain_wait_s}),
        )
        core = EngineCore.build(config)
        cores.append(core)
        core.loop.start()
        return core

    yield build
    for core in cores:
        core.loop.stop()


def start_flow(core: EngineCore) -> Flow:
    flow = Flow(core, "a")
    flow.start()
    until(lambda: flow.num_finished >= 3, "the A flow runs")  # steady: several A requests came and went
    return flow


def until(predicate, what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def test_drain_lets_a_starving_adapter_through_a_steady_flow(engine):
    core = engine(ENGINE_WAIT_S)
    flow = start_flow(core)
    b = submit_b(core)
    # The threshold plus A's running requests (<= FLOW_TOKENS steps) plus B's own steps; what matters is
    # that B ends while the flow never stopped (checked below), not how fast.
    assert b["done"].wait(HANG_S), "B starved despite the drain"
    assert isinstance(b["final"], Finished) and b["final"].completion_tokens == B_TOKENS
    assert b["end"] - b["start"] >= ENGINE_WAIT_S  # it did wait for the threshold: A held the only slot
    num_finished_at_b = flow.num_finished
    until(lambda: flow.num_finished >= num_finished_at_b + 3, "the A flow resumed after the drain")
    assert any(t > b["start"] for t in flow.submitted_at)
    assert max(flow.submitted_at) > b["end"]
    assert core.loop.scheduler.drain.num_drains >= 1
    flow.stop()


def test_without_drain_a_steady_flow_starves_the_other_adapter(engine):
    core = engine(0.0)
    assert core.loop.scheduler.drain is None
    flow = start_flow(core)
    b = submit_b(core)
    num_finished_at_b = flow.num_finished
    # Counted in A requests, not seconds: however fast the machine, B must not run while they flow.
    until(lambda: flow.num_finished >= num_finished_at_b + FLOWS_PAST_B or b["done"].is_set(), "the A flow runs on")
    assert not b["done"].is_set(), "B ran while A's flow held the slot: the starvation scenario is broken"
    stopped_at = time.monotonic()
    flow.stop()
    assert b["done"].wait(HANG_S) and isinstance(b["final"], Finished)
    assert b["end"] > stopped_at


def test_the_default_configuration_drains_a_starving_adapter(engine):
    """On by default: under the default threshold a steady flow of A no longer starves B."""
    core = engine(None)
    assert core.loop.scheduler.drain is not None
    flow = start_flow(core)
    b = submit_b(core)
    assert b["done"].wait(HANG_S), "B starved under the default configuration"
    assert isinstance(b["final"], Finished) and core.loop.scheduler.drain.num_drains >= 1
    flow.stop()


def test_the_default_threshold_never_drains_when_slots_suffice(engine):
    """The same traffic with a slot for each adapter: the default threshold drains nothing."""
    core = engine(None, num_slots=2)
    flow = start_flow(core)
    b = submit_b(core)
    assert b["done"].wait(HANG_S) and isinstance(b["final"], Finished)
    num_finished_at_b = flow.num_finished
    until(lambda: flow.num_finished >= num_finished_at_b + 3, "the A flow runs on")
    assert core.loop.scheduler.drain.num_drains == 0
    flow.stop()
