"""The scheduler and RequestKV over the real page allocator, request table and radix cache, with no model.

A fake step stands in for the model: every token a step computes writes `(namespace, token ids up to and
including it)` into a fake KV map at its slot, and every step first checks that the slots a request reads
(its prefix, cached or computed earlier) hold exactly its own history. The fake sampler's token is a
function of the whole history, so a lost or duplicated token changes every later one.
"""

import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import pytest

from engine.adapter_cache import HostAdapterCache
from engine.adapter_slots import AdapterSlots
from engine.drain import StarvationDrain
from engine.errors import Code
from engine.kv_pool import DUMMY_PAGE, PageAllocator, ReqToTokenPool, num_pages_for
from engine.lora_manager import LoraManager
from engine.radix_cache import RadixCache
from engine.request import Failed, Finished, FinishReason, Request
from engine.request_kv import RequestKV
from engine.sampling import SamplingParams
from engine.scheduler import BatchEntry, Scheduler, SchedulerConfig
from engine.text import IncrementalDetokenizer, StopMatcher, Tokenizer

PAGE_SIZES = (1, 4)
MAX_CONTEXT = 256


def fake_token(ids: list[int]) -> int:
    """The fake model's next token: depends on every id and its position."""
    return 3 + sum((i + 1) * t for i, t in enumerate(ids)) % 500


def expected_output(prompt: list[int], num_tokens: int) -> list[int]:
    out: list[int] = []
    for _ in range(num_tokens):
        out.append(fake_token(prompt + out))
    return out


def prompt_of(length: int, seed: int) -> list[int]:
    return [3 + (seed * 97 + i * 31) % 500 for i in range(length)]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


class Step(NamedTuple):
    """What the scheduler handed out for one request in one step."""

    req: Request
    start: int
    extend_len: int
    samples: bool


class Sim:
    """A Scheduler over real KV owners, stepped by a fake model that checks KV reads and writes."""

    def __init__(self, tokenizer: Tokenizer, *, page_size: int, num_pages: int, max_running: int = 8,
                 max_batch_tokens: int = 64, clock=None, lora=None, drain=None, load_ahead: int = 0):
        self.tokenizer = tokenizer
        self.allocator = PageAllocator(num_pages, page_size)
        self.req_pool = ReqToTokenPool(max_running, MAX_CONTEXT)
        self.radix = RadixCache(page_size, self.allocator)
        kv = RequestKV(self.allocator, self.req_pool, self.radix)
        config = SchedulerConfig(max_running, max_batch_tokens, max_lora_load_ahead=load_ahead)
        self.sched = Scheduler(config, kv, clock=clock or time.monotonic, lora=lora, drain=drain)
        self.kv_content: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.events: dict[str, list] = {}
        self.num_samples: dict[str, int] = {}
        self.admission_order: list[str] = []
        self.requests: dict[str, Request] = {}
        self.steps: list[list[Step]] = []

    def add(self, rid: str, prompt: list[int], max_new_tokens: int = 4, namespace: str = "",
            deadline: float | None = None) -> Request:
        events = self.events.setdefault(rid, [])
        req = Request(
            rid=rid, prompt_ids=list(prompt),
            params=SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
            namespace=namespace, sink=events.append,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt), stop_matcher=StopMatcher(()),
            eos_token_ids=frozenset(), deadline=deadline,
        )
        self.num_samples[rid] = 0
        self.requests[rid] = req
        self.sched.add(req)
        return req

    def step(self) -> list[Step]:
        sched = self.sched
        entries = sched.schedule()
        self._check_step(entries)
        snapshot = [Step(e.req, e.start, e.extend_len, e.samples) for e in entries]
        written: dict[int, Request] = {}
        for e in entries:
            req, ids = e.req, e.req.all_ids
            assert self.req_pool.read(req.req_row, 0, req.kv_len) == req.kv_slots
            for i in range(e.start):  # the prefix this step attends to holds this request's own history
                assert self.kv_content.get(req.kv_slots[i]) == (req.namespace, tuple(ids[: i + 1])), (req.rid, i)
            for i in range(e.start, e.start + e.extend_len):
                slot = req.kv_slots[i]
                assert slot // self.allocator.page_size != DUMMY_PAGE and slot not in written
                written[slot] = req
                self.kv_content[slot] = (req.namespace, tuple(ids[: i + 1]))
            if req.rid not in self.admission_order:
                self.admission_order.append(req.rid)
        for req in sched.running:  # nobody writes into KV another running request holds
            assert all(written.get(slot, req) is req for slot in req.kv_slots)
        for e in snapshot:
            if e.samples:
                req = e.req
                req.output_ids.append(fake_token(req.all_ids))
                self.num_samples[req.rid] += 1
                if len(req.output_ids) >= req.params.max_new_tokens:
                    sched.finish(req, sched.finished_event(req, FinishReason.LENGTH))
        self.radix.check_invariants()
        self.steps.append(snapshot)
        return snapshot

    def _check_step(self, entries: list[BatchEntry]) -> None:
        sched = self.sched
        assert sum(e.extend_len for e in entries) <= sched.config.max_batch_tokens
        assert len(sched.running) <= sched.config.max_running_requests
        assert len({id(e.req) for e in entries}) == len(entries)
        for e in entries:
            assert e.extend_len > 0 and e.start + e.extend_len == e.req.kv_len
            assert e.req in sched.running

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.sched.num_requests:
                return
            self.step()
        raise AssertionError(f"requests still pending after {max_steps} steps")

    def final(self, rid: str):
        """The request's only terminal event (Finished or Failed), which must be its last event."""
        events = self.events[rid]
        assert len(events) == 1, events
        return events[0]

    def assert_all_freed(self) -> None:
        assert not self.sched.running and not self.sched.waiting
        assert not self.sched._num_by_tenant and not self.sched._counted  # no bookkeeping of ended requests
        assert self.radix.protected_size() == 0
        self.radix.reset()
        assert self.allocator.num_free_pages == self.allocator.num_usable_pages
        assert self.req_pool.num_free_rows == self.req_pool.max_reqs


def assert_finished(sim: Sim, req: Request, num_tokens: int, cached: int | None = None) -> Finished:
    event = sim.final(req.rid)
    assert isinstance(event, Finished) and event.reason is FinishReason.LENGTH and req.is_finished
    assert req.output_ids == expected_output(req.prompt_ids, num_tokens)
    assert sim.num_samples[req.rid] == num_tokens
    assert (event.prompt_tokens, event.completion_tokens) == (len(req.prompt_ids), num_tokens)
    if cached is not None:
        assert event.cached_prompt_tokens == cached
    return event


# ------------------------------------------------------------------------------------------ admission


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_fcfs_admission_under_the_running_cap(tokenizer, page_size):
    sim = Sim(tokenizer, page_size=page_size, num_pages=256, max_running=2, max_batch_tokens=64)
    lens = {"a": 30, "b": 5, "c": 3, "d": 20}  # short ones arrive late: they must not jump the queue
    reqs = {rid: sim.add(rid, prompt_of(n, i), max_new_tokens=3 + i) for i, (rid, n) in enumerate(lens.items())}
    first = sim.step()
    assert [e.req.rid for e in first] == ["a", "b"]
    assert [e.extend_len for e in first] == [30, 5] and all(e.samples for e in first)
    assert [r.rid for r in sim.sched.waiting] == ["c", "d"]
    sim.run()
    assert sim.admission_order == ["a", "b", "c", "d"]
    for i, req in enumerate(reqs.values()):
        assert_finished(sim, req, 3 + i, cached=0)
    sim.assert_all_freed()


def test_config_refuses_a_budget_below_the_running_cap():
    with pytest.raises(ValueError, match="max_batch_tokens"):
        SchedulerConfig(max_running_requests=8, max_batch_tokens=4)
    config = SchedulerConfig(max_running_requests=8, max_batch_tokens=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch_tokens = 4  # frozen: nothing changes the budget behind the scheduler's back
    with pytest.raises(dataclasses.FrozenInstanceError):
        BatchEntry(None, 0, 1, True).extend_len = 2


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_chunked_prefill_samples_only_on_the_last_chunk(tokenizer, page_size):
    sim = Sim(tokenizer, page_size=page_size, num_pages=128, max_running=4, max_batch_tokens=16)
    req = sim.add("long", prompt_of(40, 1), max_new_tokens=3)
    chunks = [sim.step() for _ in range(3)]
    assert [[(e.start, e.extend_len, e.samples) for e in step] for step in chunks] == [
        [(0, 16, False)], [(16, 16, False)], [(32, 8, True)]]
    assert req.output_ids == expected_output(req.prompt_ids, 1)  # one token after three steps
    sim.run()
    assert_finished(sim, req, 3)
    sim.assert_all_freed()


def test_the_last_token_of_the_budget_still_admits_a_prefill_chunk(tokenizer):
    sim = Sim(tokenizer, page_size=1, num_pages=64, max_running=2, max_batch_tokens=2)
    sim.add("a", prompt_of(2, 1), max_new_tokens=6)
    assert [(e.req.rid, e.extend_len) for e in sim.step()] == [("a", 2)]
    sim.add("b", prompt_of(3, 2), max_new_tokens=2)
    assert [(e.req.rid, e.extend_len) for e in sim.step()] == [("a", 1), ("b", 1)]
    sim.run()
    sim.assert_all_freed()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_decodes_come_before_new_prefills_within_the_budget(tokenizer, page_size):
    sim = Sim(tokenizer, page_size=page_size, num_pages=128, max_running=4, max_batch_tokens=16)
    a = sim.add("a", prompt_of(4, 1), max_new_tokens=20)
    b = sim.add("b", prompt_of(6, 2), max_new_tokens=20)
    assert [(e.req.rid, e.extend_len) for e in sim.step()] == [("a", 4), ("b", 6)]
    c = sim.add("c", prompt_of(40, 3), max_new_tokens=2)
    steps = [sim.step() for _ in range(3)]
    assert [[(e.req.rid, e.start, e.extend_len, e.samples) for e in step] for step in steps] == [
        [("a", 4, 1, True), ("b", 6, 1, True), ("c", 0, 14, False)],
        [("a", 5, 1, True), ("b", 7, 1, True), ("c", 14, 14, False)],
        [("a", 6, 1, True), ("b", 8, 1, True), ("c", 28, 12, True)],
    ]
    sim.run()
    for req, num_tokens in ((a, 20), (b, 20), (c, 2)):
        assert_finished(sim, req, num_tokens)
    assert all(sum(e.extend_len for e in step) <= 16 for step in sim.steps)
    sim.assert_all_freed()


# ------------------------------------------------------------------------------------------ LoRA slots


class FakeSlots:
    """LoraManager's surface for the scheduler: num_slots slots, an adapter keeps its slot while a running
    request uses it; nothing is loaded."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.users: dict[str, int] = {}
        self.slots = self  # the drain reads lora.slots.slot_of(d) and lora.slots.slots[i].is_pinned: both here

    def slot_of(self, digest: str) -> int | None:
        return list(self.users).index(digest) if digest in self.users else None

    def __getitem__(self, index: int):
        return SimpleNamespace(is_pinned=False)

    def can_acquire(self, digest: str) -> bool:
        return digest in self.users or len(self.users) < self.num_slots

    def acquire(self, digest: str, packed=None, wanted=()) -> int:
        assert self.can_acquire(digest), f"{digest} admitted without a slot"
        self.users[digest] = self.users.get(digest, 0) + 1
        return list(self.users).index(digest)

    def release(self, digest: str) -> None:
        self.users[digest] -= 1
        if not self.users[digest]:
            del self.users[digest]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_slot_blocked_requests_keep_their_arrival_order(tokenizer, page_size):
    """Guards: FCFS among requests that wait for an adapter slot. p holds the only slot; x1, y1, z1 of
    three other adapters wait behind it, a base request passes them. They must keep x1, y1, z1 order
    (a reversal would queue them z1, y1, x1), and x1 gets the slot first once p ends."""
    sim = Sim(tokenizer, page_size=page_size, num_pages=256, lora=FakeSlots(1))
    sim.add("p", prompt_of(4, 1), max_new_tokens=3, namespace="P")
    sim.step()
    for i, rid in enumerate(("x1", "y1", "z1")):
        sim.add(rid, prompt_of(5, 2 + i), max_new_tokens=2, namespace=rid[0].upper())
    sim.add("base", prompt_of(6, 9), max_new_tokens=2)
    sim.step()
    assert [r.rid for r in sim.sched.waiting] == ["x1", "y1", "z1"]
    assert [r.rid for r in sim.sched.running] == ["p", "base"]
    sim.run()
    assert sim.admission_order == ["p", "base", "x1", "y1", "z1"]
    assert not sim.sched.lora.users and all(r.lora_slot == -1 for r in sim.requests.values())
    sim.assert_all_freed()


def test_each_step_puts_an_adapters_requests_together(tokenizer):
    """Requests of adapters A, B and the base model arrive interleaved; every step (prefill, then
    decode) lists base requests first, then each adapter's requests together in arrival order, so a
    decode step's LoRA segments are one run per adapter (engine/lora_inputs.py, `lora_segments`)."""
    sim = Sim(tokenizer, page_size=1, num_pages=256, lora=FakeSlots(2))
    for i, namespace in enumerate("ABxBAxA"):
        sim.add(f"{namespace}{i}", prompt_of(3, i), max_new_tokens=3, namespace="" if namespace == "x" else namespace)
    order = ["x2", "x5", "A0", "A4", "A6", "B1", "B3"]
    for _ in range(3):
        step = sim.step()
        assert [e.req.rid for e in step] == order
        assert [e.req.lora_slot for e in step] == sorted(e.req.lora_slot for e in step)
    sim.run()
    sim.assert_all_freed()


def test_drain_holds_back_the_drained_adapter_until_the_starving_one_ran(tokenizer):
    """The scheduler consults the starvation drain before admission: once x1 has waited past the threshold
    for P's only slot, p2 (P's newer request, which could share P's slot) waits too, so the slot frees and
    x1 runs before p2. Without the drain p2 would join p1 at once."""
    offset = [0.0]  # Request.arrival is time.monotonic(); the drain's clock runs ahead of it on demand
    drain = StarvationDrain(1.0, clock=lambda: time.monotonic() + offset[0])
    sim = Sim(tokenizer, page_size=1, num_pages=256, lora=FakeSlots(1), drain=drain)
    sim.add("p1", prompt_of(4, 1), max_new_tokens=4, namespace="P")
    sim.step()
    sim.add("x1", prompt_of(5, 2), max_new_tokens=2, namespace="X")
    sim.step()
    offset[0] = 5.0
    p2 = sim.add("p2", prompt_of(6, 3), max_new_tokens=2, namespace="P")
    sim.step()
    assert (drain.draining, drain.starving) == ("P", "X") and drain.blocks(p2)
    assert [r.rid for r in sim.sched.running] == ["p1"] and [r.rid for r in sim.sched.waiting] == ["x1", "p2"]
    sim.run()
    assert sim.admission_order == ["p1", "x1", "p2"]
    sim.assert_all_freed()


# ---------------------------------------------------------------------------------------- prefix cache


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_prefix_cache_hit_is_per_namespace(tokenizer, page_size):
    sim = Sim(tokenizer, page_size=page_size, num_pages=128)
    prompt = prompt_of(13, 5)
    first = sim.add("first", prompt)
    sim.run()
    assert_finished(sim, first, 4, cached=0)

    other = sim.add("other-namespace", prompt, namespace="adapter-digest")
    (entry,) = sim.step()
    assert (other.cached_len, entry.start, entry.extend_len) == (0, 0, 13)
    sim.run()
    assert_finished(sim, other, 4, cached=0)

    again = sim.add("again", prompt)
    (entry,) = sim.step()
    num_cached = 12 // page_size * page_size  # whole pages of the prompt minus its last token
    assert (again.cached_len, entry.start, entry.extend_len) == (num_cached, num_cached, 13 - num_cached)
    sim.run()
    assert_finished(sim, again, 4, cached=num_cached)
    sim.assert_all_freed()


# ----------------------------------------------------------------------------------------- retraction


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_retraction_takes_the_latest_arrival_and_loses_no_token(tokenizer, page_size):
    prompt_len, max_new = 8, 12
    pages_each = num_pages_for(prompt_len + max_new - 1, page_size)
    # Two requests fit to the end, three do not.
    sim = Sim(tokenizer, page_size=page_size, num_pages=2 * pages_each + 1, max_batch_tokens=64)
    a, b, c = (sim.add(rid, prompt_of(prompt_len, i), max_new_tokens=max_new) for i, rid in enumerate("abc"))
    assert [e.req.rid for e in sim.step()] == ["a", "b", "c"]
    while not sim.sched.num_retractions:
        sim.step()
    assert sim.sched.num_retractions == 1
    assert [r.rid for r in sim.sched.running] == ["a", "b"]
    assert list(sim.sched.waiting) == [c] and c.req_row == -1 and c.kv_slots == [] and c.cached_len == 0
    num_before = len(c.output_ids)
    assert 0 < num_before < max_new
    assert c.output_ids == expected_output(c.prompt_ids, num_before)  # kept across the retraction
    late = sim.add("late", prompt_of(3, 9), max_new_tokens=2)  # arrives after c was queued again
    assert list(sim.sched.waiting) == [c, late]
    num_steps_before = len(sim.steps)

    sim.run()
    assert sim.admission_order == ["a", "b", "c", "late"]
    readmit = next(e for step in sim.steps[num_steps_before:] for e in step if e.req is c)
    # c re-prefills prompt + output (less any still-cached prefix), then samples the next token once.
    assert readmit.samples and readmit.start + readmit.extend_len == prompt_len + num_before
    for req in (a, b, c):
        assert_finished(sim, req, max_new, cached=0)
    assert_finished(sim, late, 2)
    sim.assert_all_freed()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("max_batch_tokens", [64, 8])
def test_request_too_large_for_the_pool_fails_and_others_run(tokenizer, page_size, max_batch_tokens):
    num_pages = 40 // page_size + 1  # 40 usable slots
    sim = Sim(tokenizer, page_size=page_size, num_pages=num_pages, max_batch_tokens=max_batch_tokens)
    alone = sim.add("alone", prompt_of(60, 1))
    sim.run()
    alone_event = sim.final("alone")
    assert isinstance(alone_event, Failed) and alone_event.code is Code.RESOURCE_EXHAUSTED
    assert "more KV" in alone_event.message
    assert alone.req_row == -1 and sim.sched.num_retractions == 0  # failed at once, not retracted first

    small1 = sim.add("small1", prompt_of(5, 2), max_new_tokens=6)
    big = sim.add("big", prompt_of(60, 3), max_new_tokens=2)
    small2 = sim.add("small2", prompt_of(7, 4), max_new_tokens=6)
    sim.run()
    event = sim.final("big")
    assert isinstance(event, Failed) and event.code is Code.RESOURCE_EXHAUSTED
    assert big.output_ids == [] and big.req_row == -1
    assert_finished(sim, small1, 6)
    assert_finished(sim, small2, 6)
    sim.assert_all_freed()


# --------------------------------------------------------------------------- cancellation and deadlines


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_cancel_and_deadline_free_every_page(tokenizer, page_size):
    now = [0.0]
    sim = Sim(tokenizer, page_size=page_size, num_pages=256, max_running=3, max_batch_tokens=64,
              clock=lambda: now[0])
    keep = sim.add("keep", prompt_of(9, 1), max_new_tokens=30)
    late = sim.add("deadline-running", prompt_of(14, 2), max_new_tokens=30, deadline=5.0)
    cancel = sim.add("cancel-running", prompt_of(11, 3), max_new_tokens=30)
    waiting_late = sim.add("deadline-waiting", prompt_of(5, 4), max_new_tokens=30, deadline=5.0)
    waiting_cancel = sim.add("cancel-waiting", prompt_of(6, 5), max_new_tokens=30)
    for _ in range(3):
        sim.step()
    now[0] = 5.0  # not past yet
    sim.step()
    assert [r.rid for r in sim.sched.running] == ["keep", "deadline-running", "cancel-running"]
    assert all(not sim.events[r.rid] for r in (late, cancel, waiting_late, waiting_cancel))

    now[0] = 5.5
    cancel.is_cancelled = waiting_cancel.is_cancelled = True
    sim.step()
    late_event = sim.final("deadline-running")
    assert isinstance(late_event, Failed) and late_event.code is Code.DEADLINE_EXCEEDED and "deadline" in late_event.message
    assert sim.final("deadline-waiting").code is Code.DEADLINE_EXCEEDED
    cancelled = sim.final("cancel-running")
    assert (cancelled.reason, cancelled.completion_tokens) == (FinishReason.CANCELLED, 4)
    assert sim.final("cancel-waiting") == Finished(FinishReason.CANCELLED, "", 6, 0, 0)
    assert [r.rid for r in sim.sched.running] == ["keep"] and not sim.sched.waiting
    assert all(r.req_row == -1 and not r.kv_slots for r in (late, cancel, waiting_late, waiting_cancel))
    # Every page the ended requests held is free or an unpinned cached prefix, which eviction frees.
    assert sim.radix.protected_size() == keep.cached_len == 0
    sim.radix.evict(10**9)
    assert sim.allocator.num_used_pages == len(keep.owned_pages) == num_pages_for(keep.kv_len, page_size)

    sim.run()
    assert_finished(sim, keep, 30)
    sim.assert_all_freed()


def test_each_ended_request_is_released_to_the_next_plan_once(tokenizer):
    """Guards `take_released`: the uids of the requests that ended since the last plan (finished, cancelled
    while waiting, failed as too big), in the order they ended, each handed over once, so the workers
    drop their per-request state."""
    sim = Sim(tokenizer, page_size=1, num_pages=41, max_running=4, max_batch_tokens=64)  # 40 KV slots
    short = sim.add("short", prompt_of(4, 1), max_new_tokens=1)
    big = sim.add("big", prompt_of(60, 2))
    long = sim.add("long", prompt_of(5, 3), max_new_tokens=3)
    sim.step()  # short samples its only token and ends; big waits for KV while short runs
    assert sim.sched.take_released() == [short.uid]
    assert sim.sched.take_released() == []
    sim.step()  # nothing runs: big fails at admission as too big, long is admitted
    assert sim.sched.take_released() == [big.uid] and isinstance(sim.final("big"), Failed)
    cancelled = sim.add("cancelled", prompt_of(6, 4))
    cancelled.is_cancelled = True
    sim.run()
    assert sim.sched.take_released() == [cancelled.uid, long.uid]
    assert sim.sched.take_released() == []
    sim.assert_all_freed()


# -------------------------------------------------------------------------------------------- truncation


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_truncate_frees_the_pages_past_the_kept_tokens(tokenizer, page_size):
    """RequestKV.truncate (a failed step's KV was never written): the pages wholly past `length` go back
    to the allocator, the rest stays the request's; truncating below the cached prefix is refused."""
    sim = Sim(tokenizer, page_size=page_size, num_pages=64)
    kv = sim.sched.kv
    req = sim.add("t", prompt_of(10, 1), max_new_tokens=5)
    sim.step()
    slots, owned, free = list(req.kv_slots), list(req.owned_pages), sim.allocator.num_free_pages
    kv.truncate(req, 10)  # nothing past the KV: unchanged
    assert (req.kv_slots, sim.allocator.num_free_pages) == (slots, free)
    kv.truncate(req, 3)
    kept = num_pages_for(3, page_size)
    assert req.kv_slots == slots[:3] and req.owned_pages == owned[:kept]
    assert sim.allocator.num_free_pages == free + len(owned) - kept
    sim.sched.finish(req, sim.sched.finished_event(req, FinishReason.CANCELLED))
    sim.assert_all_freed()

    sim.add("first", prompt_of(9, 2))
    sim.run()
    again = sim.add("again", prompt_of(9, 2))
    sim.step()
    assert again.cached_len > 0
    with pytest.raises(ValueError, match=rf"below the cached prefix \({again.cached_len} tokens\)"):
        kv.truncate(again, again.cached_len - 1)
    assert again.kv_len == 9
    sim.run()
    sim.assert_all_freed()


class FailingSlots(FakeSlots):
    def acquire(self, digest: str, packed=None, wanted=()) -> int:
        raise RuntimeError("the adapter could not be loaded")


def test_a_failed_slot_load_leaves_the_request_waiting_with_no_kv(tokenizer):
    """The loop's failure path must find the request in `waiting` and nothing of it held: no table row,
    no page, no lock, no slot."""
    sim = Sim(tokenizer, page_size=1, num_pages=64, lora=FailingSlots(1))
    req = sim.add("x", prompt_of(6, 1), namespace="X")
    free = sim.allocator.num_free_pages
    with pytest.raises(RuntimeError, match="could not be loaded"):
        sim.sched.schedule()
    assert list(sim.sched.waiting) == [req] and not sim.sched.running
    assert (req.req_row, req.kv_slots, req.lora_slot) == (-1, [], -1)
    assert sim.allocator.num_free_pages == free and sim.radix.protected_size() == 0
    assert sim.req_pool.num_free_rows == sim.req_pool.max_reqs


def test_growth_evicts_only_the_cached_prefixes_it_needs(tokenizer):
    """Short of pages, a request evicts least recently used cached prefixes until it fits, no more."""
    sim = Sim(tokenizer, page_size=1, num_pages=31)  # 30 usable slots
    for i in range(3):  # three cached prefixes of 6 tokens each (5 prompt + 1 computed output)
        sim.add(f"r{i}", prompt_of(5, 10 + i), max_new_tokens=2)
        sim.run()
    assert (sim.radix.total_size(), sim.allocator.num_free_pages) == (18, 12)
    sim.add("big", prompt_of(14, 20), max_new_tokens=2)  # 14 slots: 2 more than free
    sim.step()
    assert sim.radix.total_size() == 12  # only r0's prefix (the oldest) went
    again = sim.add("r2-again", prompt_of(5, 12), max_new_tokens=1)
    sim.run()
    assert again.first_cached_len == 4
    sim.assert_all_freed()


def test_an_admission_that_raises_loses_no_slot_blocked_request(tokenizer):
    """x1 and y1 wait for the only adapter slot (p holds it); admitting `base` after them raises once.
    Both, and base, must be back in `waiting` in arrival order, where the loop's failure path finds them."""
    sim = Sim(tokenizer, page_size=1, num_pages=256, lora=FakeSlots(1))
    sim.add("p", prompt_of(4, 1), max_new_tokens=3, namespace="P")
    sim.step()
    for i, rid in enumerate(("x1", "y1")):
        sim.add(rid, prompt_of(5, 2 + i), max_new_tokens=2, namespace=rid[0].upper())
    sim.add("base", prompt_of(6, 9), max_new_tokens=2)
    real_admit = sim.sched._admit

    def admit_raising_once(req, budget, wanted):
        sim.sched._admit = real_admit
        sim.sched.waiting.appendleft(req)  # as a failed slot load leaves it (see _admit)
        raise RuntimeError("simulated admission fault")

    sim.sched._admit = admit_raising_once
    with pytest.raises(RuntimeError, match="simulated admission fault"):
        sim.sched.schedule()
    # (the loop's failure path then fails every request; here only what it finds matters)
    assert [r.rid for r in sim.sched.waiting] == ["x1", "y1", "base"]


# ------------------------------------------------------------------------------------- LoRA load ahead


def real_lora(num_slots: int) -> LoraManager:
    """Real slot decisions; a packed adapter's stand-in (the slots and the host cache read only its rank and
    digest; nothing is copied)."""
    return LoraManager(AdapterSlots(num_slots), HostAdapterCache(8))


def add_with_adapter(sim: Sim, rid: str, namespace: str, seed: int, max_new_tokens: int = 3) -> Request:
    req = sim.add(rid, prompt_of(5, seed), max_new_tokens=max_new_tokens, namespace=namespace)
    req.packed_adapter = SimpleNamespace(rank=4, digest=namespace)  # admission fetched it before submitting
    return req


def step_loads(sim: Sim) -> list[tuple[str, int]]:
    """Step, then the (digest, slot) loads the step's plan would carry."""
    sim.step()
    return [(load.digest, load.slot) for load in sim.sched.lora.take_loads()[0]]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_waiting_requests_adapter_is_loaded_by_an_earlier_step(tokenizer, page_size):
    """Guards the overlap: b waits behind a (running cap 1); the plan of a's first step already loads b's
    adapter into the free slot, so the step that admits b loads nothing and b's tokens are intact."""
    sim = Sim(tokenizer, page_size=page_size, num_pages=256, max_running=1, lora=real_lora(2), load_ahead=2)
    a = add_with_adapter(sim, "a", "X", seed=1)
    b = add_with_adapter(sim, "b", "Y", seed=2)
    assert step_loads(sim) == [("X", 0), ("Y", 1)]  # X for a now, Y ahead for b
    assert list(sim.sched.waiting) == [b]
    while b not in sim.sched.running:
        assert step_loads(sim) == []
    assert b.lora_slot == 1 and sim.admission_order == ["a", "b"]
    sim.run()
    assert_finished(sim, a, 3) and assert_finished(sim, b, 3)
    slots = sim.sched.lora.slots
    assert (slots.num_loads, slots.num_loads_ahead, slots.num_evictions) == (2, 1, 0)
    sim.assert_all_freed()


def test_without_load_ahead_the_admitting_step_loads(tokenizer):
    """The same queue with the knob at 0: b's adapter is loaded by the plan of the step that runs b."""
    sim = Sim(tokenizer, page_size=1, num_pages=256, max_running=1, lora=real_lora(2), load_ahead=0)
    add_with_adapter(sim, "a", "X", seed=1)
    b = add_with_adapter(sim, "b", "Y", seed=2)
    assert step_loads(sim) == [("X", 0)]
    loads = []
    while b not in sim.sched.running:
        loads = step_loads(sim)
    assert loads == [("Y", 1)] and sim.sched.lora.slots.num_loads_ahead == 0


def test_load_ahead_is_bounded_per_step_and_follows_the_queue(tokenizer):
    sim = Sim(tokenizer, page_size=1, num_pages=256, max_running=1, lora=real_lora(4), load_ahead=2)
    add_with_adapter(sim, "a", "X", seed=1, max_new_tokens=6)
    for i, (rid, namespace) in enumerate((("b", "Y"), ("c", "Z"), ("d", "Y"), ("e", "W"))):
        add_with_adapter(sim, rid, namespace, seed=2 + i)
    assert step_loads(sim) == [("X", 0), ("Y", 1), ("Z", 2)]  # two ahead: Y (b, d), then Z
    assert step_loads(sim) == [("W", 3)]
    assert step_loads(sim) == []
    sim.run()
    assert sim.admission_order == ["a", "b", "c", "d", "e"]
    assert sim.sched.lora.slots.num_loads == 4 and sim.sched.lora.slots.num_evictions == 0
    sim.assert_all_freed()


def test_a_load_ahead_bound_of_one_loads_one_adapter_a_step(tokenizer):
    """The smallest bound is on: one waiting request's adapter a step, in queue order."""
    sim = Sim(tokenizer, page_size=1, num_pages=256, max_running=1, lora=real_lora(4), load_ahead=1)
    add_with_adapter(sim, "a", "X", seed=1, max_new_tokens=6)
    for i, (rid, namespace) in enumerate((("b", "Y"), ("c", "Z"), ("d", "W"))):
        add_with_adapter(sim, rid, namespace, seed=2 + i)
    assert [step_loads(sim) for _ in range(4)] == [[("X", 0), ("Y", 1)], [("Z", 2)], [("W", 3)], []]
    assert sim.sched.lora.slots.num_loads_ahead == 3
    sim.run()
    sim.assert_all_freed()


def test_load_ahead_never_evicts_an_adapter_in_use_pinned_or_wanted(tokenizer):
    """Slots: X used by running a, P pinned, Q idle but wanted by waiting q. Waiting b's adapter Y finds no
    slot it may take ahead, so nothing is loaded or evicted while a runs. Once a ends, admission takes X's
    slot for b, idle and wanted by nobody, though Q's is the least recently used: Q stays for q, so nothing
    is reloaded (plain LRU would evict Q, and the load ahead would put it back into X's slot)."""
    lora = real_lora(3)
    sim = Sim(tokenizer, page_size=1, num_pages=256, max_running=1, lora=lora, load_ahead=2)
    lora.pin("P", SimpleNamespace(rank=4, digest="P"))
    add_with_adapter(sim, "q0", "Q", seed=1, max_new_tokens=1)
    sim.run()
    lora.take_loads()
    a = add_with_adapter(sim, "a", "X", seed=2, max_new_tokens=3)
    b = add_with_adapter(sim, "b", "Y", seed=3)
    add_with_adapter(sim, "q", "Q", seed=4)
    assert step_loads(sim) == [("X", 2)] and a in sim.sched.running
    assert step_loads(sim) == [] and lora.slots.num_evictions == 0
    assert {s.digest for s in lora.slots.slots} == {"P", "Q", "X"}
    assert step_loads(sim) == []  # a samples its last token and ends in this step
    assert lora.slots.slots[1].last_used < lora.slots.slots[2].last_used  # Q is LRU's victim
    assert step_loads(sim) == [("Y", 2)] and b in sim.sched.running
    while len(sim.admission_order) < 4:
        assert step_loads(sim) == []  # q finds Q in place
    sim.run()
    assert lora.slots.slot_of("P") == 0 and lora.slots.slot_of("Q") == 1
    assert sim.admission_order == ["q0", "a", "b", "q"]
    assert (lora.slots.num_loads, lora.slots.num_loads_ahead, lora.slots.num_evictions) == (4, 0, 1)
    sim.assert_all_freed()


# --------------------------------------------------------------------------- admission's eviction victim


def idle_adapters(sim: Sim, *namespaces: str) -> None:
    """Run one request of each namespace in turn, so each is left idle in a slot, the first least recent."""
    for i, namespace in enumerate(namespaces):
        add_with_adapter(sim, f"{namespace.lower()}0", namespace, seed=20 + i, max_new_tokens=1)
        sim.run()
    sim.sched.lora.take_loads()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_admission_evicts_an_idle_adapter_no_waiting_request_needs(tokenizer, page_size):
    """Guards the victim choice without load ahead: Q (least recently used) and X sit idle; b (adapter Y)
    is admitted first while q waits for Q. b must take X's slot, so q finds Q in place: one load in all.
    Plain LRU would evict Q and reload it for q, evicting X."""
    lora = real_lora(2)
    sim = Sim(tokenizer, page_size=page_size, num_pages=256, max_running=1, lora=lora)
    idle_adapters(sim, "Q", "X")
    q_slot, x_slot = lora.slots.slot_of("Q"), lora.slots.slot_of("X")
    loads_before, evictions_before = lora.slots.num_loads, lora.slots.num_evictions
    b = add_with_adapter(sim, "b", "Y", seed=1)
    q = add_with_adapter(sim, "q", "Q", seed=2)
    assert step_loads(sim) == [("Y", x_slot)] and list(sim.sched.waiting) == [q]
    while q not in sim.sched.running:
        assert step_loads(sim) == []
    assert q.lora_slot == q_slot
    sim.run()
    assert_finished(sim, b, 3) and assert_finished(sim, q, 3)
    assert (lora.slots.num_loads - loads_before, lora.slots.num_evictions - evictions_before) == (1, 1)
    sim.assert_all_freed()


def test_admission_falls_back_to_lru_when_every_idle_adapter_is_wanted(tokenizer):
    """Q (least recently used) and R sit idle, both wanted by waiting requests: b's adapter Y must still get
    a slot, and LRU decides among the wanted ones (Q goes, not R)."""
    lora = real_lora(2)
    sim = Sim(tokenizer, page_size=1, num_pages=256, max_running=1, lora=lora)
    idle_adapters(sim, "Q", "R")
    q_slot, r_slot = lora.slots.slot_of("Q"), lora.slots.slot_of("R")
    add_with_adapter(sim, "b", "Y", seed=1)
    r = add_with_adapter(sim, "r", "R", seed=2)
    add_with_adapter(sim, "q", "Q", seed=3)
    assert step_loads(sim) == [("Y", q_slot)]
    while r not in sim.sched.running:
        assert step_loads(sim) == []
    assert r.lora_slot == r_slot  # R stayed
    sim.run()
    assert sim.admission_order[-3:] == ["b", "r", "q"]
    sim.assert_all_freed()


def test_a_request_that_left_the_queue_no_longer_protects_its_adapter(tokenizer):
    """Guards the per-step count: `big` (adapter Q) fails at admission as too big for the KV pool, so in
    the same step c's adapter Y may take Q's slot (now wanted by nobody) rather than X's, which d waits
    for. A wanted set that forgot to drop big's Q would spare it and evict X."""
    lora = real_lora(2)
    sim = Sim(tokenizer, page_size=1, num_pages=41, max_running=4, max_batch_tokens=64, lora=lora)  # 40 KV slots
    idle_adapters(sim, "X", "Q")  # X least recently used: LRU alone would evict X too
    q_slot, x_slot = lora.slots.slot_of("Q"), lora.slots.slot_of("X")
    big = sim.add("big", prompt_of(60, 1), namespace="Q")
    c = add_with_adapter(sim, "c", "Y", seed=2)
    d = add_with_adapter(sim, "d", "X", seed=3)
    assert step_loads(sim) == [("Y", q_slot)]
    assert isinstance(sim.final("big"), Failed) and big.lora_slot == -1
    assert (c.lora_slot, d.lora_slot) == (q_slot, x_slot)
    sim.run()
    sim.assert_all_freed()


def test_an_adapter_stays_wanted_while_another_request_waits_for_it(tokenizer):
    """The count, not a set: big and q both want Q (least recently used); big fails at admission, q still
    waits, so c's adapter Y takes X's slot and q finds Q in place."""
    lora = real_lora(2)
    sim = Sim(tokenizer, page_size=1, num_pages=41, max_running=4, max_batch_tokens=64, lora=lora)
    idle_adapters(sim, "Q", "X")
    q_slot, x_slot = lora.slots.slot_of("Q"), lora.slots.slot_of("X")
    sim.add("big", prompt_of(60, 1), namespace="Q")
    c = add_with_adapter(sim, "c", "Y", seed=2)
    q = add_with_adapter(sim, "q", "Q", seed=3)
    assert step_loads(sim) == [("Y", x_slot)]
    assert isinstance(sim.final("big"), Failed) and (c.lora_slot, q.lora_slot) == (x_slot, q_slot)
    sim.run()
    sim.assert_all_freed()


def test_a_base_request_failed_at_admission_leaves_the_wanted_adapters_alone(tokenizer):
    """A base request (no adapter) that fails at admission must not disturb the count: q still waits for
    Q (least recently used), so c's adapter Y takes X's slot."""
    lora = real_lora(2)
    sim = Sim(tokenizer, page_size=1, num_pages=41, max_running=4, max_batch_tokens=64, lora=lora)
    idle_adapters(sim, "Q", "X")
    x_slot = lora.slots.slot_of("X")
    sim.add("big", prompt_of(60, 1))
    add_with_adapter(sim, "c", "Y", seed=2)
    add_with_adapter(sim, "q", "Q", seed=3)
    assert step_loads(sim) == [("Y", x_slot)]
    sim.run()
    sim.assert_all_freed()

