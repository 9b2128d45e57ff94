"""The engine's link to the registry service (over gRPC, never its database or store).

- registers the engine's base model at start (and again after the registry comes back);
- resolves "name" / "name@N" to (version, digest) by asking the registry at admission (one coalesced
  lookup per name), so a change that returned is seen by the next request; WatchAdapters events
  (resumed from the last event id after a reconnect) keep a fallback cache for when the registry is
  unreachable and drive deletes and pins;
- fetches canonical artifacts with FetchAdapter, checks their sha256 against the digest (a
  mismatch is refused, logged and retried, never served), one fetch per digest at a time.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from engine.adapters import AdapterRecord
from engine.artifact_stream import Artifact, artifact_messages, receive_artifact, unavailable
from engine.coalesce import CoalescedCalls
from engine.errors import EngineError, FailedPrecondition, NotFound, Unavailable
from engine.fetch_process import CHANNEL_OPTIONS, FETCH_METHOD, Fetched, FetchProcess, fetch_process_supported
from loraformat.names import parse_ref
from loramux.security import Principal, Role, TlsFiles, auth_metadata, open_channel
from loramux.v1 import registry_pb2 as pb
from loramux.v1 import registry_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
RPC_TIMEOUT_S = 10.0
RECONNECT_S = (0.2, 5.0)  # first and longest pause between reconnection attempts

MAX_FETCH_TIMINGS = 4096  # the newest fetches RegistryLink.fetch_timings keeps


@dataclass(frozen=True)
class FetchTiming:
    """One checked fetch on time.perf_counter's clock: when the artifact was asked for, when its
    (last) attempt got a fetch turn (in the fetch process, whose clock is the same), when its bytes
    were checked; and their size. benchmarks/serve.py
    reads them: the wait for a turn, each transfer's time, and the rate of all transfers together."""

    asked: float
    started: float
    done: float
    size: int


# (REGISTERED | DELETED | PINNED | UNPINNED, record), awaited in event order
EventHandler = Callable[[str, AdapterRecord], Awaitable[None]]


def record_of(adapter: pb.Adapter) -> AdapterRecord:
    return AdapterRecord(
        adapter.name, adapter.version, adapter.digest, None, adapter.rank, adapter.pinned, adapter.tenant, adapter.public,
        adapter.base_model, tuple(adapter.target_modules),
    )


# Answers to RegisterBaseModel that no retry changes (e.g. the name taken by another config).
_REFUSALS = (
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
)


class RegistryLink:
    def __init__(
        self,
        address: str,
        base_model: str,
        config_json: str,
        on_event: EventHandler,
        api_key: str = "",
        tls: TlsFiles | None = None,
        max_concurrent_fetches: int = 4,
        fetch_process: bool = True,
        fetch_processes: int = 1,
    ):
        if fetch_processes < 1:
            raise ValueError(f"fetch_processes must be >= 1, got {fetch_processes}")
        self.address = address
        self.base_model = base_model
        self.config_json = config_json
        self.on_event = on_event
        self.channel = open_channel(address, tls, CHANNEL_OPTIONS, aio=True)
        self.metadata = auth_metadata(api_key)  # the engine's own key, on every call
        self.stub = pb_grpc.RegistryStub(self.channel)
        # FetchAdapter with its chunks left as wire bytes: `chunk_data` finds the artifact bytes in each
        # as a view, where protobuf's parse and the `.data.data` read copied every MiB twice (0.17 ms a
        # MiB on the 2-core VM, 14 ms of an 84 MB fetch)
        self._fetch_raw = self.channel.unary_stream(FETCH_METHOD, request_serializer=pb.FetchAdapterRequest.SerializeToString)
        # The artifacts' bytes come through a process of its own (engine/fetch_process.py) where the
        # platform allows: here every chunk needed this process's GIL, which the engine's step thread
        # holds most of the time (4 fetches at once went about 930 MB/s alone, 80 beside a busy thread).
        # Several such processes can split the turns (none gets fewer than one): one process's event loop
        # handles every chunk of its fetches. On the H200 host two took 8 fetches at once from 1.43 to
        # 1.64 GB/s (BENCHMARKS.md, 2026-12-03); the cold Zipf pass of serve.py did not change.
        self.processes: tuple[FetchProcess, ...] = ()
        if fetch_process and fetch_process_supported():
            count = min(fetch_processes, max_concurrent_fetches)
            shares = [max_concurrent_fetches // count + (i < max_concurrent_fetches % count) for i in range(count)]
            self.processes = tuple(FetchProcess(address, api_key, tls, share) for share in shares)
        self._resolved: dict[tuple[str, int], AdapterRecord] = {}
        self._generation: dict[str, int] = {}  # bumped by every event of a name (and a fresh watch)
        self._epoch = 0
        self._fetches: dict[str, asyncio.Task[memoryview]] = {}
        # Fetches in flight at most; asyncio's semaphore wakes its waiters in order. Unbounded, a burst of
        # 128 new adapters shared the link's bandwidth and every one of them arrived at the end. The fetch
        # process keeps its own turns (the next transfer starts there without waiting for this loop).
        self._fetch_turns = asyncio.Semaphore(max_concurrent_fetches)
        self._num_loop_fetches = 0  # this loop's fetches that hold a turn
        self._lookups = CoalescedCalls(self._lookup)
        self._pins: dict[str, bool] = {}  # "name@N" -> pinned, as last applied to the engine
        self._watch: asyncio.Task | None = None
        self.last_event_id = 0
        self.is_connected = False
        self.num_fetches = 0
        self.fetch_timings: collections.deque[FetchTiming] = collections.deque(maxlen=MAX_FETCH_TIMINGS)  # newest last
        self.num_lookups = 0
        self.num_digest_mismatches = 0

    async def start(self) -> None:
        """Try to register the base model now; keep trying (and watching) in the background."""
        for process in self.processes:
            process.start()  # its interpreter starts while the base model registers
        try:
            await self._register_base_model()
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _REFUSALS:  # retrying cannot help: say so once and stop
                raise FailedPrecondition(
                    f"the registry at {self.address} refuses base model {self.base_model!r}: {exc.details()}"
                    " (start the engine with another --base-model-name)"
                ) from None
            log.warning("registry %s: %s; serving cached adapters until it answers", self.address, exc.details())
        self._watch = asyncio.create_task(self._watch_forever())

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await asyncio.gather(*(process.close() for process in self.processes))
        await self.channel.close()

    # ---- resolution --------------------------------------------------------------------------

    async def resolve(self, ref: str) -> AdapterRecord:
        """The registry's answer for `ref` now: "name" is the latest version committed before this
        call, and a deleted version is NotFound (read-after-write). Concurrent callers for one ref
        share one lookup. Only while the registry is unreachable does the watch-fed cache answer."""
        name, version = parse_ref(ref)
        try:
            record = await self._lookups.get((name, version))
        except EngineError as exc:
            cached = self._resolved.get((name, version))
            if not isinstance(exc, Unavailable) or cached is None:
                raise
            return cached
        await self._apply_pin_state(record)
        return record

    async def _lookup(self, key: tuple[str, int]) -> AdapterRecord:
        name, version = key
        ref = f"{name}@{version}" if version else name
        seen = (self._epoch, self._generation.get(name, 0))
        self.num_lookups += 1
        try:
            adapter = await self.stub.GetAdapter(
                pb.GetAdapterRequest(name=name, version=version), timeout=RPC_TIMEOUT_S, metadata=self.metadata
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                self._forget(name, version)
                raise NotFound(f"adapter {ref!r} is not registered") from None
            raise unavailable(f"adapter {ref!r}", exc) from None
        # Any base model: the engine's key sees every adapter, so whether the caller may see this one
        # (NOT_FOUND otherwise) is admission's to say before it names the adapter's base model.
        record = record_of(adapter)
        if seen == (self._epoch, self._generation.get(name, 0)):  # no event for it arrived meanwhile
            self._resolved[key] = self._resolved[(name, record.version)] = record
        return record

    def _forget(self, name: str, version: int) -> None:
        """The registry says `name` (every version) or `name@version` is gone: no fallback answer may
        serve it later, under any cached key (a "name" lookup caches both (name, 0) and (name, N))."""
        for key, record in list(self._resolved.items()):
            if key[0] == name and (version == 0 or record.version == version):
                del self._resolved[key]

    async def list_latest(self) -> list[AdapterRecord]:
        """The latest version of every adapter of this engine's base model, by name."""
        records, token = [], ""
        while True:
            request = pb.ListAdaptersRequest(base_model=self.base_model, latest_only=True, page_size=1000, page_token=token)
            try:
                page = await self.stub.ListAdapters(request, timeout=RPC_TIMEOUT_S, metadata=self.metadata)
            except grpc.aio.AioRpcError as exc:
                raise unavailable("adapters", exc) from None
            records += [record_of(a) for a in page.adapters]
            token = page.next_page_token
            if not token:
                return sorted(records, key=lambda r: r.name)

    async def _apply_pin_state(self, record: AdapterRecord) -> None:
        """A pin or unpin the lookup shows before its event arrived is applied now, before admission."""
        known = self._pins.get(record.ref)
        if known == record.pinned or (known is None and not record.pinned):
            return
        self._pins[record.ref] = record.pinned
        await self._handle("PINNED" if record.pinned else "UNPINNED", record)

    async def check_key(self, key: str) -> Principal | None:
        """Who holds a client's key, as the registry says; None for a key it refuses."""
        try:
            answer = await self.stub.CheckKey(pb.CheckKeyRequest(key=key), timeout=RPC_TIMEOUT_S, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise unavailable("checking the API key", exc) from None
        if not answer.valid:
            return None
        return Principal(answer.key.key_id, answer.key.tenant, Role(answer.key.role))

    # ---- fetching ----------------------------------------------------------------------------

    async def fetch(self, record: AdapterRecord, attempts: int = 3) -> memoryview:
        """The artifact's bytes, sha256-checked, in a writable buffer; concurrent callers for one digest
        share one fetch, and so one buffer: read it, never write it (the safetensors reader's tensors
        are views of it)."""
        task = self._fetches.get(record.digest)
        if task is None:
            task = asyncio.create_task(self._fetch_checked(record, attempts))
            self._fetches[record.digest] = task
            task.add_done_callback(lambda _: self._fetches.pop(record.digest, None))
        return await asyncio.shield(task)

    @property
    def num_fetches_in_flight(self) -> int:
        """Fetches asked of the registry and not yet received (the fetch process's waiting ones too)."""
        if self.processes:
            return sum(process.num_pending for process in self.processes)
        return self._num_loop_fetches

    @property
    def process(self) -> FetchProcess | None:
        """The first fetch process (the only one by default); None when fetches run on this loop."""
        return self.processes[0] if self.processes else None

    async def _fetch_checked(self, record: AdapterRecord, attempts: int) -> memoryview:
        asked = time.perf_counter()
        for attempt in range(1, attempts + 1):
            fetched = await self._fetch_once(record)
            if fetched.sha256 == record.digest:
                self.num_fetches += 1
                self.fetch_timings.append(FetchTiming(asked, fetched.started, time.perf_counter(), len(fetched.data)))
                return fetched.data
            self.num_digest_mismatches += 1
            log.error("artifact of %s failed its sha256 check (attempt %d of %d)", record.ref, attempt, attempts)
        raise Unavailable(f"adapter {record.ref!r}: the fetched artifact does not match its digest")

    async def _fetch_once(self, record: AdapterRecord) -> Fetched:
        """The artifact, its sha256 and when its transfer began (once it had a turn): from a fetch
        process when there is one, else on this loop."""
        if self.processes:  # the least busy for its share of the turns
            process = min(self.processes, key=lambda p: p.num_pending / p.max_concurrent)
            return await process.fetch(record.name, record.version, record.ref)
        async with self._fetch_turns:
            started = time.perf_counter()
            self._num_loop_fetches += 1
            try:
                artifact = Artifact()
                digest = await receive_artifact(self._artifact_messages(record), artifact, record.ref)
            finally:
                self._num_loop_fetches -= 1
        return Fetched(artifact.bytes(), digest, started)

    def _artifact_messages(self, record: AdapterRecord) -> AsyncIterator[bytes]:
        """FetchAdapter's messages in wire format."""
        return artifact_messages(self._fetch_raw, record.name, record.version, record.ref, self.metadata)

    # ---- watching ----------------------------------------------------------------------------

    async def _register_base_model(self) -> None:
        model = pb.BaseModel(name=self.base_model, config_json=self.config_json)
        await self.stub.RegisterBaseModel(model, timeout=RPC_TIMEOUT_S, metadata=self.metadata)

    async def _watch_forever(self) -> None:
        pause = RECONNECT_S[0]
        while True:
            try:
                if not self.is_connected:
                    await self._register_base_model()
                await self._watch_once()
            except grpc.aio.AioRpcError as exc:
                if self.is_connected:
                    log.warning("registry %s went away (%s); reconnecting", self.address, exc.code().name)
                    pause = RECONNECT_S[0]
                self.is_connected = False
            await asyncio.sleep(pause)
            pause = min(pause * 2, RECONNECT_S[1])

    async def _watch_once(self) -> None:
        fresh = self.last_event_id == 0
        request = pb.WatchAdaptersRequest(base_model=self.base_model, after_event_id=self.last_event_id)
        stream = self.stub.WatchAdapters(request, metadata=self.metadata)
        await stream.initial_metadata()  # the registry sends headers once the watch is in place
        if fresh:  # what happened before this stream is unknown: forget every answer, re-learn pins
            self._epoch += 1
            self._resolved.clear()
            for record in await self._pinned_adapters():
                await self._handle("PINNED", record)
        self.is_connected = True
        async for event in stream:
            await self._apply(pb.AdapterEvent.Kind.Name(event.kind), record_of(event.adapter))
            self.last_event_id = event.event_id  # after applying: a reconnect replays what was cut off

    async def _apply(self, kind: str, record: AdapterRecord) -> None:
        self._generation[record.name] = self._generation.get(record.name, 0) + 1
        self._resolved.pop((record.name, 0), None)  # "latest" may have changed
        if kind == "DELETED":
            self._resolved.pop((record.name, record.version), None)
            if record.digest in {a.digest for a in await self._adapters()}:
                return  # the same content lives on under another name or version
        if kind == "REGISTERED" and record.pinned:
            kind = "PINNED"
        await self._handle(kind, record)

    async def _handle(self, kind: str, record: AdapterRecord) -> None:
        if kind in ("PINNED", "UNPINNED"):
            self._pins[record.ref] = kind == "PINNED"
        try:
            await self.on_event(kind, record)
        except Exception:
            log.exception("handling %s of %s failed", kind, record.ref)

    async def _adapters(self) -> list[pb.Adapter]:
        """Every registered adapter version of this engine's base model."""
        adapters, token = [], ""
        while True:
            request = pb.ListAdaptersRequest(base_model=self.base_model, page_size=1000, page_token=token)
            page = await self.stub.ListAdapters(request, timeout=RPC_TIMEOUT_S, metadata=self.metadata)
            adapters += page.adapters
            token = page.next_page_token
            if not token:
                return adapters

    async def _pinned_adapters(self) -> list[AdapterRecord]:
        return [record_of(a) for a in await self._adapters() if a.pinned]
