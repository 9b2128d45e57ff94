"""The Registry service over gRPC, on SQLite + a local dir and on PostgreSQL + S3 (moto) on loopback."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading

import grpc
import pytest
import torch
from safetensors.torch import load_file

from loramux.v1 import registry_pb2 as pb
from tests.registry.harness import BACKENDS, config_json, registry_on_backend, running_registry


@pytest.fixture(params=BACKENDS)
async def registry(request, tmp_path, tiny_llama_dir):
    async with registry_on_backend(request, tmp_path / "data", tiny_llama_dir, max_lora_rank=32) as harness:
        yield harness


@pytest.fixture
def qv_adapter(make_adapter):
    return make_adapter("qv-r8", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])


@pytest.fixture
def mlp_adapter(make_adapter):
    return make_adapter("mlp-r4", r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], seed=1)


async def expect_status(code: grpc.StatusCode, awaitable, *needles: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await awaitable
    assert info.value.code() == code, info.value.details()
    for needle in needles:
        assert needle in info.value.details(), info.value.details()
    return info.value.details()


# ---- base models ---------------------------------------------------------------------------------


async def test_base_model_registration_is_idempotent_for_equal_json(registry, tiny_llama_dir):
    reordered = json.dumps(dict(reversed(list(json.loads(config_json(tiny_llama_dir)).items()))))
    again = await registry.stub.RegisterBaseModel(pb.BaseModel(name="tiny", config_json=reordered))
    assert again.name == "tiny"
    changed = config_json(tiny_llama_dir, num_hidden_layers=3)
    await expect_status(
        grpc.StatusCode.ALREADY_EXISTS, registry.stub.RegisterBaseModel(pb.BaseModel(name="tiny", config_json=changed)), "tiny"
    )


@pytest.mark.parametrize(
    ("config", "code", "needle"),
    [
        ("{not json", grpc.StatusCode.INVALID_ARGUMENT, "config_json"),
        ('{"model_type": "gpt2", "hidden_size": 8}', grpc.StatusCode.FAILED_PRECONDITION, "gpt2"),
        (
            '{"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8}',
            grpc.StatusCode.FAILED_PRECONDITION,
            "architecture Qwen3MoeForCausalLM (model_type 'qwen3_moe') is not supported: mixture-of-experts",
        ),
        (
            '{"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}',
            grpc.StatusCode.FAILED_PRECONDITION,
            "architecture MixtralForCausalLM (model_type 'mixtral') is not supported: mixture-of-experts",
        ),
    ],
)
async def test_bad_base_model_config_is_refused(registry, config, code, needle):
    await expect_status(code, registry.stub.RegisterBaseModel(pb.BaseModel(name="other", config_json=config)), needle)
    models = await registry.stub.ListBaseModels(pb.ListBaseModelsRequest())
    assert [m.name for m in models.base_models] == ["tiny"]


async def test_qwen3_base_model_takes_its_adapters_and_refuses_llama_shaped_ones(tmp_path, make_adapter):
    """The registry validates against the bound base model's architecture spec: a peft adapter of a Qwen3
    checkpoint (head_dim independent of hidden / heads) registers; one made for the tiny Llama does not."""
    from loramux.testing.hf_checkpoints import write_hf_checkpoint
    from loramux.testing.peft_adapters import make_peft_adapter

    qwen3_dir = write_hf_checkpoint(tmp_path / "qwen3", "qwen3", head_dim=32, tie_word_embeddings=True)
    qwen3_adapter = make_peft_adapter(qwen3_dir, tmp_path / "adapter", r=4, target_modules=["q_proj", "o_proj"])
    llama_adapter = make_adapter("qv-r8", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    async with running_registry(tmp_path / "data") as registry:
        await registry.register_base("q3", qwen3_dir)
        adapter = await registry.register("q3-bot", qwen3_adapter)
        assert (adapter.base_model, adapter.rank, list(adapter.target_modules)) == ("q3", 4, ["q_proj", "o_proj"])
        await expect_status(
            grpc.StatusCode.FAILED_PRECONDITION, registry.register("llama-bot", llama_adapter), "q_proj", "shape"
        )
        assert [a.name for a in await registry.list_all()] == ["q3-bot"]


# ---- register, get, fetch ------------------------------------------------------------------------


async def test_register_get_and_fetch_round_trip(registry, qv_adapter):
    adapter = await registry.register("support-bot", qv_adapter, description="d", labels={"team": "a"})
    assert (adapter.name, adapter.version, adapter.base_model) == ("support-bot", 1, "tiny")
    assert (adapter.rank, adapter.alpha, adapter.scaling) == (8, 16.0, 2.0)
    assert list(adapter.target_modules) == ["q_proj", "v_proj"]
    assert adapter.labels == {"team": "a"} and adapter.description == "d"
    got = await registry.stub.GetAdapter(pb.GetAdapterRequest(name="support-bot"))
    assert got == adapter
    fetched, artifact, chunk_sizes = await registry.fetch("support-bot")
    assert fetched == adapter
    assert hashlib.sha256(artifact).hexdigest() == adapter.digest
    assert len(artifact) == adapter.size_bytes and max(chunk_sizes) <= 1 << 20
    assert registry.stored_blobs() == [adapter.digest]


async def test_large_artifact_streams_in_chunks_of_at_most_1_mib(registry, make_adapter):
    big = make_adapter("big-r32", r=32, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    adapter = await registry.register("big", big)
    _, artifact, chunk_sizes = await registry.fetch("big")
    assert hashlib.sha256(artifact).hexdigest() == adapter.digest
    assert all(size <= 1 << 20 for size in chunk_sizes)


@pytest.mark.parametrize("offset", [0, 1, 127, 128, 300, 2**32, 2**64 - 1])
@pytest.mark.parametrize("size", [0, 1, 127, 128, 16384, 1 << 20])
def test_hand_encoded_fetch_chunks_are_protobufs_own_bytes(offset, size):
    """The servicer encodes its data chunks itself (one copy of the data instead of protobuf's
    serializing); the bytes must be protobuf's, so every client (grpcurl included) parses them alike."""
    from registry.servicer import encode_data_chunk

    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    encoded = encode_data_chunk(offset, data)
    assert encoded == pb.AdapterChunk(data=pb.DataChunk(offset=offset, data=data)).SerializeToString()
    parsed = pb.AdapterChunk.FromString(encoded)
    assert parsed.WhichOneof("item") == "data" and (parsed.data.offset, parsed.data.data) == (offset, data)


async def test_reregistering_equal_content_returns_the_same_version(registry, qv_adapter, mlp_adapter):
    first = await registry.register("bot", qv_adapter)
    again = await registry.register("bot", qv_adapter, pinned=True)
    assert again == first
    second = await registry.register("bot", mlp_adapter)
    assert second.version == 2 and second.digest != first.digest
    old, artifact, _ = await registry.fetch("bot", 1)
    assert old.digest == first.digest == hashlib.sha256(artifact).hexdigest()
    latest = await registry.stub.GetAdapter(pb.GetAdapterRequest(name="bot"))
    assert latest.version == 2


async def test_identical_content_under_two_names_shares_one_blob(registry, qv_adapter):
    a = await registry.register("alpha", qv_adapter)
    b = await registry.register("beta", qv_adapter)
    assert a.digest == b.digest
    assert registry.stored_blobs() == [a.digest]


async def test_base_model_resolution(registry, qv_adapter, tiny_llama_dir):
    await expect_status(grpc.StatusCode.NOT_FOUND, registry.register("x", qv_adapter, base_model="nope"), "nope")
    assert (await registry.register("x", qv_adapter, base_model="tiny")).base_model == "tiny"
    await registry.stub.RegisterBaseModel(pb.BaseModel(name="tiny2", config_json=config_json(tiny_llama_dir)))
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, registry.register("y", qv_adapter), "base_model")
    await expect_status(
        grpc.StatusCode.ALREADY_EXISTS, registry.register("x", qv_adapter, base_model="tiny2"), "x"
    )


async def test_no_base_model_registered(tmp_path, qv_adapter):
    async with running_registry(tmp_path / "empty") as harness:
        await expect_status(grpc.StatusCode.INVALID_ARGUMENT, harness.register("x", qv_adapter), "no base model")


# ---- list, delete, pin ---------------------------------------------------------------------------


async def test_list_pages_filters_and_latest(registry, qv_adapter, mlp_adapter):
    for name in ("a_1", "a-2", "ab", "b"):
        await registry.register(name, qv_adapter)
    await registry.register("ab", mlp_adapter)
    seen, token = [], ""
    while True:
        page = await registry.stub.ListAdapters(pb.ListAdaptersRequest(page_size=2, page_token=token))
        assert len(page.adapters) <= 2
        seen += [f"{a.name}@{a.version}" for a in page.adapters]
        token = page.next_page_token
        if not token:
            break
    assert seen == ["a-2@1", "a_1@1", "ab@1", "ab@2", "b@1"]
    prefixed = await registry.list_all(name_prefix="a_")  # '_' is literal, not a LIKE wildcard
    assert [a.name for a in prefixed] == ["a_1"]
    latest = await registry.list_all(latest_only=True)
    assert [f"{a.name}@{a.version}" for a in latest] == ["a-2@1", "a_1@1", "ab@2", "b@1"]
    assert await registry.list_all(base_model="other") == []
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, registry.stub.ListAdapters(pb.ListAdaptersRequest(page_token="zz")), "page_token")
    await expect_status(grpc.StatusCode.INVALID_ARGUMENT, registry.stub.ListAdapters(pb.ListAdaptersRequest(page_size=5000)), "page_size")


async def test_delete_versions_are_never_reused(registry, qv_adapter, mlp_adapter):
    await registry.register("bot", qv_adapter)
    await registry.register("bot", mlp_adapter)
    deleted = await registry.stub.DeleteAdapter(pb.DeleteAdapterRequest(name="bot", version=2))
    assert [a.version for a in deleted.deleted] == [2]
    assert (await registry.stub.GetAdapter(pb.GetAdapterRequest(name="bot"))).version == 1
    await expect_status(grpc.StatusCode.NOT_FOUND, registry.stub.GetAdapter(pb.GetAdapterRequest(name="bot", version=2)), "bot@2")
    assert (await registry.register("bot", mlp_adapter)).version == 3
    deleted = await registry.stub.DeleteAdapter(pb.DeleteAdapterRequest(name="bot"))
    assert [a.version for a in deleted.deleted] == [1, 3]
    await expect_status(grpc.StatusCode.NOT_FOUND, registry.stub.GetAdapter(pb.GetAdapterRequest(name="bot")), "bot")
    await expect_status(grpc.StatusCode.NOT_FOUND, registry.stub.DeleteAdapter(pb.DeleteAdapterRequest(name="bot")), "bot")
    assert (await registry.register("bot", qv_adapter)).version == 4


async def test_pin_and_unpin(registry, qv_adapter):
    await registry.register("bot", qv_adapter)
    pinned = await registry.stub.SetPinned(pb.SetPinnedRequest(name="bot", pinned=True))
    assert pinned.pinned and (await registry.stub.GetAdapter(pb.GetAdapterRequest(name="bot"))).pinned
    unpinned = await registry.stub.SetPinned(pb.SetPinnedRequest(name="bot", version=1, pinned=False))
    assert not unpinned.pinned
    await expect_status(grpc.StatusCode.NOT_FOUND, registry.stub.SetPinned(pb.SetPinnedRequest(name="nope", pinned=True)), "nope")


async def test_watch_streams_every_change_in_order(registry, qv_adapter):
    stream = registry.stub.WatchAdapters(pb.WatchAdaptersRequest(base_model="tiny"))
    events = []

    async def collect():
        async for event in stream:
            events.append(event)
            if len(events) == 4:
                return

    # The watch starts after the latest event at the time it opens; its headers say it is in place.
    await asyncio.wait_for(stream.initial_metadata(), 10)
    task = asyncio.create_task(collect())
    await registry.register("bot", qv_adapter)
    await registry.stub.SetPinned(pb.SetPinnedRequest(name="bot", pinned=True))
    await registry.stub.SetPinned(pb.SetPinnedRequest(name="bot", pinned=False))
    await registry.stub.DeleteAdapter(pb.DeleteAdapterRequest(name="bot"))
    await asyncio.wait_for(task, 10)
    stream.cancel()
    kinds = [pb.AdapterEvent.Kind.Name(e.kind) for e in events]
    assert kinds == ["REGISTERED", "PINNED", "UNPINNED", "DELETED"]
    assert all(e.adapter.name == "bot" and e.adapter.version == 1 for e in events)
    ids = [e.event_id for e in events]
    assert ids == sorted(ids) and len(set(ids)) == 4
    replay = registry.stub.WatchAdapters(pb.WatchAdaptersRequest(after_event_id=ids[1]))
    resumed = [await anext(aiter(replay)), await anext(aiter(replay))]
    replay.cancel()
    assert [e.event_id for e in resumed] == ids[2:]


# ---- server-side imports -------------------------------------------------------------------------


async def test_import_from_allow_listed_dir_only(tmp_path, tiny_llama_dir, qv_adapter):
    async with running_registry(tmp_path / "d", import_allow_dirs=(qv_adapter.parent.resolve(),)) as harness:
        await harness.register_base("tiny", tiny_llama_dir)
        adapter = await harness.register("imported", source_uri=f"file://{qv_adapter.resolve()}")
        assert adapter.rank == 8
        await expect_status(grpc.StatusCode.NOT_FOUND, harness.register("evil", source_uri=str(tmp_path)), "not an allowed import source")
        await expect_status(
            grpc.StatusCode.INVALID_ARGUMENT,
            harness.register_files("both", {"adapter_config.json": b"{}"}, source_uri=str(qv_adapter)),
            "source_uri",
        )


async def test_import_from_s3(tmp_path, tiny_llama_dir, qv_adapter, s3_endpoint, s3_bucket):
    from registry.store import make_s3_client

    client = make_s3_client(s3_endpoint)
    for path in qv_adapter.iterdir():
        client.put_object(Bucket=s3_bucket, Key=f"adapters/qv/{path.name}", Body=path.read_bytes())
    async with running_registry(tmp_path / "d", import_s3_endpoint_url=s3_endpoint) as harness:
        await harness.register_base("tiny", tiny_llama_dir)
        adapter = await harness.register("from-s3", source_uri=f"s3://{s3_bucket}/adapters/qv")
        direct = await harness.register("direct", qv_adapter)
        assert adapter.digest == direct.digest
        await expect_status(grpc.StatusCode.NOT_FOUND, harness.register("none", source_uri=f"s3://{s3_bucket}/missing"), "adapter_config.json")


# ---- concurrency ---------------------------------------------------------------------------------


async def test_concurrent_registrations_of_one_name_get_consecutive_versions(registry, make_adapter):
    dirs = [make_adapter(f"concurrent-{i}", r=4, lora_alpha=8, seed=100 + i) for i in range(6)]
    results = await asyncio.gather(*(registry.register("race", d) for d in dirs))
    assert sorted(a.version for a in results) == [1, 2, 3, 4, 5, 6]
    assert len({a.digest for a in results}) == 6
    listed = await registry.list_all(name_prefix="race")
    assert sorted((a.version, a.digest) for a in listed) == sorted((a.version, a.digest) for a in results)


async def test_concurrent_identical_registrations_make_one_version(registry, qv_adapter):
    results = await asyncio.gather(*(registry.register("same", qv_adapter) for _ in range(5)))
    assert {a.version for a in results} == {1}
    assert len(await registry.list_all(name_prefix="same")) == 1


# ---- garbage collection --------------------------------------------------------------------------


async def test_gc_removes_only_old_unreferenced_blobs(registry, qv_adapter, mlp_adapter):
    kept = await registry.register("kept", qv_adapter)
    gone = await registry.register("gone", mlp_adapter)
    await registry.stub.DeleteAdapter(pb.DeleteAdapterRequest(name="gone"))
    young = registry.service.collect_garbage(grace_s=3600)
    assert young.removed == () and young.kept_young == 1
    dry = registry.service.collect_garbage(grace_s=0, dry_run=True)
    assert [b.digest for b in dry.removed] == [gone.digest]
    assert registry.stored_blobs() == sorted([kept.digest, gone.digest])
    result = registry.service.collect_garbage(grace_s=0)
    assert [b.digest for b in result.removed] == [gone.digest]
    assert registry.stored_blobs() == [kept.digest]
    _, artifact, _ = await registry.fetch("kept")
    assert hashlib.sha256(artifact).hexdigest() == kept.digest


def tensors_of(adapter_dir) -> dict[str, torch.Tensor]:
    return load_file(str(adapter_dir / "adapter_model.safetensors"))


@pytest.mark.parametrize("auth", [False, True])
async def test_a_fetch_streams_while_the_default_thread_pool_is_busy(tmp_path, tiny_llama_dir, qv_adapter, auth):
    """FetchAdapter looks its caller and row up and reads its chunks on a pool of its own: with every
    thread of the event loop's default pool busy (other RPCs' SQL: an engine resolving a hundred
    adapters at once), a fetch still streams."""
    async with running_registry(tmp_path / "data", auth=auth) as registry:
        await registry.register_base("tiny", tiny_llama_dir)
        adapter = await registry.register("support-bot", qv_adapter)
        gate = threading.Event()
        loop = asyncio.get_running_loop()
        busy = [loop.run_in_executor(None, gate.wait) for _ in range(64)]  # more than the default pool's threads
        try:
            fetched, artifact, _ = await asyncio.wait_for(registry.fetch("support-bot"), 30)
            assert fetched == adapter and hashlib.sha256(artifact).hexdigest() == adapter.digest
            get = asyncio.ensure_future(registry.stub.GetAdapter(pb.GetAdapterRequest(name="support-bot"), metadata=registry.metadata))
            await asyncio.sleep(0.5)
            assert not get.done()  # the lookups of other RPCs wait for the default pool, as before
        finally:
            gate.set()
            await asyncio.gather(*busy)
        assert await get == adapter
