"""Registry fetches in a process of their own, so that an artifact's chunks never wait for the engine's GIL.

In the engine's process every FetchAdapter chunk needs the GIL several times (gRPC's completion, the
event loop, the hash-and-copy thread), and the engine's step thread holds it most of the time: on the
H200 host four fetches at once went about 930 MB/s alone and 80 MB/s beside a thread running Python, and
the cold Zipf pass of benchmarks/serve.py waited a median 1.1 s for its fetches. Here a child process
(`python -m engine.fetch_process`, which imports neither torch nor the model code) runs its own gRPC
channel to the registry and receives each artifact into a memfd; the engine gets the descriptor over a
Unix socket (SCM_RIGHTS) and maps the same pages, so the bytes are neither copied nor sent twice.

The engine sends each fetch as soon as it is asked for; the child runs at most `max_concurrent` at once
and starts the longest-waiting one the moment another ends, so the next transfer never waits for the
engine's event loop (which waits for the engine's GIL) to hand out the turn. The engine keeps the rest:
sharing one fetch between the callers of a digest, the sha256 check against the registry's digest (the
child reports what it hashed) and its retries. A child that dies is replaced, and each fetch it had
(running or waiting for a turn) is sent to the new one, once; a second loss fails it UNAVAILABLE. The
child ends when the engine's end of the socket closes, the engine's death included. The engine may run
several of them (RegistryLink's `fetch_processes`), each with its share of the turns.

Protocol, one datagram each way (SOCK_SEQPACKET keeps them whole): first the engine's configuration
`{"address", "tls", "api_key", "max_concurrent"}`, then requests `{"id", "name", "version", "ref"}` and
`{"cancel": id}` (a fetch cancelled on the engine's side, which the link's shared fetches are only at the
engine's stop: dropped if it has not started, stopped if it has, and not answered); each answer is `{"id", "size", "sha256", "started"}` with the memfd attached (none for
an empty artifact) or `{"id", "error", "message"}` with `error` NOT_FOUND or UNAVAILABLE. `started` is
when the transfer began, on time.perf_counter's clock, which is CLOCK_MONOTONIC and so the same in
both processes on Linux.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from engine.artifact_stream import Artifact, artifact_messages, receive_artifact
from engine.errors import NotFound, Unavailable
from engine.host_memory import host_memory_bytes
from loramux.heap import keep_freed_chunks
from loramux.security import TlsFiles, auth_metadata, open_channel
from loramux.v1 import registry_pb2 as pb

log = logging.getLogger(__name__)

FETCH_METHOD = "/loramux.v1.Registry/FetchAdapter"
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 8 << 20),
    # come back quickly after a registry restart (gRPC's default backoff grows to 120 s)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
_DATAGRAM = 1 << 16  # the largest message either side sends (names are far shorter)
_ROOT = Path(__file__).resolve().parents[1]  # holds the engine, loramux and loraformat packages
_STOP_S = 5.0  # how long close() waits for the child before killing it
_UNTRACKED = {"trackfd": False} if sys.version_info >= (3, 13) else {}  # no duplicate descriptor per mapping


@dataclass(frozen=True)
class Fetched:
    """An artifact the child received: its bytes (writable, mapped from the child's memfd), their
    sha256, and when the child began the transfer (time.perf_counter)."""

    data: memoryview
    sha256: str
    started: float


class _ChildLost(Unavailable):
    """The child went before it answered (or before the request reached it): the fetch may be sent again."""


def fetch_process_supported() -> bool:
    """memfd and descriptor passing: Linux."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


class FetchProcess:
    """The engine's side: starts the child, sends it fetches, maps the artifacts it answers with."""

    def __init__(self, address: str, api_key: str = "", tls: TlsFiles | None = None, max_concurrent: int = 4):
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.max_concurrent = max_concurrent
        self._config = {
            "address": address, "api_key": api_key, "tls": dataclasses.asdict(tls) if tls is not None else None,
            "max_concurrent": max_concurrent,
        }  # fmt: skip
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen | None = None
        self._pending: dict[int, asyncio.Future] = {}  # request id -> (answer, descriptor or None)
        self._ids = itertools.count(1)
        self._closed = False
        self.num_starts = 0
        self.num_unclaimed = 0  # answers whose caller had gone (cancelled): their memfds closed unmapped
        self.num_cancels = 0  # cancels sent for fetches whose caller went before the answer

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._sock is not None and self._proc is not None else None

    def start(self) -> None:
        """Start the child unless it runs; returns at once (its interpreter starts in the background).
        A child that has exited is replaced here, even before its reader thread has said so."""
        if self._sock is not None and self._proc is not None and self._proc.poll() is not None:
            self._lost(self._sock)
        if self._sock is not None:
            return
        if self._closed:
            raise Unavailable("the engine is stopping: adapters are no longer fetched")
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(_ROOT), os.environ.get("PYTHONPATH")))))
        proc = None
        try:
            # -P: nothing in the engine's working directory shadows the child's modules
            proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "engine.fetch_process", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
            )  # fmt: skip
            ours.send(json.dumps(self._config).encode())  # the key travels here, not in argv or the environment
        except OSError as exc:
            ours.close()
            if proc is not None:
                proc.kill()
                proc.wait()
            raise Unavailable(f"the adapter fetch process does not start: {exc}") from None
        finally:
            theirs.close()
        self._sock, self._proc = ours, proc
        self.num_starts += 1
        threading.Thread(target=self._read_answers, args=(ours, loop), name="loramux-fetch-answers", daemon=True).start()

    @property
    def num_pending(self) -> int:
        """Fetches sent and not yet answered: running in the child or waiting there for a turn."""
        return len(self._pending)

    async def fetch(self, name: str, version: int, ref: str) -> Fetched:
        """The artifact of name@version; the child runs it when one of its turns is free. A child that
        is gone at the send, or dies before answering, is replaced and the fetch sent again, once:
        every fetch waiting in a child that dies would otherwise fail with it."""
        for attempt in (1, 2):
            try:
                return await self._fetch_once(name, version, ref)
            except _ChildLost as exc:
                if attempt == 2 or self._closed:
                    raise Unavailable(f"adapter {ref!r}: {exc}") from None
                log.warning("adapter %s: %s; sending it to a new fetch process", ref, exc)
        raise AssertionError("unreachable")

    async def _fetch_once(self, name: str, version: int, ref: str) -> Fetched:
        key = next(self._ids)
        request = json.dumps({"id": key, "name": name, "version": version, "ref": ref}).encode()
        answer = asyncio.get_running_loop().create_future()
        self.start()
        sock = self._sock
        self._pending[key] = answer
        try:
            await _send(sock, request)
        except OSError as exc:
            self._pending.pop(key, None)
            if sock is self._sock:
                self._lost(sock)
            raise _ChildLost(f"the fetch process is gone ({exc})") from None
        except BaseException:  # cancelled while the socket's buffer was full: nothing was sent
            self._pending.pop(key, None)
            raise
        try:
            reply, fd = await answer
        except asyncio.CancelledError:
            if answer.done() and not answer.cancelled() and answer.exception() is None:
                self.num_unclaimed += 1
                _close(answer.result()[1])  # answered as this caller was cancelled: nobody maps it
            elif sock is self._sock:  # the child still has it: its turn goes to the next fetch
                with contextlib.suppress(OSError):  # a child that is gone has dropped it anyway
                    sock.send(json.dumps({"cancel": key}).encode(), socket.MSG_DONTWAIT)
                    self.num_cancels += 1
            raise
        finally:
            self._pending.pop(key, None)
        if "error" in reply:
            _close(fd)
            raise (NotFound if reply["error"] == "NOT_FOUND" else Unavailable)(reply["message"])
        try:
            return Fetched(_mapped(fd, reply["size"]), reply["sha256"], reply["started"])
        except (OSError, ValueError) as exc:  # a size past the memfd's end, no memory to map it
            raise Unavailable(f"adapter {ref!r}: the fetched artifact cannot be mapped ({exc})") from None

    async def close(self) -> None:
        """Stop the child: it sees the socket close and exits; killed if it has not within a few seconds."""
        self._closed = True
        sock, proc = self._sock, self._proc
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # the reader thread sees the end too, and fails what is pending
        if proc is not None and proc.poll() is None:
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), _STOP_S)
            except TimeoutError:
                proc.kill()
                await asyncio.to_thread(proc.wait)

    def _read_answers(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        """The reader thread of one child: hands each answer to the loop; at the end, fails what is left.
        With the loop gone, it closes the socket, so the child ends too."""
        try:
            while True:
                message, fds, _, _ = socket.recv_fds(sock, _DATAGRAM, 1)
                if not message:
                    for fd in fds:
                        os.close(fd)
                    break
                try:
                    loop.call_soon_threadsafe(self._answered, message, fds[0] if fds else None)
                except RuntimeError:  # the loop is closed: nobody will map it
                    for fd in fds:
                        os.close(fd)
                    sock.close()
                    return
        except OSError:
            pass
        try:
            loop.call_soon_threadsafe(self._lost, sock)
        except RuntimeError:
            sock.close()

    def _answered(self, message: bytes, fd: int | None) -> None:
        try:
            reply = json.loads(message)
            answer = self._pending.pop(reply["id"], None)
        except (ValueError, KeyError, TypeError):
            log.error("the adapter fetch process sent an answer that does not parse: %r", message[:200])
            _close(fd)
            return
        if answer is None or answer.done():  # its caller was cancelled
            self.num_unclaimed += 1
            _close(fd)
            return
        answer.set_result((reply, fd))

    def _lost(self, sock: socket.socket) -> None:
        """The child's socket ended (it exited, or close() shut the socket): what it had fails."""
        if self._sock is not sock:
            return
        proc = self._proc
        code = proc.poll() if proc is not None else None
        ended = "ended" if code is None else f"exited (code {code})"
        self._sock = None
        sock.close()
        if not self._closed:
            log.warning("the adapter fetch process %s; the next fetch starts another", ended)
        pending, self._pending = self._pending, {}
        for answer in pending.values():
            if not answer.done():
                answer.set_exception(_ChildLost(f"the adapter fetch process {ended} during the fetch"))


async def _send(sock: socket.socket, data: bytes) -> None:
    """One datagram, without blocking the event loop when the socket's buffer is full (a child that
    is still starting reads nothing yet); the socket itself stays blocking for its reader thread."""
    while True:
        try:
            sock.send(data, socket.MSG_DONTWAIT)
            return
        except BlockingIOError:
            await asyncio.sleep(0.001)


def _mapped(fd: int | None, size: int) -> memoryview:
    """The memfd's first `size` bytes, writable and shared with the child's pages (no copy). The
    mapping keeps the memory until the view and its readers let go (before Python 3.13 it also keeps a
    duplicate of the descriptor, closed with it)."""
    if fd is None or size == 0:
        _close(fd)
        return memoryview(bytearray(size))  # size 0 (mmap would map the whole memfd)
    try:
        return memoryview(mmap.mmap(fd, size, **_UNTRACKED))  # refuses a size past the memfd's end
    finally:
        os.close(fd)


def _close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


# ---- the child ---------------------------------------------------------------------------------


class _MemfdArtifact(Artifact):
    """An artifact received into a memfd with pwrite: the kernel fills fresh shared pages as it copies,
    where a mapping took a page fault for each (0.74 against 1.45 GB/s for 14 MiB on the 2-core VM)."""

    def __init__(self, host_bytes: int):
        super().__init__()
        self.fd: int | None = None
        self.host_bytes = host_bytes  # what this process may use (0: unknown)

    def _reserve(self, size: int) -> None:
        if self.host_bytes and size > self.host_bytes:  # a memfd's size is only a bound: refuse it as numpy would
            raise MemoryError(f"{size} bytes")
        try:
            self.fd = os.memfd_create("loramux-artifact", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, size)
        except OSError as exc:
            raise MemoryError(str(exc)) from None  # Artifact reports the declared size as more than the host holds

    def _write(self, offset: int, data: memoryview) -> None:
        while data:
            written = os.pwrite(self.fd, data, offset)
            data, offset = data[written:], offset + written

    def descriptor(self) -> int | None:
        """A memfd whose first `received` bytes are the artifact: the one written in place, or a new one
        for a stream that declared no size (its bytes grew in a bytearray); None for no bytes."""
        if not self.received:
            return None
        if self.size is None:
            self._reserve(len(self._grown))
            self._write(0, memoryview(self._grown))
        return self.fd

    def release(self) -> None:
        _close(self.fd)
        self.fd = None


async def _fetch_one(sock: socket.socket, fetch_raw, metadata, request: dict, host_bytes: int, turns: asyncio.Semaphore) -> None:
    """One fetch, once a turn is free (asyncio's semaphore wakes its waiters in order), answered on
    `sock`; a cancelled one (the engine's cancel, or the child's end) is not answered."""
    reply: dict = {"id": request["id"]}
    ref = request["ref"]
    artifact = _MemfdArtifact(host_bytes)
    fd = None
    try:
        try:
            async with turns:
                reply["started"] = time.perf_counter()
                messages = artifact_messages(fetch_raw, request["name"], request["version"], ref, metadata)
                digest = await receive_artifact(messages, artifact, ref)
            fd = artifact.descriptor()
            reply.update(size=artifact.received, sha256=digest)
        except (NotFound, Unavailable) as exc:
            reply.update(error=exc.code.name, message=str(exc))
        except Exception as exc:  # whatever it was, the engine hears of it and the child lives on
            log.exception("fetching %s failed", ref)
            reply.update(error="UNAVAILABLE", message=f"adapter {ref!r}: the fetch failed ({type(exc).__name__}: {exc})")
        try:
            socket.send_fds(sock, [json.dumps(reply).encode()], [fd] if fd is not None else [])
        except (BrokenPipeError, ConnectionResetError):
            pass  # the engine is gone: the reader sees the end and the child exits
        except OSError as exc:  # an answer that cannot be sent: end, so that the engine fails what it waits for
            log.error("an answer for %s cannot be sent (%s); exiting", ref, exc)
            os._exit(1)
    finally:
        artifact.release()


async def _serve(sock: socket.socket, config: dict) -> None:
    loop = asyncio.get_running_loop()
    tls = TlsFiles(**config["tls"]) if config.get("tls") else None
    channel = open_channel(config["address"], tls, CHANNEL_OPTIONS, aio=True)
    fetch_raw = channel.unary_stream(FETCH_METHOD, request_serializer=pb.FetchAdapterRequest.SerializeToString)
    metadata = auth_metadata(config.get("api_key", ""))
    requests: asyncio.Queue[bytes | None] = asyncio.Queue()
    host_bytes = host_memory_bytes()  # once: it bounds every declared size
    turns = asyncio.Semaphore(int(config.get("max_concurrent", 4)))

    def read() -> None:
        with contextlib.suppress(OSError):
            while message := sock.recv(_DATAGRAM):
                loop.call_soon_threadsafe(requests.put_nowait, message)
        loop.call_soon_threadsafe(requests.put_nowait, None)

    threading.Thread(target=read, name="requests", daemon=True).start()
    fetches: dict[int, asyncio.Task] = {}  # request id -> its fetch, until answered or cancelled
    try:
        while (message := await requests.get()) is not None:
            try:
                request = json.loads(message)
                key = request["cancel"] if "cancel" in request else request["id"]
            except (ValueError, KeyError, TypeError):  # only the engine writes here; never end every fetch over it
                log.error("a request that does not parse: %r", message[:200])
                continue
            if "cancel" in request:
                task = fetches.get(key)
                if task is not None:  # else answered already: the engine closes the memfd
                    task.cancel()
                continue
            task = asyncio.create_task(_fetch_one(sock, fetch_raw, metadata, request, host_bytes, turns))
            fetches[key] = task
            task.add_done_callback(lambda _, key=key: fetches.pop(key, None))
    finally:
        for task in list(fetches.values()):
            task.cancel()
        await asyncio.gather(*fetches.values(), return_exceptions=True)
        await channel.close()


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the engine's to handle; it closes the socket
    logging.basicConfig(level=logging.WARNING, format="loramux fetch process: %(levelname)s %(message)s")
    keep_freed_chunks()  # each chunk's message reuses the heap's pages (loramux/heap.py)
    sock = socket.socket(fileno=int(argv[0]))
    message = sock.recv(_DATAGRAM)
    if not message:
        return
    asyncio.run(_serve(sock, json.loads(message)))


if __name__ == "__main__":
    main(sys.argv[1:])
