"""One admission path for every protocol front (the gRPC servicer, the OpenAI-compatible HTTP front).

`Admission.start` runs the checks in one order, cheapest first: ready, adapter reference, prompt,
sampling values, queue room; only then does it fetch the adapter (so a bad request never waits on the
registry) and submit. `Generation.events` streams the request's events and, when the caller stops
listening before the end (a client that went away, a deadline), cancels it so its KV pages and adapter
slot return at once. Errors leave as `AdmissionError`s with a status name; each front maps names to its
own status (gRPC code, HTTP status) in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.auth import KeyChecker, OpenDoor
from engine.core import EngineCore, InvalidPrompt
from engine.delivery import EventDelivery
from engine.errors import NotFound
from engine.request import Event, Failed, Finished, Request, TokenDelta
from engine.sampling import InvalidSampling, SamplingParams
from loraformat.errors import Code, StatusError
from loramux.security import ANONYMOUS, Principal


class AdmissionError(Exception):
    """A refused request; `code` is its kind (Code.INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED,
    UNAVAILABLE, ...; a str equal to its name), the message names the offending field."""

    def __init__(self, code: Code, message: str):
        super().__init__(message)
        self.code = code


@contextlib.contextmanager
def admission_errors():
    """Turns the engine's and the registry link's own errors into AdmissionErrors."""
    try:
        yield
    except (InvalidPrompt, InvalidSampling) as exc:
        raise AdmissionError(Code.INVALID_ARGUMENT, str(exc)) from None
    except StatusError as exc:  # the engine's own errors and the adapter format's
        raise AdmissionError(exc.code, str(exc)) from None


@dataclass(frozen=True)
class GenerateInput:
    """A generation request in plain data; exactly one of `text` and `token_ids` is set."""

    adapter: str  # "" = the base model, "name" or "name@N"
    params: SamplingParams
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    request_id: str = ""
    deadline: float | None = None  # time.monotonic() seconds
    caller: Principal = ANONYMOUS


class Admission:
    """The gate in front of the engine core: closed until the loop has warmed up, closed again at stop.
    It also knows who calls (`authenticate`): every front asks it, so one check serves gRPC and HTTP."""

    def __init__(self, core: EngineCore, auth: KeyChecker | OpenDoor | None = None):
        self.core = core
        self.auth = auth or OpenDoor()
        self.is_open = False
        self.num_fetching = 0  # admitted requests waiting for their adapter's fetch

    async def authenticate(self, key: str) -> Principal:
        """The holder of `key` (ANONYMOUS without authentication); AdmissionError UNAUTHENTICATED."""
        with admission_errors():
            return await self.auth.caller(key)

    @staticmethod
    def require_admin(caller: Principal, what: str) -> None:
        with admission_errors():
            caller.require_admin(what)

    async def start(self, inp: GenerateInput) -> Generation:
        """Check, fetch the adapter, submit; raises AdmissionError."""
        if not self.is_open:
            raise AdmissionError(Code.UNAVAILABLE, "the engine is starting or shutting down")
        events: asyncio.Queue[Event] = asyncio.Queue()
        with admission_errors():
            req = await self._new_request(inp, events)
        self.core.loop.submit(req)
        return Generation(self.core, req, events)

    async def _new_request(self, inp: GenerateInput, events: asyncio.Queue[Event]) -> Request:
        core = self.core
        adapter = await core.resolve(inp.adapter)  # an unknown adapter never means the base model
        if adapter is not None:
            if not inp.caller.can_see(adapter.tenant, adapter.public):
                raise NotFound(f"adapter {inp.adapter!r} is not registered")  # the registry's words: names do not leak
            core.check_base_model(adapter, inp.adapter)  # only now: its answer names the adapter's base model
        if (inp.text is None) == (inp.token_ids is None):
            raise InvalidPrompt("prompt: set text or token_ids")
        token_ids = None if inp.token_ids is None else list(inp.token_ids)
        prompt_ids = await asyncio.to_thread(core.prompt_ids, inp.text, token_ids)
        sink = _thread_safe_sink(asyncio.get_running_loop(), events)
        req = core.new_request(
            prompt_ids, inp.params, sink, rid=inp.request_id, adapter=adapter, deadline=inp.deadline,
            tenant=inp.caller.tenant,
        )
        limit = core.config.max_queued_requests
        # Requests still waiting for their adapter's fetch count too: they are queued, only not yet
        # in the loop (the check and the count below run without an await between them).
        if core.loop.num_active + self.num_fetching >= limit:
            raise AdmissionError(Code.RESOURCE_EXHAUSTED, f"the engine queue is full ({limit} requests)")
        if adapter is not None:  # fetched here, after every cheap check, so the engine loop never waits on it
            self.num_fetching += 1
            try:
                req.packed_adapter = await core.prepare(adapter)
            finally:
                self.num_fetching -= 1
        return req


class Generation:
    """A submitted request: its events, in order, ending with one Finished or Failed."""

    def __init__(self, core: EngineCore, req: Request, events: asyncio.Queue[Event]):
        self.core = core
        self.request = req
        self._events = events

    async def events(self) -> AsyncIterator[Event]:
        """Yields TokenDeltas, then one Finished or Failed. Leaving early (the consumer stops iterating,
        or its task is cancelled) cancels the request in the engine."""
        outcome, first_token_at, num_tokens = "CANCELLED", None, 0
        try:
            while True:
                event = await self._events.get()
                if isinstance(event, TokenDelta):
                    first_token_at = first_token_at or time.monotonic()
                    num_tokens += len(event.token_ids)
                elif isinstance(event, Finished):
                    outcome = event.reason.value.lower()
                elif isinstance(event, Failed):
                    outcome = event.code.value
                yield event
                if not isinstance(event, TokenDelta):
                    return
        finally:
            if outcome == "CANCELLED":  # the client went away or the deadline passed: free the KV now
                self.core.loop.cancel(self.request)
            self._record(outcome, first_token_at, num_tokens)

    def _record(self, outcome: str, first_token_at: float | None, num_tokens: int) -> None:
        if self.core.metrics is None:
            return
        req, now = self.request, time.monotonic()
        self.core.metrics.record_finished(
            req.adapter_ref,
            outcome,
            num_prompt_tokens=len(req.prompt_ids),
            num_cached_tokens=max(req.first_cached_len, 0),
            num_generated_tokens=num_tokens,
            latency_s=now - req.arrival,
            first_token_s=None if first_token_at is None else first_token_at - req.arrival,
        )


def _thread_safe_sink(loop: asyncio.AbstractEventLoop, events: asyncio.Queue[Event]):
    """A sink the engine thread calls; events land in the handler's queue on the server's loop, through
    that loop's one EventDelivery."""
    delivery = EventDelivery.of(loop)

    def sink(event: Event) -> None:
        delivery.put(events, event)

    return sink
