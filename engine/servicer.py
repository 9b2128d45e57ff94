"""gRPC servicer of loramux.v1.Engine. Handlers validate, enqueue into the engine loop and stream
its events; they never touch the model or the KV cache. Protobuf stops here."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from engine.adapter_admin import AdapterAdmin, AdapterResidency
from engine.core import EngineCore, InvalidPrompt
from engine.request import Event, Finished, Request, TokenDelta
from engine.sampling import InvalidSampling, SamplingParams
from loramux.v1 import engine_pb2 as pb
from loramux.v1 import engine_pb2_grpc as pb_grpc
from registry.errors import Code, RegistryError


def sampling_from_pb(s: pb.SamplingParams) -> SamplingParams:
    if s.HasField("max_new_tokens") and s.max_new_tokens <= 0:
        raise InvalidSampling("max_new_tokens", f"must be > 0, got {s.max_new_tokens}")
    return SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p if s.top_p != 0 else 1.0,
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
        max_new_tokens=s.max_new_tokens if s.HasField("max_new_tokens") else 0,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
    )


def _complete(event: Finished, adapter: str) -> pb.GenerateResponse:
    usage = pb.Usage(
        prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens,
        cached_prompt_tokens=event.cached_prompt_tokens,
    )
    reason = pb.FinishReason.Value(f"FINISH_REASON_{event.reason.value}")
    complete = pb.GenerateComplete(finish_reason=reason, matched_stop=event.matched_stop, usage=usage, adapter=adapter)
    return pb.GenerateResponse(complete=complete)


def _thread_safe_sink(loop: asyncio.AbstractEventLoop, events: asyncio.Queue[Event]):
    """A sink the engine thread calls; events land in the handler's queue on the server's loop."""

    def sink(event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the server's loop has closed: nobody listens any more
            loop.call_soon_threadsafe(events.put_nowait, event)

    return sink


def _state_to_pb(state: AdapterResidency) -> pb.AdapterState:
    return pb.AdapterState(
        adapter=state.ref,
        digest=state.digest,
        on_gpu=state.on_gpu,
        in_host_cache=state.in_host_cache,
        pinned=state.pinned,
        running_requests=state.running_requests,
        waiting_requests=state.waiting_requests,
    )


async def _abort(context, exc: Exception):
    if isinstance(exc, RegistryError):
        await context.abort(getattr(grpc.StatusCode, exc.code.value), str(exc))
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


class EngineServicer(pb_grpc.EngineServicer):
    def __init__(self, core: EngineCore, admin: AdapterAdmin):
        self.core = core
        self.admin = admin

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context) -> pb.AdapterState:
        if self.core.lora is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this engine serves no adapters (--max-loras-per-batch 0)")
        try:
            return _state_to_pb(await self.admin.load(request.adapter, request.pin))
        except (RegistryError, InvalidPrompt) as exc:
            await _abort(context, exc)

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context) -> pb.AdapterState:
        if self.core.lora is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this engine serves no adapters (--max-loras-per-batch 0)")
        remaining = context.time_remaining()
        try:
            return _state_to_pb(await self.admin.unload(request.adapter, remaining if remaining is not None else 600.0))
        except RegistryError as exc:
            await _abort(context, exc)

    async def ListAdapters(self, request: pb.ListLoadedRequest, context) -> pb.ListLoadedResponse:
        states = await self.admin.states() if self.core.lora is not None else []
        return pb.ListLoadedResponse(adapters=[_state_to_pb(s) for s in states])

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        events: asyncio.Queue[Event] = asyncio.Queue()
        try:
            req = await self._new_request(request, context, events)
        except (InvalidPrompt, InvalidSampling) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RegistryError as exc:
            await _abort(context, exc)
        self.core.loop.submit(req)
        outcome, first_token_at, num_tokens = "CANCELLED", None, 0
        try:
            while True:
                event = await events.get()
                if isinstance(event, TokenDelta):
                    first_token_at = first_token_at or time.monotonic()
                    num_tokens += len(event.token_ids)
                    yield pb.GenerateResponse(chunk=pb.GenerateChunk(token_ids=event.token_ids, text=event.text))
                    continue
                if isinstance(event, Finished):
                    outcome = event.reason.value.lower()
                    yield _complete(event, req.adapter_ref)
                    return
                outcome = event.code
                await context.abort(getattr(grpc.StatusCode, event.code), event.message)
        finally:
            if outcome == "CANCELLED":  # the client went away or the deadline passed: free the KV now
                self.core.loop.cancel(req)
            self._record(req, outcome, first_token_at, num_tokens)

    def _record(self, req: Request, outcome: str, first_token_at: float | None, num_tokens: int) -> None:
        if self.core.metrics is None:
            return
        now = time.monotonic()
        self.core.metrics.record_finished(
            req.adapter_ref,
            outcome,
            num_prompt_tokens=len(req.prompt_ids),
            num_cached_tokens=max(req.first_cached_len, 0),
            num_generated_tokens=num_tokens,
            latency_s=now - req.arrival,
            first_token_s=None if first_token_at is None else first_token_at - req.arrival,
        )

    async def _new_request(self, request: pb.GenerateRequest, context, events: asyncio.Queue[Event]) -> Request:
        adapter = await self.core.resolve(request.adapter)  # an unknown adapter never means the base model
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidPrompt("prompt: set text or token_ids")
        text = request.text if kind == "text" else None
        token_ids = list(request.token_ids.ids) if kind == "token_ids" else None
        prompt_ids = await asyncio.to_thread(self.core.prompt_ids, text, token_ids)
        params = sampling_from_pb(request.sampling)
        loop = asyncio.get_running_loop()
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        sink = _thread_safe_sink(loop, events)
        req = self.core.new_request(prompt_ids, params, sink, rid=request.request_id, adapter=adapter, deadline=deadline)
        limit = self.core.config.max_queued_requests
        if self.core.loop.num_active >= limit:
            raise RegistryError(f"the engine queue is full ({limit} requests)", Code.RESOURCE_EXHAUSTED)
        if adapter is not None:  # fetched here, after every cheap check, so the engine loop never waits on it
            req.packed_adapter = await self.core.prepare(adapter)
        return req
