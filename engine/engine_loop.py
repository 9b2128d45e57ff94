"""The owner thread of the front: schedule -> plan -> workers launch -> post-process, over and over.

Other threads only `submit` requests and `cancel` them; everything else, including every KV and
prefix-cache change, happens on this thread. Events reach each request's sink from here. The step's
`StepPlan` is the only thing the workers see of the requests.

With `overlap` (the CUDA default), a launched step's tokens are read only after the next step is
launched when that one can be planned without them: while the device runs decode step k, this thread
plans and launches step k+1 (`Scheduler.schedule_ahead`; its inputs name step k's tokens, which the
workers substitute on the device), then post-processes step k's tokens, so the device does not wait
for the host's scheduling, planning, detokenizing and event delivery. Anything else (an
arrival to admit, a prefill, a cancellation, a call) takes the plain path: the step in flight is
post-processed first, then `schedule` runs.

A model worker that dies ends the engine, and so does any failed step under tensor parallelism (rank 0
failing alone leaves the other ranks in that step's collectives): `abort` (from the workers' watcher
thread, or this thread after a failed step) ends every live stream with UNAVAILABLE and calls `on_fatal`
once. It does not wait for this thread, which may be stuck in a collective with the dead rank: a live
request's final event is sent once, by whoever ends it first (see `submit`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from engine.delivery import batched
from engine.errors import Code, Unavailable
from engine.request import Failed, FinishReason, Request, TokenDelta
from engine.scheduler import BatchEntry, Scheduler
from engine.step_plan import PlanEntry, StepPlan, build_plan
from engine.worker import ProcessWorkers, WorkerDied

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.05  # deadlines are checked at least this often while idle
DEATH_GRACE_S = 5.0  # after a failed step, how long a worker's death may take to be seen


@dataclass(frozen=True)
class _Launched:
    """A step queued on the workers whose tokens the front has not read yet."""

    entries: list[BatchEntry]
    plan: StepPlan
    tokens: object  # engine.model_runner.SampledTokens: .result() -> list[int]


class EngineLoop:
    def __init__(self, scheduler: Scheduler, workers, overlap: bool = False):  # workers: engine.worker.LocalWorkers | ProcessWorkers
        self.scheduler = scheduler
        self.workers = workers
        self.overlap = overlap
        self._in_flight: _Launched | None = None
        workers.on_failure = self.abort
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._lock = threading.Lock()
        self._live: dict[int, Request] = {}  # uid -> submitted and not yet ended (under _lock)
        self.num_steps = 0
        self.after_step: Callable[[], None] | None = None  # e.g. a metrics sampler, run on this thread
        self.failure: str | None = None  # why the engine cannot serve any more (a worker died)
        self.on_fatal: Callable[[str], None] | None = None  # called once, from any thread, on failure

    @property
    def num_active(self) -> int:
        return len(self._live)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop (live streams end with UNAVAILABLE) and every model worker."""
        with self._lock:  # a submit or call either sees this or has queued before the loop's last drain
            self._stopping.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout if self.failure is None else 1.0)
        self.workers.close(abandon=self._thread.is_alive())

    def submit(self, req: Request) -> None:
        if self.failure is not None:
            req.emit(Failed(Code.UNAVAILABLE, self.failure))
            return
        sink = req.sink

        def once(event, sink=sink, uid=req.uid):
            with self._lock:
                if uid not in self._live:  # ended already (by an abort): nothing more reaches the stream
                    return
                if not isinstance(event, TokenDelta):
                    del self._live[uid]
            sink(event)

        req.sink = once
        with self._lock:
            stopped = self._stopping.is_set()  # then no loop thread will run it (or it is about to exit)
            if not stopped:
                self._live[req.uid] = req
                self._inbox.put(req)  # under the lock: the loop's final drain comes after stop sets _stopping
        if stopped:
            sink(Failed(Code.UNAVAILABLE, self.failure or "the engine is shutting down"))
            return
        self._wake.set()

    def abort(self, message: str) -> None:
        """A model worker died (any thread): end every live stream with UNAVAILABLE, stop, report once."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = message
            self._stopping.set()  # under the lock: a later submit fails itself rather than joining _live
            live = list(self._live.values())
        log.error("engine failed: %s", message)
        self._wake.set()
        for req in live:
            req.emit(Failed(Code.UNAVAILABLE, f"the engine failed: {message}"))
        if self.on_fatal is not None:
            self.on_fatal(message)

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run fn on the loop thread before its next step (thread-safe); the future holds its result."""
        future: Future[T] = Future()
        with self._lock:
            stopped = self._stopping.is_set()
            if not stopped:  # under the lock: the loop runs every call queued before stop sets _stopping
                self._calls.put((fn, future))
        if stopped:  # the loop thread has exited or is about to: nothing would ever run fn
            future.set_exception(Unavailable(self.failure or "the engine is shutting down"))
        self._wake.set()
        return future

    def cancel(self, req: Request) -> None:
        """Thread-safe: the loop frees req's KV at its next step."""
        req.is_cancelled = True
        self._wake.set()

    # ---- the loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            with batched():  # the step's events reach each server loop in one wake-up (engine/delivery.py)
                self._run_calls()
                try:
                    busy = self._advance()
                    if self.after_step is not None:
                        self.after_step()
                except Exception:  # a bug must not leave every stream hanging: fail them, keep serving
                    log.exception("engine step failed outside the forward")
                    self._in_flight = None
                    self._fail_all(Code.INTERNAL, "the engine failed this request (see the engine log)", keep_kv=False)
                    busy = False
            if not busy:
                self._wake.wait(IDLE_WAIT_S)
        if self._in_flight is not None and self.failure is None:
            with batched():
                self._post_process(self._take_in_flight())
        if self.failure is None:
            self._fail_all(Code.UNAVAILABLE, "the engine is shutting down")
        self._run_calls()

    def _run_calls(self) -> None:
        while not self._calls.empty():
            fn, future = self._calls.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:  # the caller sees it through the future
                    future.set_exception(exc)

    def plan(self, entries: list[BatchEntry], previous: list[BatchEntry] | None = None):
        """The step's plan and the packed adapters its loads copy (host memory, keyed by digest).
        previous: the in-flight step whose sampled tokens are this step's inputs (a chained plan)."""
        lora = self.scheduler.lora
        loads, adapters = lora.take_loads() if lora is not None else ((), {})
        rows = {id(e.req): i for i, e in enumerate(e for e in previous if e.samples)} if previous else {}
        plan = build_plan(
            (_plan_entry(e, rows.get(id(e.req), -1)) for e in entries), loads, self.scheduler.kv.req_pool.take_writes(),
            self.scheduler.take_released(),
        )  # fmt: skip
        return plan, adapters

    def _advance(self) -> bool:
        """Launch the next step, if any, and post-process the one before it; False when idle."""
        self._take_arrivals()  # right before deciding: the scheduler sees every request submitted so far
        previous = self._take_in_flight()
        if previous is not None:
            ahead = self.scheduler.schedule_ahead([e.req for e in previous.entries]) if self._chainable(previous) else []
            launched = self._launch(ahead, previous.entries) if ahead else None
            self._post_process(previous)
            if ahead:  # launched, or failed and already handled
                self._in_flight = launched
                return True
        entries = self.scheduler.schedule()
        if not entries:
            return previous is not None
        launched = self._launch(entries)
        if launched is not None:
            if self.overlap:
                self._in_flight = launched  # post-processed after the next launch, if one can go first
            else:
                self._post_process(launched)
        return True

    def _take_arrivals(self) -> None:
        while not self._inbox.empty():
            self.scheduler.add(self._inbox.get())

    def _chainable(self, step: _Launched) -> bool:
        # Arrivals are the scheduler's already: `schedule_ahead` stops the chain for one only when a
        # running place is free for it (a full batch goes on decoding while it waits, as before it came).
        return self.overlap and step.plan.is_decode and self._calls.empty()

    def _take_in_flight(self) -> _Launched | None:
        launched, self._in_flight = self._in_flight, None
        return launched

    def _launch(self, entries: list[BatchEntry], previous: list[BatchEntry] | None = None) -> _Launched | None:
        plan, adapters = self.plan(entries, previous)
        try:
            tokens = self.workers.launch(plan, adapters)
        except Exception as exc:
            self._step_failed(entries, exc)
            return None
        self.num_steps += 1
        return _Launched(entries, plan, tokens)

    def _post_process(self, step: _Launched) -> None:
        try:
            tokens = step.tokens.result()
        except Exception as exc:
            self._step_failed(step.entries, exc)
            return
        sampled = (e.req for e in step.entries if e.samples)
        for req, token in zip(sampled, tokens, strict=True):
            if not req.is_finished:  # else it ended on the step before (a stop token): this one is spare
                self._on_token(req, token)

    def _step_failed(self, entries: list[BatchEntry], exc: Exception) -> None:
        failure = str(exc) if isinstance(exc, WorkerDied) else self.workers.wait_for_failure(DEATH_GRACE_S)
        if failure is None and isinstance(self.workers, ProcessWorkers):
            # rank 0 alone failed (an adapter load, attention setup, OOM) while ranks 1..N are in this
            # step's collectives: the next step would desynchronise them, so the engine ends as if a
            # worker had died
            log.exception("forward step failed on rank 0 with tensor parallelism")
            failure = f"rank 0 failed a tensor-parallel step: {exc!r}"
        if failure is not None:
            self.abort(failure)
            return
        log.exception("forward step failed")
        for entry in entries:  # this step's KV was never (fully) written: it must not be cached
            if not entry.req.is_finished:
                self.scheduler.kv.truncate(entry.req, entry.start)
                self.scheduler.finish(entry.req, Failed(Code.INTERNAL, "the forward step failed (see the engine log)"))

    def _on_token(self, req: Request, token: int) -> None:
        req.output_ids.append(token)
        text, matched = req.stop_matcher.push(req.detokenizer.push(token))
        reason = self._finish_reason(req, token) if matched is None else FinishReason.STOP_SEQUENCE
        if reason is not None and matched is None:
            tail, matched = req.stop_matcher.push(req.detokenizer.flush())
            text += tail if matched is not None else tail + req.stop_matcher.flush()
            reason = FinishReason.STOP_SEQUENCE if matched is not None else reason
        req.emit(TokenDelta((token,), text))
        if reason is not None:
            self.scheduler.finish(req, self.scheduler.finished_event(req, reason, matched or ""))

    @staticmethod
    def _finish_reason(req: Request, token: int) -> FinishReason | None:
        if token in req.params.stop_token_ids:
            return FinishReason.STOP_SEQUENCE
        if not req.params.ignore_eos and token in req.eos_token_ids:
            return FinishReason.EOS
        if len(req.output_ids) >= req.params.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def _fail_all(self, code: Code, message: str, keep_kv: bool = True) -> None:
        """Fail every live request; keep_kv=False caches none of their KV (its state is unknown)."""
        self._take_arrivals()
        for req in [*self.scheduler.running, *self.scheduler.waiting]:
            if not keep_kv:
                self.scheduler.kv.truncate(req, req.cached_len)
            self.scheduler.finish(req, Failed(code, message))


def _plan_entry(e: BatchEntry, previous_row: int = -1) -> PlanEntry:
    req = e.req
    # a chained entry's one input is the step in flight's sample (previous_row), not yet known here
    input_ids = req.ids_between(e.start, e.start + e.extend_len) if previous_row < 0 else []
    return PlanEntry(
        uid=req.uid, input_ids=input_ids, kv_slots=req.kv_slots, req_row=req.req_row, start=e.start,
        extend_len=e.extend_len, params=req.params if e.samples else None, lora_slot=req.lora_slot,
        previous_row=previous_row,
    )  # fmt: skip
