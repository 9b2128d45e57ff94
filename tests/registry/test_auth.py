"""Keys, tenants, roles, visibility and audit in the registry (DESIGN section 12), on SQLite + a local
dir and on PostgreSQL + S3: every refusal with its code, nothing changed by a refusal, and an audit row
for each change and each refusal."""

from __future__ import annotations

import asyncio
import os
import stat

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from loramux.security import auth_metadata
from loramux.v1 import registry_pb2 as pb
from registry.db import ApiKeyRow
from tests.registry.harness import BACKENDS, registry_on_backend
from tests.registry.test_registry_grpc import expect_status

NF, PD, UA = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(params=BACKENDS)
async def registry(request, tmp_path, tiny_llama_dir):
    async with registry_on_backend(request, tmp_path / "data", tiny_llama_dir, auth=True) as harness:
        yield harness


async def new_key(registry, tenant: str, role: str) -> str:
    created = await registry.stub.CreateKey(pb.CreateKeyRequest(tenant=tenant, role=role), metadata=registry.metadata)
    assert created.key.tenant == tenant and created.key.role == role
    return created.secret


@pytest.fixture
def adapter_dir(make_adapter):
    return make_adapter("auth-qv", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=71)


@pytest.fixture
def other_adapter_dir(make_adapter):
    return make_adapter("auth-qv2", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=72)


async def audit(registry, limit: int = 1000) -> list[pb.AuditEntry]:
    response = await registry.stub.ListAudit(pb.ListAuditRequest(limit=limit), metadata=registry.metadata)
    return list(response.entries)


async def test_admin_key_file_and_keys_stored_as_hashes_only(registry):
    key_file = registry.server.config.resolved_admin_key_file
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    secret = await new_key(registry, "acme", "user")
    listed = await registry.stub.ListKeys(pb.ListKeysRequest(), metadata=registry.metadata)
    assert {k.tenant for k in listed.keys} == {"admin", "acme"}
    assert all(secret not in str(k) for k in listed.keys)
    with Session(registry.service.catalog.engine) as s:
        stored = " ".join(" ".join(map(str, (r.key_id, r.secret_sha256, r.tenant, r.role))) for r in s.scalars(select(ApiKeyRow)))
    assert secret.split("_", 2)[2] not in stored and secret not in stored  # only a hash of the secret is kept


async def test_missing_bad_and_revoked_keys_are_unauthenticated(registry, adapter_dir):
    user = await new_key(registry, "acme", "user")
    anonymous, forged = registry.as_key(""), registry.as_key(user[:-4] + "AAAA")
    before = len(await audit(registry))
    for harness in (anonymous, forged, registry.as_key("not a key at all")):
        await expect_status(UA, harness.list_all())
        await expect_status(UA, harness.register("nope", adapter_dir))
        await expect_status(UA, harness.stub.GetAdapter(pb.GetAdapterRequest(name="x"), metadata=harness.metadata))
        await expect_status(UA, harness.stub.ListKeys(pb.ListKeysRequest(), metadata=harness.metadata))
        await expect_status(UA, harness.stub.ListBaseModels(pb.ListBaseModelsRequest(), metadata=harness.metadata))
    refusals = (await audit(registry))[: len(await audit(registry)) - before]
    assert len([e for e in refusals if e.action == "authenticate" and e.outcome == "UNAUTHENTICATED"]) == 15
    assert any(e.key_id == user.split("_")[1] for e in refusals)  # the forged key's claimed id is kept
    # health and reflection stay open
    health = health_pb2_grpc.HealthStub(registry.channel)
    assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
    # a revoked key is refused at once by the registry
    as_user = registry.as_key(user)
    await as_user.list_all()
    key_id = user.split("_")[1]
    await registry.stub.RevokeKey(pb.RevokeKeyRequest(key_id=key_id), metadata=registry.metadata)
    await expect_status(UA, as_user.list_all())


async def test_tenants_roles_and_visibility(registry, adapter_dir, other_adapter_dir, tiny_llama_dir):
    pub_a = registry.as_key(await new_key(registry, "team-a", "publisher"))
    user_a = registry.as_key(await new_key(registry, "team-a", "user"))
    pub_b = registry.as_key(await new_key(registry, "team-b", "publisher"))
    user_b = registry.as_key(await new_key(registry, "team-b", "user"))
    secret = await pub_a.register("secret", adapter_dir)
    shared = await pub_a.register("shared", adapter_dir, public=True)
    assert (secret.tenant, secret.public, shared.tenant, shared.public) == ("team-a", False, "team-a", True)
    snapshot = [(a.name, a.version, a.pinned, a.digest) for a in await registry.list_all()]

    # another tenant: the private adapter does not exist for it, the public one cannot be changed
    for caller in (user_b, pub_b):
        assert [a.name for a in await caller.list_all()] == ["shared"]
        for call in (
            caller.stub.GetAdapter(pb.GetAdapterRequest(name="secret"), metadata=caller.metadata),
            caller.stub.DeleteAdapter(pb.DeleteAdapterRequest(name="secret"), metadata=caller.metadata),
            caller.stub.SetPinned(pb.SetPinnedRequest(name="secret", pinned=True), metadata=caller.metadata),
            caller.fetch("secret"),
        ):
            await expect_status(NF, call, "secret")
        await caller.fetch("shared")
        await expect_status(PD, caller.stub.DeleteAdapter(pb.DeleteAdapterRequest(name="shared"), metadata=caller.metadata))
        await expect_status(PD, caller.stub.SetPinned(pb.SetPinnedRequest(name="shared", pinned=True), metadata=caller.metadata))
        await expect_status(PD, caller.register("shared", other_adapter_dir))
    details = await expect_status(grpc.StatusCode.ALREADY_EXISTS, pub_b.register("secret", other_adapter_dir))
    assert "team-a" not in details
    # its own tenant's user sees both and changes neither; nobody but an admin touches base models and keys
    assert [a.name for a in await user_a.list_all()] == ["secret", "shared"]
    await expect_status(PD, user_a.register("mine", other_adapter_dir))
    await expect_status(PD, user_a.stub.DeleteAdapter(pb.DeleteAdapterRequest(name="secret"), metadata=user_a.metadata))
    for caller in (user_a, pub_a):
        await expect_status(PD, caller.register_base("tiny2", tiny_llama_dir))
        await expect_status(PD, caller.stub.CreateKey(pb.CreateKeyRequest(tenant="x", role="admin"), metadata=caller.metadata))
        await expect_status(PD, caller.stub.ListAudit(pb.ListAuditRequest(), metadata=caller.metadata))
    # nothing any refusal touched changed
    assert [(a.name, a.version, a.pinned, a.digest) for a in await registry.list_all()] == snapshot
    # the owner's publisher changes its adapters; an admin changes anyone's
    assert (await pub_a.register("secret", other_adapter_dir)).version == 2
    await pub_a.stub.SetPinned(pb.SetPinnedRequest(name="secret", pinned=True), metadata=pub_a.metadata)
    await registry.stub.DeleteAdapter(pb.DeleteAdapterRequest(name="shared"), metadata=registry.metadata)
    assert [a.name for a in await user_b.list_all()] == []


async def test_watchers_see_only_what_they_may(registry, adapter_dir, other_adapter_dir):
    pub_a = registry.as_key(await new_key(registry, "team-a", "publisher"))
    user_b = registry.as_key(await new_key(registry, "team-b", "user"))
    stream = user_b.stub.WatchAdapters(pb.WatchAdaptersRequest(), metadata=user_b.metadata)
    await stream.initial_metadata()
    await pub_a.register("hidden", adapter_dir)
    await pub_a.register("open", other_adapter_dir, public=True)
    event = await asyncio.wait_for(anext(aiter(stream)), 10)
    assert event.adapter.name == "open"  # the private registration before it was never sent
    stream.cancel()


async def test_audit_rows_for_every_change_and_refusal(registry, adapter_dir, other_adapter_dir):
    pub = registry.as_key(await new_key(registry, "team-a", "publisher"))
    intruder = registry.as_key(await new_key(registry, "team-b", "publisher"))
    created = await registry.stub.CreateKey(pb.CreateKeyRequest(tenant="team-c", role="user"), metadata=registry.metadata)
    await pub.register("bot", adapter_dir, public=True)
    await pub.stub.SetPinned(pb.SetPinnedRequest(name="bot", pinned=True), metadata=pub.metadata)
    await pub.stub.SetPinned(pb.SetPinnedRequest(name="bot", pinned=False), metadata=pub.metadata)
    await expect_status(PD, intruder.stub.DeleteAdapter(pb.DeleteAdapterRequest(name="bot"), metadata=intruder.metadata))
    await expect_status(PD, intruder.register("bot", other_adapter_dir))
    await pub.stub.DeleteAdapter(pb.DeleteAdapterRequest(name="bot"), metadata=pub.metadata)
    await registry.stub.RevokeKey(pb.RevokeKeyRequest(key_id=created.key.key_id), metadata=registry.metadata)
    rows = [(e.action, e.target, e.outcome, e.tenant) for e in reversed(await audit(registry))]
    pub_id = pub.metadata[0][1].split("_")[1]
    assert ("register", "bot@1", "OK", "team-a") in rows
    assert ("pin", "bot@1", "OK", "team-a") in rows and ("unpin", "bot@1", "OK", "team-a") in rows
    assert ("delete", "bot", "PERMISSION_DENIED", "team-b") in rows
    assert ("register", "bot", "PERMISSION_DENIED", "team-b") in rows
    assert ("delete", "bot@1", "OK", "team-a") in rows
    assert ("key_revoke", created.key.key_id, "OK", "admin") in rows
    assert ("register_base_model", "tiny", "OK", "admin") in rows  # the fixture's, by the first admin
    assert any(a == "key_create" and t.startswith(created.key.key_id) for a, t, _, _ in rows)
    assert any(e.key_id == pub_id for e in await audit(registry) if e.action == "register")
    # the rows of a change share its transaction: one row per committed event, none for refusals
    with Session(registry.service.catalog.engine) as s:
        num_events = s.execute(text("SELECT count(*) FROM adapter_events")).scalar()
    changes = [r for r in rows if r[0] in ("register", "pin", "unpin", "delete") and r[2] == "OK"]
    assert len(changes) == num_events


async def test_unauthenticated_service_refuses_a_public_address(tmp_path):
    from registry.config import RegistryConfig
    from registry.server import RegistryServer

    with pytest.raises(ValueError, match="--auth"):
        RegistryServer(RegistryConfig(data_dir=tmp_path, host="0.0.0.0", port=0))


def test_bearer_metadata_shape():
    assert auth_metadata("k") == (("authorization", "Bearer k"),)
    assert auth_metadata("") == ()


async def test_key_files_are_written_once_or_adopted_from_a_secret(tmp_path):
    from loramux.security import new_key, write_secret_file
    from tests.registry.harness import running_registry

    operator_key = new_key()[0]  # what `loramux keys generate` prints, put in a Secret by an operator
    write_secret_file(tmp_path / "secret" / "admin.key", operator_key)
    config = {"auth": True, "admin_key_file": tmp_path / "secret" / "admin.key", "engine_key_file": tmp_path / "keys" / "engine.key"}
    async with running_registry(tmp_path / "d", **config) as registry:
        assert registry.metadata == auth_metadata(operator_key)  # the adopted key is the admin's
        listed = await registry.stub.ListKeys(pb.ListKeysRequest(), metadata=registry.metadata)
        assert sorted(k.role for k in listed.keys) == ["admin", "engine"]
        engine_key = (tmp_path / "keys" / "engine.key").read_text().strip()
        assert stat.S_IMODE(os.stat(tmp_path / "keys" / "engine.key").st_mode) == 0o600
        check = await registry.stub.CheckKey(pb.CheckKeyRequest(key=operator_key), metadata=auth_metadata(engine_key))
        assert check.valid and check.key.role == "admin"
    async with running_registry(tmp_path / "d", **config) as registry:  # a restart makes no new keys
        listed = await registry.stub.ListKeys(pb.ListKeysRequest(), metadata=registry.metadata)
        assert len(listed.keys) == 2 and (tmp_path / "keys" / "engine.key").read_text().strip() == engine_key
