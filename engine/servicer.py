"""gRPC servicer of loramux.v1.Engine: protobuf in and out around the protocol-neutral admission path
(engine/admission.py), which the HTTP front shares. Handlers never touch the model or the KV cache."""

from __future__ import annotations

import contextlib
import time

import grpc

from engine.adapter_admin import AdapterAdmin, AdapterResidency
from engine.admission import Admission, AdmissionError, GenerateInput, admission_errors
from engine.core import EngineCore, InvalidPrompt
from engine.request import Finished, TokenDelta
from engine.sampling import InvalidSampling, SamplingParams
from loraformat.errors import Code, StatusError
from loramux.security import Principal, bearer_key
from loramux.v1 import engine_pb2 as pb
from loramux.v1 import engine_pb2_grpc as pb_grpc


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


def _state_to_pb(state: AdapterResidency) -> pb.AdapterState:
    return pb.AdapterState(
        adapter=state.ref,
        digest=state.digest,
        on_gpu=state.on_gpu,
        in_slot=state.in_slot,
        in_host_cache=state.in_host_cache,
        pinned=state.pinned,
        running_requests=state.running_requests,
        waiting_requests=state.waiting_requests,
    )


async def _abort(context, exc: Exception):
    if isinstance(exc, StatusError):
        await context.abort(grpc_status(exc.code), str(exc))
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


class EngineServicer(pb_grpc.EngineServicer):
    def __init__(self, core: EngineCore, admin: AdapterAdmin, admission: Admission):
        self.core = core
        self.admin = admin
        self.admission = admission

    async def _admin(self, context, what: str) -> None:
        """With authentication on, adapter residency is the operator's: admin keys only."""
        try:
            caller = await self.admission.authenticate(_key_of(context))
            self.admission.require_admin(caller, what)
        except AdmissionError as exc:
            await context.abort(grpc_status(exc.code), str(exc))

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context) -> pb.AdapterState:
        await self._admin(context, "LoadAdapter")
        if self.core.lora is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this engine serves no adapters (--max-loras-per-batch 0)")
        try:
            return _state_to_pb(await self.admin.load(request.adapter, request.pin))
        except (StatusError, InvalidPrompt) as exc:
            await _abort(context, exc)

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context) -> pb.AdapterState:
        await self._admin(context, "UnloadAdapter")
        if self.core.lora is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this engine serves no adapters (--max-loras-per-batch 0)")
        remaining = context.time_remaining()
        try:
            return _state_to_pb(await self.admin.unload(request.adapter, remaining if remaining is not None else 600.0))
        except StatusError as exc:
            await _abort(context, exc)

    async def ListAdapters(self, request: pb.ListLoadedRequest, context) -> pb.ListLoadedResponse:
        await self._admin(context, "ListAdapters")
        states = await self.admin.states() if self.core.lora is not None else []
        return pb.ListLoadedResponse(adapters=[_state_to_pb(s) for s in states])

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            caller = await self.admission.authenticate(_key_of(context))
            generation = await self.admission.start(_generate_input(request, context, caller))
        except AdmissionError as exc:
            await context.abort(grpc_status(exc.code), str(exc))
        # Closing the events at once when this handler is cancelled cancels the request in the engine.
        async with contextlib.aclosing(generation.events()) as events:
            async for event in events:
                if isinstance(event, TokenDelta):
                    yield pb.GenerateResponse(chunk=pb.GenerateChunk(token_ids=event.token_ids, text=event.text))
                elif isinstance(event, Finished):
                    yield _complete(event, generation.request.adapter_ref)
                else:
                    await context.abort(grpc_status(event.code), event.message)


def grpc_status(code: Code | str) -> grpc.StatusCode:
    """An engine error kind (Code.NOT_FOUND, or its name from an AdmissionError) -> the gRPC status of
    the same name: the one place engine kinds become gRPC codes."""
    name = code.name if isinstance(code, Code) else code
    return getattr(grpc.StatusCode, name, grpc.StatusCode.UNKNOWN)


def _key_of(context) -> str:
    return bearer_key(context.invocation_metadata())


def _generate_input(request: pb.GenerateRequest, context, caller: Principal) -> GenerateInput:
    kind = request.WhichOneof("prompt")
    remaining = context.time_remaining()
    with admission_errors():
        params = sampling_from_pb(request.sampling)
    return GenerateInput(
        adapter=request.adapter,
        params=params,
        text=request.text if kind == "text" else None,
        token_ids=tuple(request.token_ids.ids) if kind == "token_ids" else None,
        request_id=request.request_id,
        deadline=time.monotonic() + remaining if remaining is not None else None,
        caller=caller,
    )
