"""gRPC servicer of loramux.v1.Registry: one method per RPC, protobuf stops here.

Blocking work (SQL, object store, compiling) runs in worker threads; handlers only translate
messages and map `RegistryError` codes to gRPC status codes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc

from loramux.metrics import RegistryMetrics
from loramux.security import (
    ANONYMOUS,
    PermissionDenied,
    Principal,
    Role,
    Unauthenticated,
    bearer_key,
    split_key,
)
from loramux.v1 import registry_pb2 as pb
from loramux.v1 import registry_pb2_grpc as pb_grpc
from registry.access import KeyInfo
from registry.errors import InvalidArgument, RegistryError, StatusError
from registry.event_feed import EventFeed
from registry.faults import as_status_error
from registry.inflight import CommitGate, Registrations
from registry.service import RegistryService
from registry.types import MAX_EVENT_ID, AdapterEventInfo, AdapterInfo, check_name, check_version
from registry.upload import receive_upload

log = logging.getLogger(__name__)

FETCH_CHUNKS_PER_READ = 8
# Threads of FetchAdapter's own pool (its caller's and row's lookups and its chunk reads): apart from the
# event loop's default pool, where every other RPC's SQL runs, so a burst of GetAdapter lookups (an engine
# resolving a hundred adapters at once) does not hold up the streams already under way. As many as the
# default pool may have: each read call returns after FETCH_CHUNKS_PER_READ chunks, so streams beyond
# the threads wait their turn there, a few milliseconds each.
FETCH_THREADS = 32


def encode_data_chunk(offset: int, data: bytes) -> bytes:
    """`AdapterChunk(data=DataChunk(offset, data))` in protobuf's wire format, the bytes
    SerializeToString gives, with one copy of data: protobuf's own serializing of a 1 MiB bytes field cost
    1.1 ms on the 2-core VM against 0.06 ms for this join, most of a fetch's time on the server."""
    inner = b"\x08" + _varint(offset) if offset else b""  # field 1 (offset), varint; 0 is left out
    if data:
        inner += b"\x12" + _varint(len(data))  # field 2 (data), length-delimited
    return b"".join((b"\x12", _varint(len(inner) + len(data)), inner, data))  # AdapterChunk field 2 (data)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _status_of(exc: BaseException, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The status an RPC ends with when `exc` leaves its handler (after the wrappers below)."""
    if isinstance(exc, RegistryError):
        return getattr(grpc.StatusCode, exc.code.value)
    fault = as_status_error(exc)
    if fault is not None:
        return getattr(grpc.StatusCode, fault.code.value)
    if isinstance(exc, grpc.aio.AbortError):
        code = context.code()  # set by context.abort
        return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.INTERNAL


async def _abort(exc: Exception, name: str, context: grpc.aio.ServicerContext) -> None:
    """Abort with the RegistryError's code; anything else is INTERNAL and logged."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    if isinstance(exc, RegistryError):
        await context.abort(_status_of(exc, context), str(exc))  # raises AbortError
    fault = as_status_error(exc)
    if fault is not None:  # infrastructure, not a bug: one line in the log, the reason to the client
        log.warning("%s: %s (%s)", name, fault, type(exc).__name__)
        await context.abort(_status_of(exc, context), str(fault))
    log.error("%s failed", name, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"{name}: internal error (see the registry log)")


@contextlib.asynccontextmanager
async def _rpc_outcome(metrics: RegistryMetrics, name: str, context: grpc.aio.ServicerContext):
    """Map errors to statuses (see `_abort`) and count the RPC by method and status. A failed RPC is
    counted before its status goes out, so a client that has seen the status finds it counted (counted
    after the abort, a test under two busy workers read the counter first)."""
    try:
        yield
    except BaseException as exc:
        metrics.count_rpc(name, _status_of(exc, context).name)
        if not isinstance(exc, Exception):
            raise
        await _abort(exc, name, context)
    else:
        metrics.count_rpc(name, grpc.StatusCode.OK.name)


def _statuses(method: Callable) -> Callable:
    """`_rpc_outcome` around a unary handler."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        async with _rpc_outcome(self.metrics, name, context):
            return await method(self, request, context)

    return wrapper


def _stream_statuses(method: Callable) -> Callable:
    """`_rpc_outcome` around a server-streaming handler (an async generator)."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        async with (
            _rpc_outcome(self.metrics, name, context),
            contextlib.aclosing(method(self, request, context)) as responses,
        ):
            async for response in responses:
                yield response

    return wrapper


class RegistryServicer(pb_grpc.RegistryServicer):
    def __init__(self, service: RegistryService, metrics: RegistryMetrics | None = None):
        self.service = service
        self.catalog = service.catalog
        self.access = service.access
        self.feed = EventFeed(self.catalog, service.config.watch_poll_s)
        self.metrics = metrics or RegistryMetrics()
        self.registrations = Registrations(service.config.max_concurrent_uploads)
        self._fetch_pool = concurrent.futures.ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="registry-fetch")

    def close(self) -> None:
        """End the fetch threads, after the host has stopped: a read or lookup a cancelled stream left
        running is waited for (before the database and the store close beneath it)."""
        self._fetch_pool.shutdown(wait=True, cancel_futures=True)

    async def _caller(self, context: grpc.aio.ServicerContext, pool: concurrent.futures.Executor | None = None) -> Principal:
        """Who calls: ANONYMOUS without --auth; else the key's holder (looked up on `pool`, by default the
        event loop's), or UNAUTHENTICATED (audited)."""
        if not self.service.config.auth:
            return ANONYMOUS
        key = bearer_key(context.invocation_metadata())
        caller = await asyncio.get_running_loop().run_in_executor(pool, self.access.authenticate, key) if key else None
        if caller is None:
            await self._refused(_claimed(key), "authenticate", "registry", "UNAUTHENTICATED")
            raise Unauthenticated("a valid API key is required: send 'authorization: Bearer KEY'")
        return caller

    async def _refused(self, caller: Principal, action: str, target: str, outcome: str) -> None:
        try:
            await asyncio.to_thread(self.access.record_refusal, caller, action, target, outcome)
        except Exception:  # the refusal stands even when its audit row cannot be written
            log.warning("could not audit a refused %s", action, exc_info=True)

    @contextlib.asynccontextmanager
    async def _audited(self, caller: Principal, action: str, target: str):
        """A mutation's refusal gets its own audit row (a success writes its row with the change)."""
        try:
            yield
        except StatusError as exc:
            await self._refused(caller, action, target, exc.code.value)
            raise

    @_statuses
    async def RegisterBaseModel(self, request: pb.BaseModel, context) -> pb.BaseModel:
        caller = await self._caller(context)
        async with self._audited(caller, "register_base_model", request.name[:128]):
            info = await asyncio.to_thread(
                self.service.register_base_model, request.name, request.config_json, caller
            )
        return pb.BaseModel(name=info.name, config_json=info.config_json)

    @_statuses
    async def ListBaseModels(self, request, context) -> pb.ListBaseModelsResponse:
        await self._caller(context)
        infos = await asyncio.to_thread(self.catalog.list_base_models)
        return pb.ListBaseModelsResponse(
            base_models=[pb.BaseModel(name=i.name, config_json=i.config_json) for i in infos]
        )

    @_statuses
    async def RegisterAdapter(
        self, request_iterator: AsyncIterator[pb.RegisterAdapterRequest], context
    ) -> pb.Adapter:
        config = self.service.config
        started = time.perf_counter()
        caller = await self._caller(context)
        async with self._audited(caller, "register", "upload"):
            if caller.role not in (Role.ADMIN, Role.PUBLISHER):  # refused before a byte is spooled
                raise PermissionDenied(f"registering adapters needs a publisher or admin key, not {caller.role.value}")
        gate = CommitGate(context.time_remaining())
        run = self.registrations.run
        with self.registrations.slot(), tempfile.TemporaryDirectory(dir=self.service.spool.path) as tmp:
            upload = await receive_upload(
                request_iterator, Path(tmp), config.max_upload_bytes, config.upload_idle_timeout_s
            )
            spec = upload.spec
            async with self._audited(caller, "register", spec.name):
                if upload.files is None:
                    info = await run(gate, self.service.import_adapter, spec, caller, gate.check)
                else:
                    files = upload.files
                    self.metrics.uploaded_bytes.inc(files.config_path.stat().st_size + files.weights_path.stat().st_size)
                    info = await run(gate, self.service.register_adapter, spec, files, caller, gate.check)
        self.feed.wake()
        self.metrics.adapters_registered.inc()
        self.metrics.registration_latency.observe(time.perf_counter() - started)
        return adapter_to_pb(info)

    @_statuses
    async def GetAdapter(self, request: pb.GetAdapterRequest, context) -> pb.Adapter:
        caller = await self._caller(context)
        check_name(request.name)
        check_version(request.version)
        return adapter_to_pb(await asyncio.to_thread(self.catalog.get, request.name, request.version, caller))

    @_statuses
    async def ListAdapters(self, request: pb.ListAdaptersRequest, context) -> pb.ListAdaptersResponse:
        caller = await self._caller(context)
        infos, token = await asyncio.to_thread(
            self.catalog.list,
            request.base_model,
            request.name_prefix,
            request.page_size,
            request.page_token,
            request.latest_only,
            caller,
        )
        return pb.ListAdaptersResponse(adapters=[adapter_to_pb(i) for i in infos], next_page_token=token)

    @_statuses
    async def DeleteAdapter(self, request: pb.DeleteAdapterRequest, context) -> pb.DeleteAdapterResponse:
        caller = await self._caller(context)
        check_name(request.name)
        check_version(request.version)
        async with self._audited(caller, "delete", _ref(request.name, request.version)):
            deleted = await asyncio.to_thread(self.catalog.delete, request.name, request.version, caller)
        self.feed.wake()
        self.metrics.adapters_deleted.inc(len(deleted))
        return pb.DeleteAdapterResponse(deleted=[adapter_to_pb(i) for i in deleted])

    @_statuses
    async def SetPinned(self, request: pb.SetPinnedRequest, context) -> pb.Adapter:
        caller = await self._caller(context)
        check_name(request.name)
        check_version(request.version)
        action = "pin" if request.pinned else "unpin"
        async with self._audited(caller, action, _ref(request.name, request.version)):
            info = await asyncio.to_thread(
                self.catalog.set_pinned, request.name, request.version, request.pinned, caller
            )
        self.feed.wake()
        return adapter_to_pb(info)

    @_stream_statuses
    async def FetchAdapter(self, request: pb.FetchAdapterRequest, context) -> AsyncIterator[pb.AdapterChunk | bytes]:
        caller = await self._caller(context, self._fetch_pool)
        check_name(request.name)
        check_version(request.version)
        loop = asyncio.get_running_loop()
        info = await loop.run_in_executor(self._fetch_pool, self.catalog.get, request.name, request.version, caller)
        yield pb.AdapterChunk(adapter=adapter_to_pb(info))
        chunks = self.service.iter_artifact(info.digest)

        def read(offset: int) -> tuple[list[bytes], int]:
            """The next chunks, each encoded here: the join copies a MiB, off the event loop."""
            batch = []
            for data in itertools.islice(chunks, FETCH_CHUNKS_PER_READ):
                batch.append(encode_data_chunk(offset, data))
                offset += len(data)
            return batch, offset

        offset = 0
        # Several chunks per worker-thread hop: the hop, not the read, dominated per-chunk cost.
        while True:
            batch, end = await loop.run_in_executor(self._fetch_pool, read, offset)
            if not batch:
                break
            for message in batch:
                yield message  # sent as is (ServiceHost.add_servicer)
            self.metrics.fetched_bytes.inc(end - offset)
            offset = end

    @_stream_statuses
    async def WatchAdapters(
        self, request: pb.WatchAdaptersRequest, context
    ) -> AsyncIterator[pb.AdapterEvent]:
        caller = await self._caller(context)
        with self.metrics.watchers.track_inprogress():
            if request.after_event_id > MAX_EVENT_ID:
                raise InvalidArgument(f"after_event_id {request.after_event_id} is over {MAX_EVENT_ID}")
            after = request.after_event_id or await asyncio.to_thread(self.catalog.last_event_id)
            # Headers now: the client knows the watch is in place before the first event arrives.
            await context.send_initial_metadata(())
            async for events in self.feed.watch(after):
                for event in events:
                    a = event.adapter
                    if (not request.base_model or a.base_model == request.base_model) and caller.can_see(a.tenant, a.public):
                        yield event_to_pb(event)

    # ---- keys and audit ----------------------------------------------------------------------

    @_statuses
    async def CreateKey(self, request: pb.CreateKeyRequest, context) -> pb.CreateKeyResponse:
        caller = await self._caller(context)
        async with self._audited(caller, "key_create", f"{request.tenant[:64]} {request.role[:16]}"):
            caller.require_admin("creating keys")
            secret, info = await asyncio.to_thread(
                self.access.create_key, caller, request.tenant, request.role, request.description
            )
        return pb.CreateKeyResponse(key=key_to_pb(info), secret=secret)

    @_statuses
    async def ListKeys(self, request: pb.ListKeysRequest, context) -> pb.ListKeysResponse:
        (await self._caller(context)).require_admin("listing keys")
        return pb.ListKeysResponse(keys=[key_to_pb(k) for k in await asyncio.to_thread(self.access.list_keys)])

    @_statuses
    async def RevokeKey(self, request: pb.RevokeKeyRequest, context) -> pb.ApiKey:
        caller = await self._caller(context)
        async with self._audited(caller, "key_revoke", request.key_id[:16]):
            caller.require_admin("revoking keys")
            return key_to_pb(await asyncio.to_thread(self.access.revoke_key, caller, request.key_id))

    @_statuses
    async def CheckKey(self, request: pb.CheckKeyRequest, context) -> pb.CheckKeyResponse:
        """For engines: who holds `request.key`. A bad key is audited here, as the engine's refusal."""
        caller = await self._caller(context)
        if caller.role not in (Role.ADMIN, Role.ENGINE):
            raise PermissionDenied("checking keys needs an engine or admin key")
        holder = await asyncio.to_thread(self.access.authenticate, request.key) if request.key else None
        if holder is None:
            await self._refused(_claimed(request.key), "authenticate", f"engine {caller.key_id}", "UNAUTHENTICATED")
            return pb.CheckKeyResponse(valid=False)
        return pb.CheckKeyResponse(valid=True, key=pb.ApiKey(key_id=holder.key_id, tenant=holder.tenant, role=holder.role.value))

    @_statuses
    async def ListAudit(self, request: pb.ListAuditRequest, context) -> pb.ListAuditResponse:
        (await self._caller(context)).require_admin("reading the audit log")
        rows = await asyncio.to_thread(self.access.list_audit, request.limit or 100)
        return pb.ListAuditResponse(entries=[pb.AuditEntry(**dataclasses.asdict(r)) for r in rows])


def adapter_to_pb(info: AdapterInfo) -> pb.Adapter:
    return pb.Adapter(
        name=info.name,
        version=info.version,
        digest=info.digest,
        base_model=info.base_model,
        rank=info.rank,
        alpha=info.alpha,
        scaling=info.scaling,
        target_modules=list(info.target_modules),
        pinned=info.pinned,
        size_bytes=info.size_bytes,
        created_at=info.created_at,
        description=info.description,
        labels=info.labels,
        tenant=info.tenant,
        public=info.public,
    )


def key_to_pb(info: KeyInfo) -> pb.ApiKey:
    return pb.ApiKey(
        key_id=info.key_id,
        tenant=info.tenant,
        role=info.role,
        description=info.description,
        created_at=info.created_at,
        revoked_at=info.revoked_at or 0.0,
    )


def _claimed(key: str) -> Principal:
    """Whom a refused key is audited as: the key id it claims, when it has the shape of a key."""
    parts = split_key(key)
    return Principal(key_id=parts[0] if parts else "", tenant="", role=Role.USER)


def _ref(name: str, version: int) -> str:
    return f"{name[:128]}@{version}" if version else name[:128]


def event_to_pb(event: AdapterEventInfo) -> pb.AdapterEvent:
    kind = pb.AdapterEvent.Kind.Value(event.kind)
    return pb.AdapterEvent(kind=kind, adapter=adapter_to_pb(event.adapter), event_id=event.event_id)
