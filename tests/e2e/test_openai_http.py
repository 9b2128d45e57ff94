"""`loramux up` on the CPU driven by clients nobody here wrote: the official `openai` package and curl.

Every greedy HTTP answer is compared with gRPC `Generate` for the same request (the chat prompt rendered
by transformers' apply_chat_template), base model and adapters, streaming and not.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import urllib.request

import openai
import pytest
from transformers import AutoTokenizer

from loramux.demo_model import write_demo_adapter
from loramux.engine_client import EngineClient, generate_request
from loramux.testing.procs import Service, run_cli
from tests.test_model_server_metrics import parse_lora_info

pytestmark = pytest.mark.slow
BASE = "loramux-demo"
PROMPT = "Once upon a time"
GREEDY = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data = tmp_path_factory.mktemp("up")
    args = ["up", "--data-dir", str(data), "--registry-port", "0", "--engine-port", "0", "--http-port", "0"]
    up = Service(args, "registry", also=("engine", "http"))
    try:
        reg = ("--registry", up.address)
        run_cli("adapters", "register", str(data / "demo-adapter"), "--name", "demo", *reg)
        other = write_demo_adapter(data / "other-adapter", data / "models" / BASE, rank=4, seed=7)
        run_cli("adapters", "register", str(other), "--name", "other", *reg)
        assert any(line.strip().startswith("curl -s http://") for line in up.stdout)  # the ready-to-paste line
        yield up, data
    finally:
        assert up.interrupt() == 0, "".join(up.stderr)[-3000:]


@pytest.fixture(scope="module")
def client(stack):
    up, _ = stack
    return openai.OpenAI(base_url=f"http://{up.addresses['http']}/v1", api_key="unused", max_retries=0, timeout=120)


def grpc_text(up, prompt, adapter: str, max_new_tokens: int = 8) -> tuple[str, str]:
    with EngineClient(up.addresses["engine"]) as engine:
        result = engine.generate(generate_request(prompt, adapter=adapter, max_new_tokens=max_new_tokens, ignore_eos=True))
    return result.text, result.complete.adapter


def chat_prompt_ids(data, messages) -> list[int]:
    hf = AutoTokenizer.from_pretrained(data / "models" / BASE)
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("model", [BASE, "demo", "other", "demo@1"])
def test_completions_equal_grpc_generate(stack, client, model):
    up, _ = stack
    expected, resolved = grpc_text(up, PROMPT, "" if model == BASE else model)
    reply = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    assert reply.choices[0].text == expected and reply.choices[0].finish_reason == "length"
    assert reply.model == model and reply.object == "text_completion"
    assert reply.usage.completion_tokens == 8 and reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 8
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(client.completions.create(model=model, prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    # the same prompt again: the prefix cache serves it (keyed by the adapter), and usage says so
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    if model != BASE:
        assert resolved.startswith(model.partition("@")[0] + "@")


def test_adapters_change_the_text(stack, client):
    texts = {m: client.completions.create(model=m, prompt=PROMPT, **GREEDY).choices[0].text for m in (BASE, "demo", "other")}
    assert len(set(texts.values())) == 3


@pytest.mark.parametrize("model", [BASE, "demo"])
def test_chat_equals_grpc_generate_on_the_templated_prompt(stack, client, model):
    up, data = stack
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    expected, _ = grpc_text(up, chat_prompt_ids(data, messages), "" if model == BASE else model)
    reply = client.chat.completions.create(model=model, messages=messages, **GREEDY)
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content == expected
    assert reply.object == "chat.completion" and reply.usage.prompt_tokens == len(chat_prompt_ids(data, messages))
    chunks = list(client.chat.completions.create(model=model, messages=messages, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None
    with_usage = list(client.chat.completions.create(model=model, messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in with_usage if c.choices) == expected
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == 8
    assert with_usage[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same conversation again


def test_stop_strings_end_the_text(stack, client):
    full = client.completions.create(model="demo", prompt=PROMPT, **GREEDY).choices[0].text
    stop = full[3:5]
    assert stop.strip(), full
    reply = client.completions.create(model="demo", prompt=PROMPT, stop=[stop], **GREEDY)
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].text == full[: full.index(stop)]


def test_sampling_fields_reach_the_sampler(client):
    greedy = client.completions.create(model="demo", prompt=PROMPT, **GREEDY).choices[0].text
    top1 = client.completions.create(model="demo", prompt=PROMPT, temperature=1.0, max_tokens=8, extra_body={"top_k": 1, "ignore_eos": True})
    assert top1.choices[0].text == greedy  # vLLM's top_k: only the argmax is left to sample
    seeded = [
        client.completions.create(model="demo", prompt=PROMPT, temperature=1.5, seed=7, max_tokens=8, extra_body={"ignore_eos": True}).choices[0].text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1] != greedy


def test_models_list_the_base_model_and_every_adapter(client):
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {BASE, "demo", "other"}
    assert models["demo"].parent == BASE and models["other"].parent == BASE
    assert models[BASE].parent is None


def test_errors_are_openai_errors(client):
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="demo@9", messages=[{"role": "user", "content": "hi"}], stream=True)
    with pytest.raises(openai.BadRequestError, match="n: only 1"):
        client.completions.create(model="demo", prompt=PROMPT, n=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="demo", prompt=PROMPT, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}], top_p=0)
    with pytest.raises(openai.BadRequestError, match="roles are"):
        client.chat.completions.create(model=BASE, messages=[{"role": "tool", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="prompt"):
        client.completions.create(model=BASE, prompt="")
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        client.completions.create(model=BASE, prompt=PROMPT, extra_body={"stop_token_ids": ["x"]})
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=100_000)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="demo", prompt=PROMPT, logprobs=2)


def test_concurrent_streams_with_mixed_adapters(stack, client):
    expected = {m: client.completions.create(model=m, prompt=PROMPT, **GREEDY).choices[0].text for m in (BASE, "demo", "other")}
    models = [BASE, "demo", "other"] * 4
    results: dict[int, str] = {}

    def stream(i: int, model: str) -> None:
        chunks = client.completions.create(model=model, prompt=PROMPT, stream=True, **GREEDY)
        results[i] = "".join(c.choices[0].text for c in chunks)

    threads = [threading.Thread(target=stream, args=(i, m)) for i, m in enumerate(models)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {i: expected[m] for i, m in enumerate(models)}


def test_a_running_adapter_request_is_listed_in_lora_requests_info(stack, client):
    up, _ = stack
    stream = client.completions.create(model="other", prompt=PROMPT, stream=True, max_tokens=400, extra_body={"ignore_eos": True})
    try:
        chunks = iter(stream)
        next(chunks)  # the request runs now; the gauges are sampled after each step, so read on
        for _ in range(400):  # until a sample saw it (each chunk is one more step), not by time
            info = parse_lora_info(urllib.request.urlopen(f"http://{up.addresses['http']}/metrics", timeout=30).read().decode())
            if info and "other" in info["running"]:
                break
            next(chunks)
        assert "other" in info["running"] and info["max_lora"] == 8
    finally:
        stream.close()  # the client goes away mid-stream


def curl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("curl") or "curl", "-sS", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_against_the_same_endpoints(stack):
    up, _ = stack
    base = f"http://{up.addresses['http']}"
    body = json.dumps({"model": "demo", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    reply = json.loads(curl(f"{base}/v1/completions", "-H", "Content-Type: application/json", "-d", body).stdout)
    assert reply["choices"][0]["text"] == grpc_text(up, PROMPT, "demo")[0]
    streamed = curl("-N", f"{base}/v1/completions", "-H", "Content-Type: application/json", "-d", json.dumps({**json.loads(body), "stream": True})).stdout
    events = [line.removeprefix("data: ") for line in streamed.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == reply["choices"][0]["text"]
    assert "text/event-stream" in curl("-i", "-N", f"{base}/v1/completions", "-d", json.dumps({**json.loads(body), "stream": True})).stdout
    models = json.loads(curl(f"{base}/v1/models").stdout)
    assert {m["id"] for m in models["data"]} == {BASE, "demo", "other"}
    missing = curl("-o", "/dev/null", "-w", "%{http_code}", f"{base}/v1/completions", "-d", json.dumps({"model": "nope", "prompt": "x"}))
    assert missing.stdout == "404"
    bad = curl("-w", "\n%{http_code}", f"{base}/v1/chat/completions", "-d", "{not json")
    assert bad.stdout.splitlines()[-1] == "400" and json.loads(bad.stdout.splitlines()[0])["error"]["type"] == "invalid_request_error"
    assert curl("-o", "/dev/null", "-w", "%{http_code}", f"{base}/health").stdout == "200"
    assert "vllm:num_requests_waiting" in curl(f"{base}/metrics").stdout
    loaded = curl("-w", "\n%{http_code}", f"{base}/v1/load_lora_adapter", "-d", json.dumps({"lora_name": "demo", "lora_path": "demo@1"}))
    assert loaded.stdout.endswith("\n200") and "demo@1" in loaded.stdout
    unloaded = curl("-w", "\n%{http_code}", f"{base}/v1/unload_lora_adapter", "-d", json.dumps({"lora_name": "demo"}))
    assert unloaded.stdout.endswith("\n200")
    unknown = curl("-o", "/dev/null", "-w", "%{http_code}", f"{base}/v1/load_lora_adapter", "-d", json.dumps({"lora_name": "nope"}))
    assert unknown.stdout == "404"
    elsewhere = curl("-w", "\n%{http_code}", f"{base}/v1/load_lora_adapter", "-d", json.dumps({"lora_name": "demo", "lora_path": "/tmp/x"}))
    assert elsewhere.stdout.endswith("\n400") and "loramux adapters register" in elsewhere.stdout
