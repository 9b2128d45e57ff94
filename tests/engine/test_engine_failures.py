"""A failing step never poisons the prefix cache, leaks KV, or leaves a stream hanging."""

from __future__ import annotations

import threading

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import Code, EngineError
from engine.request import Failed, Finished, TokenDelta
from engine.sampling import SamplingParams

PROMPT = "A failed step must not be cached " * 3


def run(core: EngineCore, prompt: str = PROMPT):
    done, events = threading.Event(), []

    def sink(event):
        events.append(event)
        if not isinstance(event, TokenDelta):
            done.set()

    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    core.loop.submit(core.new_request(core.prompt_ids(prompt, None), params, sink))
    assert done.wait(60)
    return [t for e in events if isinstance(e, TokenDelta) for t in e.token_ids], events[-1]


def kv_is_consistent(core: EngineCore) -> bool:
    kv = core.loop.scheduler.kv
    return kv.radix.protected_size() == 0 and kv.allocator.num_used_pages * kv.page_size == kv.radix.total_size()


def test_failed_forward_is_not_cached_and_frees_its_kv(tiny_llama_dir):
    core = EngineCore.build(EngineConfig(model_dir=str(tiny_llama_dir), max_batch_tokens=8, max_running_requests=8))  # chunked prefill
    expected, _ = run_fresh(tiny_llama_dir)
    real_launch, calls = core.loop.workers.launch, {"n": 0}

    def fail_on_third_step(plan, adapters):
        calls["n"] += 1
        if calls["n"] == 3:  # mid-prefill: two chunks computed, the third never is
            raise RuntimeError("simulated device fault")
        return real_launch(plan, adapters)

    core.loop.workers.launch = fail_on_third_step
    core.loop.start()
    try:
        _, failed = run(core)
        assert isinstance(failed, Failed) and failed.code is Code.INTERNAL
        assert kv_is_consistent(core)
        tokens, finished = run(core)
        assert isinstance(finished, Finished) and tokens == expected
        assert finished.cached_prompt_tokens <= 16  # at most the two chunks that were really computed
    finally:
        core.loop.stop()


def test_a_failure_outside_the_forward_fails_requests_and_the_loop_goes_on(tiny_llama_dir):
    core = EngineCore.build(EngineConfig(model_dir=str(tiny_llama_dir)))
    scheduler, real_schedule, calls = core.loop.scheduler, core.loop.scheduler.schedule, {"n": 0}

    def broken_once():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated scheduler bug")
        return real_schedule()

    scheduler.schedule = broken_once
    core.loop.start()
    try:
        _, failed = run(core)
        assert isinstance(failed, Failed) and failed.code is Code.INTERNAL
        assert kv_is_consistent(core)
        tokens, finished = run(core)
        assert isinstance(finished, Finished) and len(tokens) == 6
    finally:
        core.loop.stop()


def run_fresh(model_dir):
    core = EngineCore.build(EngineConfig(model_dir=str(model_dir)))
    core.loop.start()
    try:
        return run(core)
    finally:
        core.loop.stop()


def test_a_request_submitted_after_stop_fails_unavailable_at_once(tiny_llama_dir):
    core = EngineCore.build(EngineConfig(model_dir=str(tiny_llama_dir)))
    core.loop.start()
    core.loop.stop()  # the loop thread has exited: nothing would ever run a queued request
    done, events = threading.Event(), []

    def sink(event):
        events.append(event)
        done.set()

    core.loop.submit(core.new_request(core.prompt_ids(PROMPT, None), SamplingParams(max_new_tokens=2), sink))
    assert done.wait(60), "the stream hung after stop"
    [failed] = events
    assert isinstance(failed, Failed) and failed.code is Code.UNAVAILABLE
    assert core.loop.num_active == 0


def test_a_call_after_stop_fails_unavailable_at_once(tiny_llama_dir):
    core = EngineCore.build(EngineConfig(model_dir=str(tiny_llama_dir)))
    core.loop.start()
    core.loop.stop()
    future = core.loop.call(lambda: "ran")
    error = future.exception(timeout=60)  # a hang raises TimeoutError here
    assert isinstance(error, EngineError) and error.code is Code.UNAVAILABLE
