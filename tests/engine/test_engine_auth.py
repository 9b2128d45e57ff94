"""The engine with authentication on, linked to a registry with --auth (SQLite and PostgreSQL): keys
checked through the registry and remembered for at most the cache bound (revocation measured on an
injected clock), tenants' private adapters NOT_FOUND to others over gRPC and HTTP, residency RPCs for
admins only, the refused key audited by the registry."""

from __future__ import annotations

import aiohttp
import grpc
import pytest

from engine.auth import KeyChecker
from engine.config import EngineConfig
from engine.server import start_engine
from loramux.engine_client import generate_request
from loramux.security import auth_metadata
from loramux.v1 import engine_pb2 as epb
from loramux.v1 import engine_pb2_grpc as epb_grpc
from loramux.v1 import registry_pb2 as rpb
from tests.engine.test_registry_link import PROMPT
from tests.registry.harness import BACKENDS, registry_on_backend

CACHE_S = 5.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=BACKENDS)
async def secured(request, tmp_path, tiny_llama_dir, make_adapter):
    """(registry as admin, engine, engine stub, keys by name, clock); team-a owns a private and a public adapter."""
    async with registry_on_backend(request, tmp_path / "registry", tiny_llama_dir, auth=True) as registry:
        keys = {}
        for name, tenant, role in (
            ("engine", "ops", "engine"), ("pub_a", "team-a", "publisher"), ("user_a", "team-a", "user"),
            ("user_b", "team-b", "user"),
        ):
            created = await registry.stub.CreateKey(rpb.CreateKeyRequest(tenant=tenant, role=role), metadata=registry.metadata)
            keys[name] = created.secret
        keys["admin"] = registry.metadata[0][1].removeprefix("Bearer ")
        pub_a = registry.as_key(keys["pub_a"])
        await pub_a.register("private-a", make_adapter("eauth-1", r=4, lora_alpha=8, seed=101))
        await pub_a.register("public-a", make_adapter("eauth-2", r=4, lora_alpha=8, seed=102), public=True)
        config = EngineConfig(
            model_dir=str(tiny_llama_dir), port=0, registry=registry.server.address, base_model_name="tiny",
            max_loras_per_batch=2, auth=True, api_key=keys["engine"], key_cache_s=CACHE_S,
        )
        engine = await start_engine(config)
        clock = FakeClock()
        engine.admission.auth = KeyChecker(engine.core.link.check_key, CACHE_S, clock=clock)
        channel = grpc.aio.insecure_channel(engine.address)
        try:
            yield registry, engine, epb_grpc.EngineStub(channel), keys, clock
        finally:
            await channel.close()
            await engine.stop(grace=0.5)


async def generate(stub, key: str, adapter: str = ""):
    request = generate_request(PROMPT, adapter=adapter, max_new_tokens=4, ignore_eos=True)
    done = None
    async for response in stub.Generate(request, metadata=auth_metadata(key), timeout=60):
        if response.WhichOneof("event") == "complete":
            done = response.complete
    return done


async def expect(code: grpc.StatusCode, awaitable) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await awaitable
    assert info.value.code() == code, info.value.details()
    return info.value.details()


async def test_keys_tenants_and_admin_only_rpcs(secured):
    registry, engine, stub, keys, _ = secured
    await expect(grpc.StatusCode.UNAUTHENTICATED, generate(stub, ""))
    await expect(grpc.StatusCode.UNAUTHENTICATED, generate(stub, keys["user_a"][:-1] + "x"))
    audit = await registry.stub.ListAudit(rpb.ListAuditRequest(), metadata=registry.metadata)
    assert any(e.action == "authenticate" and e.outcome == "UNAUTHENTICATED" and e.target.startswith("engine") for e in audit.entries)
    # base model for everyone; a tenant's private adapter for that tenant only; public ones for all
    assert (await generate(stub, keys["user_b"])).adapter == ""
    assert (await generate(stub, keys["user_a"], "private-a")).adapter == "private-a@1"
    assert (await generate(stub, keys["user_b"], "public-a")).adapter == "public-a@1"
    # the key's tenant travels with the request to the scheduler's fair share
    assert {"team-a", "team-b"} <= set(engine.core.loop.scheduler.fair_share.counters)
    hidden = await expect(grpc.StatusCode.NOT_FOUND, generate(stub, keys["user_b"], "private-a"))
    absent = await expect(grpc.StatusCode.NOT_FOUND, generate(stub, keys["user_b"], "no-such"))
    assert hidden.replace("private-a", "X") == absent.replace("no-such", "X")  # names do not leak
    # residency on the engine is the operator's
    for key in (keys["user_a"], keys["pub_a"]):
        md = auth_metadata(key)
        await expect(grpc.StatusCode.PERMISSION_DENIED, stub.LoadAdapter(epb.LoadAdapterRequest(adapter="public-a", pin=True), metadata=md))
        await expect(grpc.StatusCode.PERMISSION_DENIED, stub.UnloadAdapter(epb.UnloadAdapterRequest(adapter="public-a"), metadata=md))
        await expect(grpc.StatusCode.PERMISSION_DENIED, stub.ListAdapters(epb.ListLoadedRequest(), metadata=md))
    assert not any(s.pinned for s in (await stub.ListAdapters(epb.ListLoadedRequest(), metadata=auth_metadata(keys["admin"]))).adapters)
    state = await stub.LoadAdapter(epb.LoadAdapterRequest(adapter="private-a", pin=True), metadata=auth_metadata(keys["admin"]))
    assert state.pinned


async def test_revocation_takes_effect_within_the_cache_bound(secured):
    registry, engine, stub, keys, clock = secured
    checker = engine.admission.auth
    await generate(stub, keys["user_a"])
    await generate(stub, keys["user_a"])
    assert checker.num_checks == 1  # remembered
    key_id = keys["user_a"].split("_")[1]
    await registry.stub.RevokeKey(rpb.RevokeKeyRequest(key_id=key_id), metadata=registry.metadata)
    clock.now += CACHE_S - 0.5
    await generate(stub, keys["user_a"])  # inside the bound the remembered answer stands
    clock.now += 0.5
    await expect(grpc.StatusCode.UNAUTHENTICATED, generate(stub, keys["user_a"]))  # at the bound it is gone
    assert checker.num_checks == 2
    # a refused key is remembered too: a flood of it costs one registry call per bound
    for _ in range(3):
        await expect(grpc.StatusCode.UNAUTHENTICATED, generate(stub, keys["user_a"]))
    assert checker.num_checks == 2


async def test_http_front_checks_keys_and_visibility(secured):
    _registry, engine, _stub, keys, _ = secured
    port = await engine.start_http(0)
    base = f"http://127.0.0.1:{port}"

    def headers(key: str) -> dict:
        return {"Authorization": f"Bearer {key}"} if key else {}

    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/health") as r:
            assert r.status == 200  # health stays open
        for key in ("", "lmx_000000000000_" + "A" * 43):
            async with http.post(f"{base}/v1/completions", json=body, headers=headers(key)) as r:
                assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
        async with http.post(f"{base}/v1/completions", json=body, headers=headers(keys["user_b"])) as r:
            assert r.status == 200
        async with http.post(f"{base}/v1/completions", json={**body, "model": "private-a"}, headers=headers(keys["user_b"])) as r:
            assert r.status == 404
        async with http.get(f"{base}/v1/models", headers=headers(keys["user_b"])) as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["tiny", "public-a"]
        async with http.get(f"{base}/v1/models", headers=headers(keys["user_a"])) as r:
            assert sorted(m["id"] for m in (await r.json())["data"]) == ["private-a", "public-a", "tiny"]
        async with http.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "public-a"}, headers=headers(keys["pub_a"])) as r:
            assert r.status == 403
        async with http.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "public-a"}, headers=headers(keys["admin"])) as r:
            assert r.status == 200


async def test_engine_without_auth_refuses_a_public_address(tiny_llama_dir):
    from engine.core import EngineCore
    from engine.server import EngineServer

    config = EngineConfig(model_dir=str(tiny_llama_dir), port=0, host="0.0.0.0")
    with pytest.raises(ValueError, match="--auth"):
        EngineServer(config, EngineCore.build(config))


async def test_a_hidden_adapter_of_another_base_model_is_not_found_before_its_base_model_is_named(secured, tiny_llama_dir, make_adapter):
    """Visibility first: tenant B learns nothing (not even that it exists, nor its base model) of
    tenant A's private adapter made for a base model this engine does not serve; A learns why."""
    registry, _engine, stub, keys, _ = secured
    await registry.register_base("tiny-twin", tiny_llama_dir)  # same shape, another base model name
    pub_a = registry.as_key(keys["pub_a"])
    await pub_a.register("elsewhere-a", make_adapter("eauth-3", r=4, lora_alpha=8, seed=103), base_model="tiny-twin")
    hidden = await expect(grpc.StatusCode.NOT_FOUND, generate(stub, keys["user_b"], "elsewhere-a"))
    absent = await expect(grpc.StatusCode.NOT_FOUND, generate(stub, keys["user_b"], "no-such"))
    assert hidden.replace("elsewhere-a", "X") == absent.replace("no-such", "X") and "tiny-twin" not in hidden
    owner = await expect(grpc.StatusCode.FAILED_PRECONDITION, generate(stub, keys["user_a"], "elsewhere-a"))
    assert "'tiny-twin'" in owner and "'tiny'" in owner
    admin = auth_metadata(keys["admin"])  # the residency RPCs check the base model too
    await expect(grpc.StatusCode.FAILED_PRECONDITION, stub.LoadAdapter(epb.LoadAdapterRequest(adapter="elsewhere-a"), metadata=admin))
