"""The HTTP front in process: disconnects free the request, the gate and the queue map to 503 and 429,
a model without a chat template gets 400, residency metrics follow the adapters."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import aiohttp
import pytest

from engine.config import EngineConfig
from engine.server import start_engine
from tests.test_model_server_metrics import parse_pod_metrics

LONG = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


@pytest.fixture
async def front(tiny_llama_dir, make_adapter, request):
    adapter = make_adapter("http-qv", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=11)
    overrides = getattr(request, "param", {})
    config = EngineConfig(
        model_dir=str(overrides.pop("model_dir", tiny_llama_dir)), port=0, max_batch_tokens=256,
        adapters=(("qv", str(adapter)),), **overrides,
    )
    server = await start_engine(config)
    await server.start_http(0)
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.http.port}") as session:
        try:
            yield server, session
        finally:
            await server.stop(grace=0.5)


async def _until(condition, timeout: float = 60.0) -> None:
    """Wait for a state the engine reaches on its own thread (no fixed sleeps in assertions)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the engine did not reach the expected state"
        await asyncio.sleep(0.02)


def _held_pages(server) -> int:
    kv = server.core.loop.scheduler.kv
    return kv.allocator.num_used_pages - kv.radix.evictable_size() // kv.allocator.page_size


@pytest.mark.parametrize("model", ["tiny_llama", "qv"])
async def test_a_client_that_disconnects_mid_stream_frees_its_request(front, tiny_llama_dir, model):
    server, session = front
    model = tiny_llama_dir.name if model == "tiny_llama" else model
    response = await session.post("/v1/completions", json={**LONG, "model": model, "stream": True})
    assert response.status == 200
    first = await response.content.readline()
    assert first.startswith(b"data: ")
    await _until(lambda: server.core.loop.num_active == 1 and _held_pages(server) > 0)
    if model == "qv":
        assert any(s.num_users == 1 for s in server.core.lora.slots.slots)
    response.close()  # the client goes away mid-stream
    await _until(lambda: server.core.loop.num_active == 0 and _held_pages(server) == 0)
    if model == "qv":
        assert all(s.num_users == 0 for s in server.core.lora.slots.slots)
    await _until(lambda: 'outcome="CANCELLED"' in _exposition(server))


async def test_a_non_streaming_client_that_gives_up_frees_its_request(front):
    server, session = front
    # 5 ms more a step, so 480 tokens outlast the client's 0.5 s on any machine (the tiny model alone
    # generated them within it on an idle CI machine)
    workers = server.core.loop.workers
    launch = workers.launch
    workers.launch = lambda plan, adapters: time.sleep(0.005) or launch(plan, adapters)
    with pytest.raises(TimeoutError):
        response = await session.post(
            "/v1/completions", json={**LONG, "model": "qv", "max_tokens": 480}, timeout=aiohttp.ClientTimeout(total=0.5)
        )
        # what came back, if the engine was faster than the client's patience (Failed is no TimeoutError)
        pytest.fail(f"the request ended before the client gave up: {response.status} {(await response.text())[:300]}")
    await _until(lambda: 'outcome="CANCELLED"' in _exposition(server))  # cancelled, not run to its end
    await _until(lambda: server.core.loop.num_active == 0 and _held_pages(server) == 0)


@pytest.mark.parametrize("front", [{"max_queued_requests": 1}], indirect=True)
async def test_a_full_queue_is_429(front):
    _, session = front
    running = await session.post("/v1/completions", json={**LONG, "model": "qv", "stream": True})
    await running.content.readline()
    refused = await session.post("/v1/completions", json={**LONG, "model": "qv"})
    body = await refused.json()
    assert refused.status == 429 and body["error"]["type"] == "rate_limit_error" and "queue is full" in body["error"]["message"]
    running.close()


async def test_a_closed_gate_is_503_on_generation_and_health(front, tiny_llama_dir):
    server, session = front
    assert (await session.get("/health")).status == 200
    server.admission.is_open = False
    assert (await session.get("/health")).status == 503
    refused = await session.post("/v1/completions", json={"model": tiny_llama_dir.name, "prompt": "x"})
    assert refused.status == 503 and "starting or shutting down" in (await refused.json())["error"]["message"]
    server.admission.is_open = True


@pytest.fixture
def no_template_dir(tiny_llama_dir, tmp_path):
    model_dir = tmp_path / "no-template"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return model_dir


async def test_chat_on_a_model_without_a_template_is_400(tiny_llama_dir, make_adapter, no_template_dir):
    config = EngineConfig(model_dir=str(no_template_dir), port=0, max_loras_per_batch=0)
    server = await start_engine(config)
    await server.start_http(0)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{server.http.port}") as session:
            chat = await session.post("/v1/chat/completions", json={"model": "no-template", "messages": [{"role": "user", "content": "hi"}]})
            assert chat.status == 400 and "no chat template" in (await chat.json())["error"]["message"]
            plain = await session.post("/v1/completions", json={"model": "no-template", "prompt": "hi", "max_tokens": 2})
            assert plain.status == 200
            load = await session.post("/v1/load_lora_adapter", json={"lora_name": "qv"})
            assert load.status == 400 and "serves no adapters" in (await load.json())["error"]["message"]
    finally:
        await server.stop(grace=0.5)


async def test_residency_and_model_server_metrics_follow_the_adapter(front):
    server, session = front
    done = await session.post("/v1/completions", json={"model": "qv", "prompt": "Hello", "max_tokens": 2})
    assert done.status == 200
    text = await (await session.get("/metrics")).text()
    assert 'loramux_engine_lora_adapter_loaded{adapter="qv",location="gpu"} 1.0' in text
    assert 'loramux_engine_lora_adapter_rank{adapter="qv"} 4.0' in text
    assert 'loramux_engine_lora_load_seconds_count{location="gpu"} 1.0' in text
    allocator = server.core.loop.scheduler.kv.allocator
    assert f'vllm:cache_config_info{{block_size="1",num_gpu_blocks="{allocator.num_usable_pages}"}} 1.0' in text
    running = await session.post("/v1/completions", json={**LONG, "model": "qv", "stream": True})
    await running.content.readline()
    # the gauges are sampled after each step: read them until a step has run with the request in it
    deadline = asyncio.get_running_loop().time() + 60
    while (parsed := parse_pod_metrics(await (await session.get("/metrics")).text()))["running"] != 1:
        assert asyncio.get_running_loop().time() < deadline
    assert parsed["lora"]["running"] == ["qv"] and 0 < parsed["kv_usage"] < 1
    running.close()
    unload = await session.post("/v1/unload_lora_adapter", json={"lora_name": "qv"})
    assert unload.status == 200
    await _until(lambda: 'loramux_engine_lora_adapter_loaded{adapter="qv",location="gpu"} 0.0' in _exposition(server))


def _exposition(server) -> str:
    from prometheus_client import generate_latest

    return generate_latest(server.metrics.registry).decode()
