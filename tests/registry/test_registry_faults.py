"""Faults of the registry's infrastructure, made for real where the machine allows: a full disk (a
small tmpfs), S3 and PostgreSQL cut off (a TCP proxy stopped), crashes (kill -9), shutdown and client
deadlines mid-registration, and clients that hold uploads open. Each ends with a clear status and
nothing leaked, half-written or committed behind the client's back."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loramux.registry_client import upload_requests
from loramux.testing.procs import Service, run_cli
from loramux.v1 import registry_pb2 as pb
from loramux.v1 import registry_pb2_grpc as pb_grpc
from registry.faults import as_status_error
from tests.registry.backends import fresh_postgres_database
from tests.registry.harness import running_registry
from tests.registry.tcp_proxy import TcpProxy

CFG = "adapter_config.json"
WTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def adapter_dir(make_adapter):
    return make_adapter("faults", r=4, lora_alpha=8, target_modules=["q_proj"])


async def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def health_status(channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service="loramux.v1.Registry"))).status


class StalledUpload:
    """A RegisterAdapter stream that sends its spec and one chunk, then waits until released."""

    def __init__(self, stub, name: str):
        self.release = asyncio.Event()
        self.call = stub.RegisterAdapter(self._requests(name))

    async def _requests(self, name: str):
        yield pb.RegisterAdapterRequest(spec=pb.AdapterSpec(name=name))
        yield pb.RegisterAdapterRequest(chunk=pb.FileChunk(filename=WTS, offset=0, data=bytes(1000)))
        await self.release.wait()


# ---- crash leftovers (item 3) ---------------------------------------------------------------


def _stalled_upload_in_thread(address: str, started: threading.Event, release: threading.Event):
    def requests():
        yield pb.RegisterAdapterRequest(spec=pb.AdapterSpec(name="crashed"))
        yield pb.RegisterAdapterRequest(chunk=pb.FileChunk(filename=WTS, offset=0, data=bytes(1 << 20)))
        started.set()
        release.wait(60)

    def run():
        with contextlib.suppress(grpc.RpcError), grpc.insecure_channel(address) as channel:
            pb_grpc.RegistryStub(channel).RegisterAdapter(requests(), timeout=60)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _spooled_files(data: Path) -> list[Path]:
    return [p for p in (data / "spool").rglob("*") if p.is_file() and p.name != ".lock"]


def _crash_during_upload(data: Path) -> None:
    """A real `registry serve` killed with SIGKILL while an upload is spooled."""
    server = Service(["registry", "serve", "--port", "0", "--data-dir", str(data)], "registry")
    started, release = threading.Event(), threading.Event()
    thread = _stalled_upload_in_thread(server.address, started, release)
    try:
        assert started.wait(30)
        deadline = time.monotonic() + 30
        while not _spooled_files(data):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(30)
        release.set()
        thread.join(30)


def test_crash_leftovers_are_reclaimed_by_gc_and_at_start(tmp_path):
    data = tmp_path / "data"
    _crash_during_upload(data)
    objects = data / "objects" / "blobs" / "sha256" / "ab"
    objects.mkdir(parents=True)
    (objects / ".tmp-crashed").write_bytes(bytes(4096))  # a put killed between its write and its link
    assert _spooled_files(data)

    gc = run_cli("registry", "gc", "--data-dir", str(data), "--grace-s", "0").stdout
    assert "reclaimed 1 spool entries" in gc and "1 partial blobs" in gc, gc
    assert _spooled_files(data) == [] and not (objects / ".tmp-crashed").exists()

    _crash_during_upload(data)
    assert _spooled_files(data)
    again = Service(["registry", "serve", "--port", "0", "--data-dir", str(data)], "registry")
    try:
        assert _spooled_files(data) == []  # reclaimed before the ready line
        assert "reclaimed 1 spool entries" in "".join(again.stderr)
    finally:
        assert again.interrupt() == 0


async def test_reclaim_keeps_the_uploads_of_live_registries(tmp_path, adapter_dir):
    data = tmp_path / "data"
    async with running_registry(data) as live, running_registry(data) as other:
        stalled = StalledUpload(live.stub, "held")
        await wait_until(lambda: _has_entries(live))
        leftovers = await asyncio.to_thread(other.service.reclaim_leftovers)
        assert leftovers.spool_entries == 0 and live.service.spool.entries()
        stalled.release.set()
        with pytest.raises(grpc.aio.AioRpcError):
            await stalled.call


async def _has_entries(harness) -> bool:
    return bool(harness.service.spool.entries())


# ---- disk full (items 4 and 5) --------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs: a real ENOSPC. Needs root (mount); skipped elsewhere."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


async def test_disk_full_is_resource_exhausted_and_frees_the_space(small_disk, tmp_path, tiny_llama_dir, adapter_dir):
    db = f"sqlite:///{tmp_path / 'registry.db'}"
    async with running_registry(small_disk, database_url=db, object_store=str(tmp_path / "objects")) as registry:
        await registry.register_base("tiny", tiny_llama_dir)
        free = _free_bytes(small_disk)
        huge = {CFG: (adapter_dir / CFG).read_bytes(), WTS: bytes(4 << 20)}  # more than the disk holds
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await registry.register_files("huge", huge)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        assert "disk is full" in info.value.details()
        assert _free_bytes(small_disk) == free  # every handle closed, every spooled byte removed
        assert registry.service.spool.entries() == []
        adapter = await registry.register("small", adapter_dir)  # the next upload is fine
        assert adapter.version == 1


def test_every_close_runs_when_one_raises(tmp_path, monkeypatch):
    """receive_upload's handles: one close() failing (a flush on a full disk) must not skip the others."""
    from registry.upload import receive_upload

    closed = []

    class FullDiskFile:
        def __init__(self, path, mode):
            self.name = Path(path).name

        def write(self, data):
            return len(data)

        def close(self):
            closed.append(self.name)
            if self.name == CFG:
                raise OSError(28, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

    monkeypatch.setattr(Path, "open", lambda self, mode="r", *a, **k: FullDiskFile(self, mode))

    async def requests():
        yield pb.RegisterAdapterRequest(spec=pb.AdapterSpec(name="x"))
        yield pb.RegisterAdapterRequest(chunk=pb.FileChunk(filename=CFG, offset=0, data=b"{}"))
        yield pb.RegisterAdapterRequest(chunk=pb.FileChunk(filename=WTS, offset=0, data=b"12"))

    with pytest.raises(OSError):
        asyncio.run(receive_upload(requests(), tmp_path, 1 << 20, 60))
    assert sorted(closed) == [CFG, WTS]


# ---- S3 and PostgreSQL cut off (item 5) ------------------------------------------------------


async def test_s3_down_is_unavailable(tmp_path, tiny_llama_dir, adapter_dir, make_adapter, s3_endpoint, s3_bucket):
    host, port = s3_endpoint.removeprefix("http://").split(":")
    proxy = TcpProxy((host, int(port)))
    proxy.start()
    store = f"s3://{s3_bucket}?endpoint_url=http://127.0.0.1:{proxy.port}"
    try:
        async with running_registry(tmp_path / "data", object_store=store) as registry:
            await registry.register_base("tiny", tiny_llama_dir)
            await registry.register("first", adapter_dir)
            proxy.stop()
            other = make_adapter("faults-other", r=4, lora_alpha=8, target_modules=["v_proj"], seed=9)
            for call in (registry.register("second", other), registry.fetch("first")):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
                assert "object store is unavailable" in info.value.details()
                assert len(info.value.details()) < 300
            assert [a.name for a in await registry.list_all()] == ["first"]
    finally:
        proxy.stop()


def test_a_transfer_cut_mid_stream_is_unavailable():
    from botocore.exceptions import ResponseStreamingError
    from urllib3.exceptions import ProtocolError

    cut = ResponseStreamingError(error=ProtocolError("Connection broken: IncompleteRead"))
    assert as_status_error(cut).code.value == "UNAVAILABLE"
    assert as_status_error(ProtocolError("Connection reset by peer")).code.value == "UNAVAILABLE"
    assert as_status_error(ValueError("a bug")) is None


async def test_postgres_down_is_unavailable_and_health_follows_it(tmp_path, tiny_llama_dir):
    with fresh_postgres_database() as db_url:
        proxy = TcpProxy(("127.0.0.1", 5432))
        proxy.start()
        via_proxy = db_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
        try:
            async with running_registry(tmp_path / "data", database_url=via_proxy, health_probe_s=0.1) as registry:
                await registry.register_base("tiny", tiny_llama_dir)
                serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
                assert await health_status(registry.channel) == serving
                proxy.stop()
                for call in (
                    registry.stub.GetAdapter(pb.GetAdapterRequest(name="x")),
                    registry.stub.ListAdapters(pb.ListAdaptersRequest()),
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call
                    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
                    assert "database is unavailable" in info.value.details()
                await wait_until(lambda: _health_is(registry, not_serving))
                proxy.start()  # the same port again
                await wait_until(lambda: _health_is(registry, serving))
                assert list((await registry.stub.ListAdapters(pb.ListAdaptersRequest())).adapters) == []
        finally:
            proxy.stop()


async def _health_is(registry, status) -> bool:
    return await health_status(registry.channel) == status


# ---- uploads held open (item 8) --------------------------------------------------------------


async def test_concurrent_uploads_are_capped_and_idle_ones_dropped(tmp_path, tiny_llama_dir, adapter_dir):
    async with running_registry(
        tmp_path / "data", max_concurrent_uploads=2, upload_idle_timeout_s=1.0
    ) as registry:
        await registry.register_base("tiny", tiny_llama_dir)
        stalled = [StalledUpload(registry.stub, f"stalled-{i}") for i in range(2)]
        await wait_until(lambda: _num_uploads(registry, 2))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await registry.register("third", adapter_dir)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-concurrent-uploads" in info.value.details()
        for upload in stalled:  # dropped by the registry, not by the client
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await upload.call
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "sent nothing" in info.value.details()
            upload.release.set()
        assert registry.service.spool.entries() == []
        assert (await registry.register("after", adapter_dir)).version == 1


async def _num_uploads(registry, n: int) -> bool:
    return registry.server.servicer.registrations.num_uploads == n and len(registry.service.spool.entries()) == n


# ---- deadline and shutdown during a registration (item 9) ------------------------------------


@contextlib.contextmanager
def compile_held(monkeypatch):
    """compile_adapter waits for `release`; `entered` is set once a registration reached it."""
    import registry.service as service_module

    entered, release = threading.Event(), threading.Event()
    real = service_module.compile_adapter

    def held(*args, **kwargs):
        entered.set()
        release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(service_module, "compile_adapter", held)
    try:
        yield entered, release
    finally:
        release.set()


async def test_a_deadline_passed_during_compile_commits_nothing(tmp_path, tiny_llama_dir, adapter_dir, monkeypatch):
    async with running_registry(tmp_path / "data") as registry:
        await registry.register_base("tiny", tiny_llama_dir)
        with compile_held(monkeypatch) as (entered, release):
            spec = pb.AdapterSpec(name="late")
            call = registry.stub.RegisterAdapter(_aiter(upload_requests(spec, _files(adapter_dir))), timeout=1.0)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert entered.is_set()
            release.set()
            await registry.server.servicer.registrations.wait_workers()
        assert await registry.list_all() == []


@pytest.mark.parametrize("is_within_grace", [True, False])
async def test_shutdown_finishes_or_stops_registrations_within_the_grace(
    tmp_path, tiny_llama_dir, adapter_dir, monkeypatch, is_within_grace
):
    """Compile ending inside the grace: the registration completes. Past it: the client hears that it
    failed, stop() returns once the worker stopped at its gate, and nothing was committed."""
    data = tmp_path / "data"
    async with running_registry(data) as registry:
        await registry.register_base("tiny", tiny_llama_dir)
    with compile_held(monkeypatch) as (entered, release):
        async with _registry_stopped_by_hand(data) as (server, stub):
            call = stub.RegisterAdapter(_aiter(upload_requests(pb.AdapterSpec(name="held"), _files(adapter_dir))))
            assert await asyncio.to_thread(entered.wait, 30)
            stopping = asyncio.ensure_future(server.stop(grace=30 if is_within_grace else 0.2))
            if is_within_grace:
                release.set()
                assert (await call).version == 1
            else:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call
                assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
                release.set()
            await stopping
    async with running_registry(data) as registry:
        assert [a.name for a in await registry.list_all()] == (["held"] if is_within_grace else [])


@contextlib.asynccontextmanager
async def _registry_stopped_by_hand(data: Path):
    from registry.config import RegistryConfig
    from registry.server import RegistryServer

    server = RegistryServer(RegistryConfig(data_dir=data, port=0))
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    try:
        yield server, pb_grpc.RegistryStub(channel)
    finally:
        await channel.close()


def _files(adapter_dir: Path) -> list[Path]:
    return [adapter_dir / CFG, adapter_dir / WTS]


async def _aiter(items):
    for item in items:
        yield item
