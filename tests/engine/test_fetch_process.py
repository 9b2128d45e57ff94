"""The engine's fetch process (engine/fetch_process.py) against a live registry: the bytes it maps are
the registry's, chunk for chunk as the event loop's path gets them; the registry's refusals keep their
kinds; a child that dies is replaced and what it had is sent again, once; a cancelled fetch leaves no
descriptor behind; close() ends the child."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest

from engine import fetch_process
from engine.errors import NotFound, Unavailable
from engine.fetch_process import fetch_process_supported
from engine.host_memory import host_memory_bytes
from engine.registry_link import RegistryLink, record_of
from loramux.v1 import registry_pb2 as pb
from loramux.v1 import registry_pb2_grpc as pb_grpc
from tests.registry.harness import running_registry

pytestmark = pytest.mark.skipif(not fetch_process_supported(), reason="the fetch process needs memfd and SCM_RIGHTS (Linux)")

HANG_S = 60.0  # turns a hang into a failure; nothing here is about speed


async def _ignore(kind, record):
    pass


@contextlib.asynccontextmanager
async def link_to(address: str, fetch_process: bool = True):
    link = RegistryLink(address, "tiny", "{}", _ignore, fetch_process=fetch_process)
    try:
        yield link
    finally:
        await link.close()


async def eventually(predicate, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + HANG_S
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.02)


def open_artifact_memfds() -> int:
    """This process's descriptors of the child's artifacts (Python's mmap keeps one per mapping before 3.13)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:loramux-artifact")
    return count


async def test_the_process_maps_the_bytes_the_loop_receives(tmp_path, tiny_llama_dir, make_adapter, monkeypatch):
    """Many chunks (the registry's chunk made small), received in the child into a memfd, mapped here
    writable: the same bytes and sha256 as the event loop's own fetch, and the registry's digest."""
    import registry.service

    monkeypatch.setattr(registry.service, "ARTIFACT_CHUNK_BYTES", 1024)
    async with running_registry(tmp_path / "registry") as registry_harness:
        await registry_harness.register_base("tiny", tiny_llama_dir)
        adapter = await registry_harness.register("many", make_adapter("fp-many", r=8, lora_alpha=16, seed=201))
        assert adapter.size_bytes > 8 * 1024
        record = record_of(adapter)
        async with link_to(registry_harness.server.address) as link, link_to(registry_harness.server.address, False) as loop_link:
            assert link.process is not None and loop_link.process is None
            data = await link.fetch(record)
            expected = await loop_link.fetch(record)
            assert bytes(data) == bytes(expected) and len(data) == adapter.size_bytes
            assert isinstance(data.obj, mmap.mmap) and not data.readonly  # the child's pages, no copy
            child = link.process.pid
            assert child is not None and child != os.getpid()
            assert link.num_fetches == 1 and link.process.num_starts == 1


async def test_refusals_keep_their_kind_and_the_child_lives_on(tmp_path, tiny_llama_dir, make_adapter):
    async with running_registry(tmp_path / "registry") as registry_harness:
        await registry_harness.register_base("tiny", tiny_llama_dir)
        adapter = await registry_harness.register("there", make_adapter("fp-there", r=4, lora_alpha=8, seed=202))
        async with link_to(registry_harness.server.address) as link:
            missing = record_of(pb.Adapter(name="missing", version=1, digest="0" * 64, base_model="tiny"))
            with pytest.raises(NotFound, match="'missing@1' is not registered"):
                await link.fetch(missing)
            assert len(await link.fetch(record_of(adapter))) == adapter.size_bytes
            assert link.process.num_starts == 1
    async with link_to("127.0.0.1:1") as link:  # nothing listens there
        with pytest.raises(Unavailable, match="the registry is unavailable"):
            await link.process.fetch("there", 1, "there@1")


async def test_a_child_that_dies_fails_its_fetches_and_the_next_fetch_starts_another(tmp_path, tiny_llama_dir, make_adapter):
    """A fetch held by a peer that accepts the connection and never answers is in flight in the child
    when the child is killed: it is sent to a new child; killed again, it fails UNAVAILABLE (not a
    hang); the next fetch, from a real registry, starts a new child."""
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        async with link_to(f"127.0.0.1:{silent.getsockname()[1]}") as link:
            held = asyncio.create_task(link.process.fetch("held", 1, "held@1"))
            await eventually(lambda: link.process.pid is not None, "the child started")
            await asyncio.sleep(0.5)
            assert not held.done()
            os.kill(link.process.pid, signal.SIGKILL)
            await eventually(lambda: link.process.num_starts == 2 and link.process.num_pending == 1, "sent to a new child")
            await eventually(lambda: link.process.pid is not None, "the second child started")
            await asyncio.sleep(0.2)
            assert not held.done()
            os.kill(link.process.pid, signal.SIGKILL)
            with pytest.raises(Unavailable, match=r"fetch process (ended|exited)"):
                await asyncio.wait_for(held, HANG_S)
            await eventually(lambda: link.process.pid is None, "the child's end was seen")
    finally:
        silent.close()
    async with running_registry(tmp_path / "registry") as registry_harness:
        await registry_harness.register_base("tiny", tiny_llama_dir)
        adapter = await registry_harness.register("after", make_adapter("fp-after", r=4, lora_alpha=8, seed=203))
        async with link_to(registry_harness.server.address) as link:
            link.process.start()
            os.kill(link.process.pid, signal.SIGKILL)
            await eventually(lambda: link.process.pid is None, "the child's end was seen")
            data = await link.fetch(record_of(adapter))
            assert len(data) == adapter.size_bytes and link.process.num_starts == 2


async def test_fetches_waiting_in_a_child_that_dies_go_to_the_next():
    """max_concurrent 1: one fetch running, two waiting for its turn; the child is killed: all three
    are sent to a new child, which runs them in their order, and each gets its artifact."""
    async with gated_registry() as (registry, address):
        process = fetch_process.FetchProcess(address, max_concurrent=1)
        try:
            tasks = await _send_in_order(process, ["x", "y", "z"])
            await eventually(lambda: registry.started == ["x"], "the first fetch started")
            os.kill(process.pid, signal.SIGKILL)
            await eventually(lambda: registry.started == ["x", "x"], "the running fetch was sent again")
            assert process.num_starts == 2 and not any(task.done() for task in tasks.values())
            for name in "xyz":
                registry.gate(name).set()
            for name in "xyz":
                assert bytes((await asyncio.wait_for(tasks[name], HANG_S)).data) == registry.artifact(name)
            assert registry.started == ["x", "x", "y", "z"]
        finally:
            await process.close()


async def test_a_cancelled_fetch_leaves_no_descriptor(tmp_path, tiny_llama_dir, make_adapter):
    """Fetches cancelled right after they were sent: the child is told (it drops them, or its answer
    crossed the cancel and the memfd is closed on arrival); no descriptor is left behind."""
    async with running_registry(tmp_path / "registry") as registry_harness:
        await registry_harness.register_base("tiny", tiny_llama_dir)
        adapter = await registry_harness.register("gone", make_adapter("fp-gone", r=4, lora_alpha=8, seed=204))
        async with link_to(registry_harness.server.address) as link:
            before = open_artifact_memfds()  # earlier tests' mappings the collector has not reached
            data = await link.fetch(record_of(adapter))
            mapped = open_artifact_memfds()
            assert mapped == before + (1 if sys.version_info < (3, 13) else 0)  # the mapping's own, if any
            for _ in range(5):
                task = asyncio.create_task(link.process.fetch("gone", adapter.version, "gone@1"))
                await asyncio.sleep(0)  # sent
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert link.process.num_cancels + link.process.num_unclaimed >= 5  # an answer may cross its cancel
            fetched = await link.process.fetch("gone", adapter.version, "gone@1")  # after the cancels, in order
            del fetched
            await asyncio.sleep(0.5)  # a straggling answer of a cancelled fetch would have come by now
            assert open_artifact_memfds() == mapped and link.process.num_pending == 0
            del data  # the last view of the mapping: unmapped, its descriptor closed
            assert open_artifact_memfds() == before


async def test_an_answer_nobody_waits_for_has_its_descriptor_closed():
    """An answer that crossed its fetch's cancel (or names no fetch) is counted and its memfd closed."""
    process = fetch_process.FetchProcess("127.0.0.1:1")
    before = open_artifact_memfds()
    fd = os.memfd_create("loramux-artifact", os.MFD_CLOEXEC)
    process._answered(json.dumps({"id": 41, "size": 0, "sha256": "", "started": 0.0}).encode(), fd)
    assert process.num_unclaimed == 1 and open_artifact_memfds() == before
    with pytest.raises(OSError):
        os.fstat(fd)


async def test_close_ends_the_child_and_later_fetches_are_refused(tmp_path, tiny_llama_dir):
    async with running_registry(tmp_path / "registry") as registry_harness:
        link = RegistryLink(registry_harness.server.address, "tiny", "{}", _ignore)
        link.process.start()
        proc = link.process._proc
        await link.close()
        assert proc.poll() is not None  # exited (it saw the socket close), and reaped
        with pytest.raises(Unavailable, match="stopping"):
            await link.process.fetch("any", 1, "any@1")


def test_the_child_imports_no_torch():
    """The child is a small interpreter: no torch, no model code."""
    code = "import sys, engine.fetch_process; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=HANG_S)


def test_the_fetch_process_runs_on_linux():
    """On Linux the engine fetches through the child: a check that wrongly failed would only fall back."""
    assert fetch_process_supported() == sys.platform.startswith("linux")


class _Stream:
    """FetchAdapter's messages in wire format, as a channel's unparsed method would yield them."""

    def __init__(self, messages: list[bytes]):
        self.messages = messages

    def __call__(self, request, timeout, metadata):
        return self._each()

    async def _each(self):
        for raw in self.messages:
            yield raw


def _adapter_message(size: int) -> bytes:
    return pb.AdapterChunk(adapter=pb.Adapter(name="a", version=1, size_bytes=size)).SerializeToString()


PAYLOAD = bytes(range(256)) * 40  # 10240 bytes


def _chunks(data: bytes, size: int = 4096) -> list[bytes]:
    from registry.servicer import encode_data_chunk

    return [encode_data_chunk(offset, data[offset : offset + size]) for offset in range(0, len(data), size)]


@pytest.mark.parametrize(
    "messages, received",
    [
        pytest.param([_adapter_message(len(PAYLOAD)), *_chunks(PAYLOAD)], PAYLOAD, id="declared"),
        pytest.param(_chunks(PAYLOAD), PAYLOAD, id="undeclared: copied into a memfd at the end"),
        pytest.param([_adapter_message(len(PAYLOAD)), *_chunks(PAYLOAD)[:-1]], PAYLOAD[:8192], id="short of its declared size"),
        pytest.param([_adapter_message(len(PAYLOAD))], b"", id="declared, nothing sent: no descriptor"),
    ],
)
async def test_the_childs_answer_maps_to_exactly_the_bytes_received(messages, received):
    """The child's side (`_fetch_one`) over a socket pair, the engine's mapping of its answer: the
    bytes received, whatever the stream declared, and the sha256 of those bytes."""

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        before = time.perf_counter()
        await fetch_process._fetch_one(theirs, _Stream(messages), (), {"id": 7, "name": "a", "version": 1, "ref": "a@1"}, host_memory_bytes(), asyncio.Semaphore(1))
        message, fds, _, _ = socket.recv_fds(ours, 1 << 16, 1)
    reply = json.loads(message)
    assert before <= reply.pop("started") <= time.perf_counter()
    assert reply == {"id": 7, "size": len(received), "sha256": hashlib.sha256(received).hexdigest()}
    assert len(fds) == (1 if received else 0)
    data = fetch_process._mapped(fds[0] if fds else None, reply["size"])
    assert bytes(data) == received and not data.readonly


@pytest.mark.parametrize(
    "messages, error",
    [
        pytest.param([_adapter_message(100), *_chunks(PAYLOAD)], "bytes of an artifact of 100", id="overrun"),
        pytest.param([_adapter_message(2**62), *_chunks(PAYLOAD)], "a declared size of 4611686018427387904 bytes", id="huge"),
    ],
)
async def test_the_child_answers_a_malformed_stream_with_unavailable(messages, error):
    before = open_artifact_memfds()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        await fetch_process._fetch_one(theirs, _Stream(messages), (), {"id": 3, "name": "a", "version": 1, "ref": "a@1"}, host_memory_bytes(), asyncio.Semaphore(1))
        message, fds, _, _ = socket.recv_fds(ours, 1 << 16, 1)
    reply = json.loads(message)
    assert reply["id"] == 3 and reply["error"] == "UNAVAILABLE" and fds == []
    assert "malformed chunk" in reply["message"] and error in reply["message"]
    assert open_artifact_memfds() == before  # the child's memfd for the refused artifact was closed


async def test_close_fails_the_fetches_in_flight():
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        link = RegistryLink(f"127.0.0.1:{silent.getsockname()[1]}", "tiny", "{}", _ignore)
        held = [asyncio.create_task(link.process.fetch(f"held{i}", 1, f"held{i}@1")) for i in range(3)]
        await asyncio.sleep(0.5)
        assert not any(task.done() for task in held)
        await asyncio.wait_for(link.close(), HANG_S)
        for task in held:
            with pytest.raises(Unavailable, match="fetch process"):
                await asyncio.wait_for(task, HANG_S)
    finally:
        silent.close()


async def test_a_fetch_right_after_the_child_died_starts_another(tmp_path, tiny_llama_dir, make_adapter):
    """The child is dead (reaped) before its reader thread's news reaches the loop: the fetch replaces it."""
    async with running_registry(tmp_path / "registry") as registry_harness:
        await registry_harness.register_base("tiny", tiny_llama_dir)
        adapter = await registry_harness.register("next", make_adapter("fp-next", r=4, lora_alpha=8, seed=205))
        async with link_to(registry_harness.server.address) as link:
            link.process.start()
            proc = link.process._proc
            proc.kill()
            proc.wait()  # on the loop's thread: the reader's news cannot have been handled yet
            data = await link.fetch(record_of(adapter))
            assert len(data) == adapter.size_bytes and link.process.num_starts == 2


class _GatedRegistry(pb_grpc.RegistryServicer):
    """A registry whose FetchAdapter waits for the test's gate of each name: it records which fetches
    started and which were cancelled while it held them; each artifact is its name, repeated."""

    def __init__(self):
        self.peers: dict[str, str] = {}  # name -> the connection it came on (one a fetch process)
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}

    @staticmethod
    def artifact(name: str) -> bytes:
        return name.encode() * 1000

    def gate(self, name: str) -> asyncio.Event:
        return self.gates.setdefault(name, asyncio.Event())

    async def FetchAdapter(self, request, context):
        self.peers[request.name] = context.peer()
        self.started.append(request.name)
        try:
            await self.gate(request.name).wait()
        except asyncio.CancelledError:
            self.cancelled.append(request.name)
            raise
        data = self.artifact(request.name)
        yield pb.AdapterChunk(adapter=pb.Adapter(name=request.name, version=1, size_bytes=len(data)))
        yield pb.AdapterChunk(data=pb.DataChunk(offset=0, data=data))


@contextlib.asynccontextmanager
async def gated_registry():
    server = grpc.aio.server()
    registry = _GatedRegistry()
    pb_grpc.add_RegistryServicer_to_server(registry, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield registry, f"127.0.0.1:{port}"
    finally:
        for gate in registry.gates.values():
            gate.set()
        await server.stop(0)


async def _send_in_order(process: fetch_process.FetchProcess, names: list[str]) -> dict[str, asyncio.Task]:
    tasks = {}
    for name in names:
        tasks[name] = asyncio.create_task(process.fetch(name, 1, f"{name}@1"))
        await eventually(lambda: process.num_pending == len(tasks), f"{name} sent")
    return tasks


async def test_the_child_runs_its_turns_in_order_and_starts_the_next_itself():
    """max_concurrent 2: of four fetches sent at once the child starts two; each one that ends starts the
    longest-waiting one; every answer is its artifact, started after it was asked for."""
    async with gated_registry() as (registry, address):
        process = fetch_process.FetchProcess(address, max_concurrent=2)
        try:
            asked = time.perf_counter()
            tasks = await _send_in_order(process, ["a", "b", "c", "d"])
            await eventually(lambda: len(registry.started) == 2, "two fetches started")
            await asyncio.sleep(0.3)  # time for a third to start, were there no cap
            assert sorted(registry.started) == ["a", "b"] and process.num_pending == 4  # the two race to the registry
            registry.gate("b").set()
            fetched_b = await asyncio.wait_for(tasks["b"], HANG_S)
            await eventually(lambda: len(registry.started) == 3, "the third fetch started")
            assert registry.started[2] == "c"
            for name in "acd":
                registry.gate(name).set()
            fetched = {"b": fetched_b, **{name: await asyncio.wait_for(tasks[name], HANG_S) for name in "acd"}}
            for name, got in fetched.items():
                assert bytes(got.data) == registry.artifact(name)
                assert got.sha256 == hashlib.sha256(registry.artifact(name)).hexdigest()
                assert asked <= got.started <= time.perf_counter()
            assert registry.started[2:] == ["c", "d"] and process.num_pending == 0
            assert fetched["c"].started > fetched["a"].started and fetched["d"].started >= fetched["c"].started
        finally:
            await process.close()


async def test_a_cancelled_fetch_frees_its_turn_or_never_starts():
    """max_concurrent 1: cancelling the running fetch stops it at the registry and the queued one
    starts; a queued fetch cancelled before its turn never reaches the registry; no answer and no
    descriptor comes back for either."""
    async with gated_registry() as (registry, address):
        process = fetch_process.FetchProcess(address, max_concurrent=1)
        try:
            before = open_artifact_memfds()
            tasks = await _send_in_order(process, ["run", "queued", "dropped", "last"])
            await eventually(lambda: registry.started == ["run"], "the first fetch started")
            tasks["dropped"].cancel()
            tasks["run"].cancel()
            for name in ("run", "dropped"):
                with pytest.raises(asyncio.CancelledError):
                    await tasks[name]
            await eventually(lambda: registry.started == ["run", "queued"], "the queued fetch started")
            await eventually(lambda: registry.cancelled == ["run"], "the running fetch was stopped")
            registry.gate("queued").set()
            registry.gate("last").set()
            assert bytes((await asyncio.wait_for(tasks["queued"], HANG_S)).data) == registry.artifact("queued")
            assert bytes((await asyncio.wait_for(tasks["last"], HANG_S)).data) == registry.artifact("last")
            assert registry.started == ["run", "queued", "last"]  # "dropped" never started
            assert process.num_cancels == 2 and process.num_unclaimed == 0 and process.num_pending == 0
            assert open_artifact_memfds() == before + (2 if sys.version_info < (3, 13) else 0)  # the two mappings' own
        finally:
            await process.close()


def _gated_record(registry: _GatedRegistry, name: str):
    digest = hashlib.sha256(registry.artifact(name)).hexdigest()
    return record_of(pb.Adapter(name=name, version=1, digest=digest, base_model="tiny"))


async def test_the_link_splits_its_turns_between_its_fetch_processes():
    """Three turns over two fetch processes (two and one): of five fetches at once three start, on two
    connections (one a process); the others wait in the process they were sent to, the least busy for its
    share, and start as turns there free; every answer is its artifact."""
    async with gated_registry() as (registry, address):
        link = RegistryLink(address, "tiny", "{}", _ignore, max_concurrent_fetches=3, fetch_processes=2)
        try:
            assert [p.max_concurrent for p in link.processes] == [2, 1] and link.process is link.processes[0]
            names = ["a", "b", "c", "d", "e"]  # sent in this order: a, c, d to the first process; b, e to the second
            tasks = {name: asyncio.create_task(link.fetch(_gated_record(registry, name))) for name in names}
            await eventually(lambda: link.num_fetches_in_flight == 5, "every fetch sent")
            await eventually(lambda: len(registry.started) == 3, "three fetches started")
            await asyncio.sleep(0.3)  # time for a fourth to start, were there no cap
            assert sorted(registry.started) == ["a", "b", "c"]
            assert [p.num_pending for p in link.processes] == [3, 2]
            assert registry.peers["a"] == registry.peers["c"] != registry.peers["b"]
            registry.gate("b").set()
            assert bytes(await asyncio.wait_for(tasks["b"], HANG_S)) == registry.artifact("b")
            await eventually(lambda: len(registry.started) == 4, "the second process's next fetch started")
            assert registry.started[3] == "e" and registry.peers["e"] == registry.peers["b"]
            registry.gate("a").set()
            await eventually(lambda: len(registry.started) == 5, "the first process's next fetch started")
            assert registry.started[4] == "d" and registry.peers["d"] == registry.peers["a"]
            for name in names:
                registry.gate(name).set()
            for name in names:
                assert bytes(await asyncio.wait_for(tasks[name], HANG_S)) == registry.artifact(name)
            pids = [p.pid for p in link.processes]
            assert None not in pids and len(set(pids)) == 2 and link.num_fetches_in_flight == 0
        finally:
            await link.close()
        assert all(p._proc.poll() is not None for p in link.processes)  # close() ended both


async def test_the_link_starts_no_more_fetch_processes_than_turns():
    async with gated_registry() as (_, address):
        link = RegistryLink(address, "tiny", "{}", _ignore, max_concurrent_fetches=2, fetch_processes=5)
        try:
            assert [p.max_concurrent for p in link.processes] == [1, 1]
            with pytest.raises(ValueError, match="fetch_processes"):
                RegistryLink(address, "tiny", "{}", _ignore, fetch_processes=0)
        finally:
            await link.close()


def test_the_fetch_process_refuses_no_turns():
    with pytest.raises(ValueError, match="max_concurrent"):
        fetch_process.FetchProcess("127.0.0.1:1", max_concurrent=0)


async def test_a_fetch_cancelled_mid_copy_frees_its_memfd_only_after_the_copy():
    """The child's fetch is cancelled while a chunk's copy runs on its worker thread: the memfd is
    closed only once that copy has ended (closing it under the thread could send its write to a
    descriptor number reused meanwhile)."""
    events, writing = [], asyncio.Event()
    loop = asyncio.get_running_loop()

    class SlowArtifact(fetch_process._MemfdArtifact):
        def _write(self, offset, data):
            loop.call_soon_threadsafe(writing.set)
            time.sleep(0.3)
            super()._write(offset, data)
            events.append("copied")

        def release(self):
            events.append("released")
            super().release()

    messages = [_adapter_message(len(PAYLOAD)), *_chunks(PAYLOAD)]
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs, pytest.MonkeyPatch.context() as patch:
        patch.setattr(fetch_process, "_MemfdArtifact", SlowArtifact)
        task = asyncio.create_task(
            fetch_process._fetch_one(theirs, _Stream(messages), (), {"id": 5, "name": "a", "version": 1, "ref": "a@1"}, host_memory_bytes(), asyncio.Semaphore(1))
        )
        await asyncio.wait_for(writing.wait(), HANG_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert events == ["copied", "released"]
        ours.setblocking(False)
        with pytest.raises(BlockingIOError):
            ours.recv(1 << 16)  # a cancelled fetch is not answered
