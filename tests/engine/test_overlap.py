"""The overlapped schedule (engine/engine_loop.py, `Scheduler.schedule_ahead`): decode step k+1 is
planned and launched before step k's tokens are read, its inputs naming them (a chained plan).

On the CPU a launch runs the whole step, so these check the bookkeeping, not the speed: the same
streams as the plain schedule (stop tokens and strings, lengths, seeds, adapters, cancellation, failure,
two tensor-parallel ranks), chained plans really run, and no KV leaks. test_engine_generate.py runs all
of its tests in both modes as well.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import Code
from engine.request import Failed, Finished, FinishReason, TokenDelta
from engine.sampling import SamplingParams

PROMPTS = ["The overlapped schedule plans ahead", "Tokens arrive one step late", "café 日本語 and more", "A fourth prompt"]
WAIT_S = 60.0


class Stream:
    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if not isinstance(event, TokenDelta):
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events if isinstance(e, TokenDelta) for t in e.token_ids]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, TokenDelta))


def build(model_dir, overlap: bool, **config) -> tuple[EngineCore, list]:
    """A core whose loop overlaps or not, and the list of plans its workers launch."""
    core = EngineCore.build(EngineConfig(model_dir=str(model_dir), **config))
    core.loop.overlap = overlap
    plans, launch = [], core.loop.workers.launch

    def recording(plan, adapters):
        plans.append(plan)
        return launch(plan, adapters)

    core.loop.workers.launch = recording
    return core, plans


def submit(core: EngineCore, jobs) -> list[Stream]:
    streams = []
    for prompt, params, adapter in jobs:
        record = core.resolve_adapter(adapter) if adapter else None
        packed = asyncio.run(core.prepare(record)) if record is not None else None
        stream = Stream()
        core.loop.submit(core.new_request(core.prompt_ids(prompt, None), params, stream, adapter=record, packed=packed))
        streams.append(stream)
    return streams


def wait(streams: list[Stream]) -> None:
    assert all(s.done.wait(WAIT_S) for s in streams), "no final event"


def kv_is_consistent(core: EngineCore) -> bool:
    kv = core.loop.scheduler.kv
    return kv.radix.protected_size() == 0 and kv.allocator.num_used_pages * kv.page_size == kv.radix.total_size()


@pytest.fixture(scope="module")
def adapter_dir(make_adapter):
    return make_adapter("overlap-qv", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=31)


def run(model_dir, overlap: bool, jobs, **config):
    core, plans = build(model_dir, overlap, **config)
    streams = submit(core, jobs)  # queued before the loop starts: one batch
    core.loop.start()
    try:
        wait(streams)
        assert core.loop.num_active == 0 and kv_is_consistent(core)
    finally:
        core.loop.stop()
    return [(s.tokens, s.text, s.events[-1]) for s in streams], plans


def jobs_with_early_stops(model_dir, adapter_dir):
    """Greedy base and adapter requests of several lengths, one ended by a stop token it samples third,
    one by a stop string, and a seeded sampled one."""
    (plain, _, _), *_ = run(model_dir, False, [(PROMPTS[0], SamplingParams(max_new_tokens=8, ignore_eos=True), "")])[0]
    adapters = (("qv", str(adapter_dir)),)
    return [
        (PROMPTS[0], SamplingParams(max_new_tokens=20, ignore_eos=True, stop_token_ids=(plain[2],)), ""),
        (PROMPTS[1], SamplingParams(max_new_tokens=3, ignore_eos=True), "qv"),
        (PROMPTS[2], SamplingParams(max_new_tokens=16, ignore_eos=True), ""),
        (PROMPTS[3], SamplingParams(max_new_tokens=11, ignore_eos=True, temperature=0.9, seed=5), "qv"),
        (PROMPTS[1], SamplingParams(max_new_tokens=1, ignore_eos=True), ""),
    ], adapters


def test_overlapped_streams_equal_the_plain_ones_and_chained_plans_run(tiny_llama_dir, adapter_dir, tmp_path):
    jobs, adapters = jobs_with_early_stops(tiny_llama_dir, adapter_dir)
    plain, plain_plans = run(tiny_llama_dir, False, jobs, adapters=adapters, work_dir=str(tmp_path / "a"))
    overlapped, plans = run(tiny_llama_dir, True, jobs, adapters=adapters, work_dir=str(tmp_path / "b"))
    assert overlapped == plain
    assert plain[0][2].reason is FinishReason.STOP_SEQUENCE and len(plain[0][0]) == 3  # ended by its stop token
    assert not any(p.chained for p in plain_plans)
    chained = [p for p in plans if p.chained]
    assert len(chained) >= 10
    assert all(p.is_decode and all(i < 0 for i in p.input_ids) for p in chained)
    # the request stopped by a token was in the step planned before that token was seen (a spare row),
    # and the chain went on past it: one decode step only (the first) was planned after its tokens
    assert any(p.num_requests == 4 for p in chained)
    assert sum(p.is_decode and not p.chained for p in plans) == 1


def test_a_stop_string_and_tensor_parallel_ranks_under_overlap(tiny_llama_dir):
    (_, text, _), *_ = run(tiny_llama_dir, False, [(PROMPTS[2], SamplingParams(max_new_tokens=12, ignore_eos=True), "")])[0]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    jobs = [
        (PROMPTS[2], SamplingParams(max_new_tokens=12, ignore_eos=True, stop=[stop]), ""),
        (PROMPTS[0], SamplingParams(max_new_tokens=9, ignore_eos=True), ""),
    ]
    plain, _ = run(tiny_llama_dir, False, jobs)
    overlapped, plans = run(tiny_llama_dir, True, jobs, tensor_parallel_size=2)  # ranks substitute rank 0's tokens
    assert overlapped == plain
    assert plain[0][2] == Finished(FinishReason.STOP_SEQUENCE, stop, plain[0][2].prompt_tokens, len(plain[0][0]), 0)
    assert any(p.chained for p in plans)


def test_a_cancel_under_overlap_ends_one_stream_and_leaks_nothing(tiny_llama_dir):
    core, plans = build(tiny_llama_dir, True)
    core.loop.start()
    try:
        long, short = Stream(), Stream()
        req = core.new_request(core.prompt_ids(PROMPTS[0], None), SamplingParams(max_new_tokens=400, ignore_eos=True), long)
        core.loop.submit(req)
        core.loop.submit(core.new_request(core.prompt_ids(PROMPTS[1], None), SamplingParams(max_new_tokens=30, ignore_eos=True), short))
        while len(long.tokens) < 5:
            assert not long.done.wait(0.01)
        core.loop.cancel(req)
        wait([long, short])
        assert long.events[-1].reason is FinishReason.CANCELLED and len(long.tokens) < 400
        assert isinstance(short.events[-1], Finished) and len(short.tokens) == 30
        assert core.loop.num_active == 0 and kv_is_consistent(core)
        assert any(p.chained for p in plans)
    finally:
        core.loop.stop()


def test_a_failed_chained_step_fails_its_requests_and_the_engine_goes_on(tiny_llama_dir):
    jobs = [(PROMPTS[0], SamplingParams(max_new_tokens=10, ignore_eos=True), "")]
    (expected, _, _), *_ = run(tiny_llama_dir, False, jobs)[0]
    core, _ = build(tiny_llama_dir, True)
    launch, failed = core.loop.workers.launch, []

    def fail_first_chained(plan, adapters):
        if plan.chained and not failed:
            failed.append(plan)
            raise RuntimeError("simulated device fault")
        return launch(plan, adapters)

    core.loop.workers.launch = fail_first_chained
    core.loop.start()
    try:
        (stream,) = submit(core, jobs)
        wait([stream])
        assert failed and isinstance(stream.events[-1], Failed) and stream.events[-1].code is Code.INTERNAL
        assert kv_is_consistent(core)
        (again,) = submit(core, jobs)
        wait([again])
        assert again.tokens == expected and kv_is_consistent(core)
    finally:
        core.loop.stop()


def test_schedule_ahead_leaves_to_schedule_what_it_cannot_decide(tiny_llama_dir):
    core = EngineCore.build(EngineConfig(model_dir=str(tiny_llama_dir), max_running_requests=2, max_batch_tokens=64))
    loop, scheduler = core.loop, core.loop.scheduler

    def new(prompt: str, max_new: int):
        return core.new_request(core.prompt_ids(prompt, None), SamplingParams(max_new_tokens=max_new, ignore_eos=True), Stream())

    a, b = new(PROMPTS[0], 10), new(PROMPTS[1], 2)
    scheduler.add(a)
    scheduler.add(b)
    loop._post_process(loop._launch(scheduler.schedule()))  # the prefill: one token each
    decode = scheduler.schedule()
    step = loop._launch(decode)  # in flight: b's second and last token, a's second
    kv_before = (a.kv_len, b.kv_len)
    ahead = scheduler.schedule_ahead([e.req for e in decode])
    assert [e.req for e in ahead] == [a]  # b ends on the step in flight (max_new_tokens)
    assert (ahead[0].start, ahead[0].extend_len, ahead[0].samples) == (kv_before[0], 1, True)
    assert (a.kv_len, b.kv_len) == (kv_before[0] + 1, kv_before[1])
    plan, _ = loop.plan(ahead, decode)
    assert plan.chained and plan.input_ids == (-1,)  # a was row 0 of the step in flight
    loop._post_process(step)
    assert b.is_finished and len(a.output_ids) == 2

    # what only schedule decides: an arrival while a running place is free, a cancel
    running = [e.req for e in ahead]
    c = new(PROMPTS[2], 4)
    scheduler.add(c)
    assert scheduler.schedule_ahead(running) == [] and a.kv_len == kv_before[0] + 1
    scheduler.waiting.remove(c)
    a.is_cancelled = True
    assert scheduler.schedule_ahead(running) == []


@pytest.mark.parametrize("max_running", [1, 2])
def test_an_arrival_stops_the_chain_only_when_a_running_place_is_free(tiny_llama_dir, max_running):
    """A request submitted while decode steps are chained reaches the scheduler before the next plan:
    with the batch full (max_running 1) the chain goes on and it waits; with a place free (2) the next
    step is planned by `schedule` and admits it."""
    core, plans = build(tiny_llama_dir, True, max_running_requests=max_running)
    loop = core.loop

    def submit_one(prompt: str, max_new: int) -> Stream:
        stream = Stream()
        loop.submit(core.new_request(core.prompt_ids(prompt, None), SamplingParams(max_new_tokens=max_new, ignore_eos=True), stream))
        return stream

    first = submit_one(PROMPTS[0], 12)
    for _ in range(3):  # the prefill, the first decode (planned after it), a chained decode
        loop._advance()
    assert [p.chained for p in plans] == [False, False, True]
    second = submit_one(PROMPTS[1], 3)
    loop._advance()
    arrived = plans[3]
    if max_running == 1:
        assert arrived.chained and arrived.num_requests == 1  # the full batch went on decoding
    else:
        assert not arrived.chained and arrived.num_requests == 2 and not arrived.is_decode  # admitted: a prefill beside the decode
    while loop._advance():
        pass
    wait([first, second])
    assert len(first.tokens) == 12 and len(second.tokens) == 3
    assert loop.num_active == 0 and kv_is_consistent(core)
