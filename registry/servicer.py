"""gRPC servicer of loramux.v1.Registry: one method per RPC, protobuf stops here.

Blocking work (SQL, object store, compiling) runs in worker threads; handlers only translate
messages and map `RegistryError` codes to gRPC status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc

from loramux.metrics import RegistryMetrics
from loramux.v1 import registry_pb2 as pb
from loramux.v1 import registry_pb2_grpc as pb_grpc
from registry.errors import InvalidArgument, RegistryError
from registry.service import RegistryService
from registry.types import MAX_EVENT_ID, AdapterEventInfo, AdapterInfo, check_name, check_version
from registry.upload import receive_upload

log = logging.getLogger(__name__)

WATCH_POLL_S = 1.0
FETCH_CHUNKS_PER_READ = 8  # other registry processes' events are seen within this delay


class EventHub:
    """Wakes watchers in this process as soon as a change commits."""

    def __init__(self) -> None:
        self.current = asyncio.Event()

    def notify(self) -> None:
        self.current.set()
        self.current = asyncio.Event()


def _status_of(exc: BaseException, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The status an RPC ends with when `exc` leaves its handler (after the wrappers below)."""
    if isinstance(exc, RegistryError):
        return getattr(grpc.StatusCode, exc.code.value)
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
    log.error("%s failed", name, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"{name}: internal error (see the registry log)")


@contextlib.asynccontextmanager
async def _rpc_outcome(metrics: RegistryMetrics, name: str, context: grpc.aio.ServicerContext):
    """Map errors to statuses (see `_abort`) and count the RPC by method and status."""
    code = grpc.StatusCode.OK
    try:
        yield
    except BaseException as exc:
        code = _status_of(exc, context)
        if not isinstance(exc, Exception):
            raise
        await _abort(exc, name, context)
    finally:
        metrics.count_rpc(name, code.name)


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
        self.hub = EventHub()
        self.metrics = metrics or RegistryMetrics()

    @_statuses
    async def RegisterBaseModel(self, request: pb.BaseModel, context) -> pb.BaseModel:
        info = await asyncio.to_thread(self.service.register_base_model, request.name, request.config_json)
        return pb.BaseModel(name=info.name, config_json=info.config_json)

    @_statuses
    async def ListBaseModels(self, request, context) -> pb.ListBaseModelsResponse:
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
        with tempfile.TemporaryDirectory(dir=config.spool_dir) as tmp:
            upload = await receive_upload(request_iterator, Path(tmp), config.max_upload_bytes)
            spec = upload.spec
            if upload.files is None:
                info = await asyncio.to_thread(self.service.import_adapter, spec)
            else:
                files = upload.files
                self.metrics.uploaded_bytes.inc(files.config_path.stat().st_size + files.weights_path.stat().st_size)
                info = await asyncio.to_thread(self.service.register_adapter, spec, files)
        self.hub.notify()
        self.metrics.adapters_registered.inc()
        self.metrics.registration_latency.observe(time.perf_counter() - started)
        return adapter_to_pb(info)

    @_statuses
    async def GetAdapter(self, request: pb.GetAdapterRequest, context) -> pb.Adapter:
        check_name(request.name)
        check_version(request.version)
        return adapter_to_pb(await asyncio.to_thread(self.catalog.get, request.name, request.version))

    @_statuses
    async def ListAdapters(self, request: pb.ListAdaptersRequest, context) -> pb.ListAdaptersResponse:
        infos, token = await asyncio.to_thread(
            self.catalog.list,
            request.base_model,
            request.name_prefix,
            request.page_size,
            request.page_token,
            request.latest_only,
        )
        return pb.ListAdaptersResponse(adapters=[adapter_to_pb(i) for i in infos], next_page_token=token)

    @_statuses
    async def DeleteAdapter(self, request: pb.DeleteAdapterRequest, context) -> pb.DeleteAdapterResponse:
        check_name(request.name)
        check_version(request.version)
        deleted = await asyncio.to_thread(self.catalog.delete, request.name, request.version)
        self.hub.notify()
        self.metrics.adapters_deleted.inc(len(deleted))
        return pb.DeleteAdapterResponse(deleted=[adapter_to_pb(i) for i in deleted])

    @_statuses
    async def SetPinned(self, request: pb.SetPinnedRequest, context) -> pb.Adapter:
        check_name(request.name)
        check_version(request.version)
        info = await asyncio.to_thread(self.catalog.set_pinned, request.name, request.version, request.pinned)
        self.hub.notify()
        return adapter_to_pb(info)

    @_stream_statuses
    async def FetchAdapter(self, request: pb.FetchAdapterRequest, context) -> AsyncIterator[pb.AdapterChunk]:
        check_name(request.name)
        check_version(request.version)
        info = await asyncio.to_thread(self.catalog.get, request.name, request.version)
        yield pb.AdapterChunk(adapter=adapter_to_pb(info))
        chunks = self.service.iter_artifact(info.digest)
        offset = 0
        # Several chunks per worker-thread hop: the hop, not the read, dominated per-chunk cost.
        while batch := await asyncio.to_thread(list, itertools.islice(chunks, FETCH_CHUNKS_PER_READ)):
            for data in batch:
                yield pb.AdapterChunk(data=pb.DataChunk(offset=offset, data=data))
                offset += len(data)
                self.metrics.fetched_bytes.inc(len(data))

    @_stream_statuses
    async def WatchAdapters(
        self, request: pb.WatchAdaptersRequest, context
    ) -> AsyncIterator[pb.AdapterEvent]:
        with self.metrics.watchers.track_inprogress():
            if request.after_event_id > MAX_EVENT_ID:
                raise InvalidArgument(f"after_event_id {request.after_event_id} is over {MAX_EVENT_ID}")
            after = request.after_event_id or await asyncio.to_thread(self.catalog.last_event_id)
            # Headers now: the client knows the watch is in place before the first event arrives.
            await context.send_initial_metadata(())
            while True:
                woken = self.hub.current
                events = await asyncio.to_thread(self.catalog.events_after, after, request.base_model)
                for event in events:
                    yield event_to_pb(event)
                    after = event.event_id
                if not events:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(woken.wait(), WATCH_POLL_S)


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
    )


def event_to_pb(event: AdapterEventInfo) -> pb.AdapterEvent:
    kind = pb.AdapterEvent.Kind.Value(event.kind)
    return pb.AdapterEvent(kind=kind, adapter=adapter_to_pb(event.adapter), event_id=event.event_id)
