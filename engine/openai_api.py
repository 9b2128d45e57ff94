"""OpenAI's completions and chat completions wire format, in and out; plain dicts, no HTTP.

Requests become a `GenerateInput` for the shared admission path plus an `OpenAIRequest` with what the
reply needs (model name, stream settings). Everything checked here is refused as INVALID_ARGUMENT
naming the field; the engine checks the values themselves (ranges, context room) as for gRPC.

Defaults follow OpenAI and vLLM: completions `max_tokens` 16, chat `max_tokens` as much as the context
leaves (capped by the engine's default), `temperature` 1.0, `top_p` 1.0; vLLM's `top_k` (-1 or 0 =
off) and `ignore_eos` are accepted too. Only `n` = 1 is served.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from engine.admission import AdmissionError
from engine.request import Finished, FinishReason
from engine.sampling import SamplingParams
from loraformat.errors import Code

COMPLETIONS_MAX_TOKENS = 16
_FINISH_REASONS = {FinishReason.LENGTH: "length", FinishReason.EOS: "stop", FinishReason.STOP_SEQUENCE: "stop"}
# Fields that would change the output and that loramux does not implement: refused rather than ignored.
_UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "suffix", "best_of", "logit_bias", "tools", "response_format")
_PENALTIES = ("presence_penalty", "frequency_penalty")

# The engine's error kinds -> HTTP status and OpenAI error type (the one place they map).
HTTP_STATUS = {
    Code.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Code.FAILED_PRECONDITION: (400, "invalid_request_error"),
    Code.NOT_FOUND: (404, "not_found_error"),
    Code.ALREADY_EXISTS: (409, "invalid_request_error"),
    Code.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    Code.UNAVAILABLE: (503, "service_unavailable_error"),
    Code.DEADLINE_EXCEEDED: (504, "timeout_error"),
    Code.INTERNAL: (500, "internal_error"),
    Code.UNAUTHENTICATED: (401, "authentication_error"),
    Code.PERMISSION_DENIED: (403, "permission_error"),
}


def error_body(code: Code, message: str) -> tuple[int, dict]:
    """(HTTP status, OpenAI error body) for an engine error kind; the engine's sampling field names
    ("sampling.max_new_tokens") become the request's ("max_tokens")."""
    status, kind = HTTP_STATUS.get(code, (500, "internal_error"))
    message = message.replace("sampling.max_new_tokens", "max_tokens").replace("sampling.", "")
    return status, {"error": {"message": message, "type": kind, "param": None, "code": status}}


def bad_request(message: str) -> AdmissionError:
    return AdmissionError(Code.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class OpenAIRequest:
    kind: str  # "completion" or "chat"
    model: str
    stream: bool
    include_usage: bool
    id: str
    created: int


def parse_request(kind: str, body: object, base_model: str) -> tuple[OpenAIRequest, str]:
    """(the reply's settings, the adapter reference: "" for the base model)."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model: name the base model or an adapter (name or name@N)")
    if body.get("n") not in (None, 1):
        raise bad_request(f"n: only 1 is supported, got {body.get('n')!r}")
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, False, 0, [], {}):
            raise bad_request(f"{name}: not supported by loramux")
    for name in _PENALTIES:
        if body.get(name, 0) not in (0, 0.0, None):
            raise bad_request(f"{name}: not supported by loramux (only 0)")
    stream = _typed(body, "stream", bool, False)
    options = _typed(body, "stream_options", dict, None) or {}
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    request = OpenAIRequest(
        kind=kind,
        model=model,
        stream=stream,
        include_usage=bool(stream and options.get("include_usage")),
        id=f"{prefix}-{uuid.uuid4().hex}",
        created=int(time.time()),
    )
    return request, "" if model == base_model else model


def sampling_params(kind: str, body: dict) -> SamplingParams:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = COMPLETIONS_MAX_TOKENS if kind == "completion" else 0  # 0: what the context leaves
    elif not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise bad_request(f"max_tokens: must be an integer > 0, got {max_tokens!r}")
    top_k = _typed(body, "top_k", int, 0)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("stop: a string or a list of strings")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise bad_request(f"seed: must be an integer, got {seed!r}")
    return SamplingParams(
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=0 if top_k == -1 else top_k,
        seed=seed,
        max_new_tokens=max_tokens,
        stop=tuple(stop),
        stop_token_ids=_token_ids(body, "stop_token_ids"),
        ignore_eos=_typed(body, "ignore_eos", bool, False),
    )


def completion_prompt(body: dict) -> tuple[str | None, tuple[int, ...] | None]:
    """`prompt`: a string, a list of one string, a list of token ids, or a list of one such list."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, tuple(prompt)
    raise bad_request("prompt: a string or a list of token ids (one prompt per request)")


def chat_messages(body: dict) -> list[dict]:
    """`messages` as the template sees them; text content parts are joined like OpenAI's."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{i}]: an object with a string role")
        content = message.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise bad_request(f"messages[{i}].content: only text parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if content is not None and not isinstance(content, str):
            raise bad_request(f"messages[{i}].content: a string or a list of text parts")
        out.append({**message, "content": content})
    return out


# ---- replies -------------------------------------------------------------------------------------


def usage(event: Finished) -> dict:
    return {
        "prompt_tokens": event.prompt_tokens,
        "completion_tokens": event.completion_tokens,
        "total_tokens": event.prompt_tokens + event.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": event.cached_prompt_tokens},
    }


def finish_reason(event: Finished) -> str:
    return _FINISH_REASONS.get(event.reason, "stop")


def _choice(req: OpenAIRequest, text: str | None, reason: str | None, *, delta: bool, first: bool = False) -> dict:
    choice: dict = {"index": 0, "logprobs": None, "finish_reason": reason}
    if req.kind == "completion":
        choice["text"] = text or ""
    elif not delta:
        choice["message"] = {"role": "assistant", "content": text or ""}
    else:
        choice["delta"] = ({"role": "assistant"} if first else {}) | ({} if text is None else {"content": text})
    return choice


def _envelope(req: OpenAIRequest, choices: list[dict], *, chunk: bool) -> dict:
    kind = {"completion": "text_completion", "chat": "chat.completion"}[req.kind]
    if chunk and req.kind == "chat":
        kind = "chat.completion.chunk"
    return {"id": req.id, "object": kind, "created": req.created, "model": req.model, "choices": choices}


def full_reply(req: OpenAIRequest, text: str, event: Finished) -> dict:
    reply = _envelope(req, [_choice(req, text, finish_reason(event), delta=False)], chunk=False)
    reply["usage"] = usage(event)
    return reply


def delta_chunk(req: OpenAIRequest, text: str | None, *, first: bool = False) -> dict:
    return _with_usage(req, _envelope(req, [_choice(req, text, None, delta=True, first=first)], chunk=True))


def final_chunk(req: OpenAIRequest, event: Finished) -> dict:
    text = "" if req.kind == "completion" else None
    return _with_usage(req, _envelope(req, [_choice(req, text, finish_reason(event), delta=True)], chunk=True))


def usage_chunk(req: OpenAIRequest, event: Finished) -> dict:
    """The extra last chunk of `stream_options.include_usage`: no choices, the usage."""
    return {**_envelope(req, [], chunk=True), "usage": usage(event)}


def _with_usage(req: OpenAIRequest, chunk: dict) -> dict:
    return {**chunk, "usage": None} if req.include_usage else chunk


# ---- field helpers -------------------------------------------------------------------------------


def _typed(body: dict, name: str, kind: type, default):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise bad_request(f"{name}: must be of type {kind.__name__}, got {value!r}")
    return value


def _token_ids(body: dict, name: str) -> tuple[int, ...]:
    ids = _typed(body, name, list, None) or []
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request(f"{name}: a list of token ids")
    return tuple(ids)


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise bad_request(f"{name}: must be a number, got {value!r}")
    return float(value)
