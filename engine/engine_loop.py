"""The owner thread of the model: schedule -> forward -> sample -> post-process, over and over.

Other threads only `submit` requests and `cancel` them; everything else, including every KV and
prefix-cache change, happens on this thread. Events reach each request's sink from here.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from engine.errors import Code
from engine.model_runner import ModelRunner
from engine.request import Failed, FinishReason, Request, TokenDelta
from engine.scheduler import BatchEntry, Scheduler

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.05  # deadlines are checked at least this often while idle


class EngineLoop:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner):
        self.scheduler = scheduler
        self.runner = runner
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._lock = threading.Lock()
        self._num_active = 0  # submitted and not yet finished (read by other threads for admission)
        self.num_steps = 0
        self.after_step: Callable[[], None] | None = None  # e.g. a metrics sampler, run on this thread

    @property
    def num_active(self) -> int:
        return self._num_active

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)

    def submit(self, req: Request) -> None:
        with self._lock:
            self._num_active += 1
        sink = req.sink

        def counted(event, sink=sink):
            if not isinstance(event, TokenDelta):
                with self._lock:
                    self._num_active -= 1
            sink(event)

        req.sink = counted
        self._inbox.put(req)
        self._wake.set()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run fn on the loop thread before its next step (thread-safe); the future holds its result."""
        future: Future[T] = Future()
        self._calls.put((fn, future))
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
            self._run_calls()
            while not self._inbox.empty():
                self.scheduler.add(self._inbox.get())
            try:
                entries = self.scheduler.schedule()
                if entries:
                    self._step(entries)
                if self.after_step is not None:
                    self.after_step()
            except Exception:  # a bug must not leave every stream hanging: fail them, keep serving
                log.exception("engine step failed outside the forward")
                self._fail_all(Code.INTERNAL, "the engine failed this request (see the engine log)", keep_kv=False)
                entries = []
            if not entries:
                self._wake.wait(IDLE_WAIT_S)
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

    def _step(self, entries: list[BatchEntry]) -> None:
        try:
            tokens = self.runner.run(entries)
        except Exception:
            log.exception("forward step failed")
            for entry in entries:  # this step's KV was never (fully) written: it must not be cached
                self.scheduler.kv.truncate(entry.req, entry.start)
                self.scheduler.finish(entry.req, Failed(Code.INTERNAL, "the forward step failed (see the engine log)"))
            return
        self.num_steps += 1
        sampled = (e.req for e in entries if e.samples)
        for req, token in zip(sampled, tokens, strict=True):
            self._on_token(req, token)

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
        while not self._inbox.empty():
            self.scheduler.add(self._inbox.get())
        for req in [*self.scheduler.running, *self.scheduler.waiting]:
            if not keep_kv:
                self.scheduler.kv.truncate(req, req.cached_len)
            self.scheduler.finish(req, Failed(code, message))
