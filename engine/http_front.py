"""The OpenAI-compatible HTTP front of the engine (aiohttp, in the same asyncio loop as grpc.aio).

A thin adapter: requests are parsed by engine/openai_api.py and go through the same admission path as
gRPC's Generate (engine/admission.py); engine status names map to HTTP statuses in openai_api.HTTP_STATUS.
A client that disconnects cancels its handler (aiohttp's handler cancellation), which closes the event
stream and cancels the request in the engine, freeing its KV pages and adapter slot.

Routes: POST /v1/completions, /v1/chat/completions, /v1/load_lora_adapter, /v1/unload_lora_adapter;
GET /v1/models, /health, /metrics.

`lora_path` of vLLM's load body is a registry reference here ("name" or "name@N", default: `lora_name`):
adapters enter loramux through the registry (`loramux adapters register DIR --name NAME`), never as a
path on the engine's disk; loading warms the adapter into the host cache so the first request skips the
fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine import openai_api as api
from engine.adapter_admin import AdapterAdmin
from engine.admission import Admission, AdmissionError, GenerateInput, admission_errors
from engine.chat_template import ChatTemplate, ChatTemplateError
from engine.request import Failed, Finished, TokenDelta
from loraformat.errors import Code
from loramux.ready import announce
from loramux.security import Principal, bearer_key

log = logging.getLogger(__name__)
UNLOAD_TIMEOUT_S = 60.0
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _error(exc: AdmissionError) -> web.Response:
    status, body = api.error_body(exc.code, str(exc))
    return web.json_response(body, status=status)


async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise api.bad_request("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise api.bad_request("the body must be a JSON object")
    return body


class HttpFront:
    def __init__(self, admission: Admission, admin: AdapterAdmin, metrics_registry, max_body_bytes: int):
        self.admission = admission
        self.core = admission.core
        self.admin = admin
        self.metrics_registry = metrics_registry
        self.chat_template = ChatTemplate.from_dir(self.core.config.model_dir)
        self.started = int(time.time())
        app = web.Application(client_max_size=max_body_bytes, middlewares=[self._errors])
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.post("/v1/load_lora_adapter", self.load_lora_adapter),
            web.post("/v1/unload_lora_adapter", self.unload_lora_adapter),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
        ])
        # handler_cancellation: a client that goes away cancels its handler, and so its request.
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        self.host = ""
        self.port = 0

    async def start(self, host: str, port: int, ssl_context=None) -> int:
        """Listen on host:port (0 = pick a free one; HTTPS with ssl_context), print the ready line;
        returns the port."""
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, reuse_port=False, ssl_context=ssl_context)
        await site.start()
        self.host, self.port = host, self.runner.addresses[0][1]
        announce("http", host, self.port)
        return self.port

    async def stop(self) -> None:
        await self.runner.cleanup()

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except AdmissionError as exc:
            return _error(exc)

    # ---- generation --------------------------------------------------------------------------

    async def _caller(self, request: web.Request) -> Principal:
        """The holder of the request's `Authorization: Bearer KEY` (401 without a valid one)."""
        return await self.admission.authenticate(bearer_key(request.headers.items()))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body, req, prompt_of = await self._parse(request, "completion")
        text, token_ids = api.completion_prompt(body)
        return await self._generate(request, req, prompt_of(text=text, token_ids=token_ids))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body, req, prompt_of = await self._parse(request, "chat")
        messages = api.chat_messages(body)
        add_generation_prompt = body.get("add_generation_prompt", True) is not False  # vLLM's extra field
        if self.chat_template is None:
            raise api.bad_request(f"model {req.model!r} has no chat template (tokenizer_config.json chat_template); use /v1/completions")
        try:
            prompt = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
        except ChatTemplateError as exc:
            raise api.bad_request(str(exc)) from None
        # The template wrote the special tokens itself: encode without adding any (as transformers does).
        token_ids = await asyncio.to_thread(self.core.tokenizer.encode, prompt, False)
        return await self._generate(request, req, prompt_of(token_ids=tuple(token_ids)))

    async def _parse(self, request: web.Request, kind: str):
        """What both generation routes read: the caller, the body, the reply's settings, and a function
        from the prompt (text or token ids) to the GenerateInput."""
        caller = await self._caller(request)
        body = await _json_body(request)
        req, adapter = api.parse_request(kind, body, self.core.base_model_name)
        with admission_errors():
            params = api.sampling_params(kind, body)

        def prompt_of(**prompt) -> GenerateInput:
            return GenerateInput(adapter=adapter, params=params, request_id=req.id, caller=caller, **prompt)

        return body, req, prompt_of

    async def _generate(self, request: web.Request, req: api.OpenAIRequest, inp: GenerateInput) -> web.StreamResponse:
        generation = await self.admission.start(inp)  # refusals leave as JSON errors before any byte is sent
        async with contextlib.aclosing(generation.events()) as events:
            if req.stream:
                return await self._stream(request, req, events)
            parts: list[str] = []
            async for event in events:
                if isinstance(event, TokenDelta):
                    parts.append(event.text)
                elif isinstance(event, Finished):
                    return web.json_response(api.full_reply(req, "".join(parts), event))
                elif isinstance(event, Failed):
                    raise AdmissionError(event.code, event.message)
        raise AdmissionError(Code.UNAVAILABLE, "the request ended without a result")

    async def _stream(self, request: web.Request, req: api.OpenAIRequest, events) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        if req.kind == "chat":
            await _send(response, api.delta_chunk(req, "", first=True))
        async for event in events:
            if isinstance(event, TokenDelta):
                if event.text:
                    await _send(response, api.delta_chunk(req, event.text))
            elif isinstance(event, Finished):
                await _send(response, api.final_chunk(req, event))
                if req.include_usage:
                    await _send(response, api.usage_chunk(req, event))
            elif isinstance(event, Failed):
                await _send(response, api.error_body(event.code, event.message)[1])
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # ---- models and adapters -----------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        caller = await self._caller(request)
        base = self.core.base_model_name
        data = [self._model(base, base, None)]
        with admission_errors():
            records = await self.admin.available()
        data += [self._model(r.name, r.ref, base) for r in records if caller.can_see(r.tenant, r.public)]
        return web.json_response({"object": "list", "data": data})

    def _model(self, model_id: str, root: str, parent: str | None) -> dict:
        return {"id": model_id, "object": "model", "created": self.started, "owned_by": "loramux", "root": root, "parent": parent}

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        name, ref = await self._lora_body(request)
        with admission_errors():
            state = await self.admin.load(ref, pin=False)
        return web.Response(text=f"Success: LoRA adapter '{name}' ({state.ref}) added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        name, ref = await self._lora_body(request)
        with admission_errors():
            await self.admin.unload(ref, UNLOAD_TIMEOUT_S)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _lora_body(self, request: web.Request) -> tuple[str, str]:
        """(lora_name, the registry reference to load): lora_path names the adapter, default lora_name.
        Loading and unloading decide what holds the GPU's slots: admin keys only."""
        self.admission.require_admin(await self._caller(request), "loading and unloading adapters")
        body = await _json_body(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise api.bad_request("lora_name: the adapter's name")
        if self.core.lora is None:
            raise AdmissionError(Code.FAILED_PRECONDITION, "this engine serves no adapters (--max-loras-per-batch 0)")
        ref = body.get("lora_path") or name
        if not isinstance(ref, str) or ref.partition("@")[0] != name:
            raise api.bad_request(
                f"lora_path: a registry reference of {name!r} ({name} or {name}@N); register adapter directories "
                "with `loramux adapters register DIR --name NAME`"
            )
        return name, ref

    # ---- health and metrics ------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if not self.admission.is_open:
            return _error(AdmissionError(Code.UNAVAILABLE, "the engine is starting or shutting down"))
        return web.Response(text="")

    async def metrics(self, request: web.Request) -> web.Response:
        body = await asyncio.to_thread(generate_latest, self.metrics_registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")
