"""Assembles and runs the registry service: SQL + migrations, object store, servicer, gRPC host."""

from __future__ import annotations

import asyncio
import logging

from loramux.grpc_server import ServiceHost, serve_until_stopped
from loramux.metrics import RegistryMetrics
from loramux.security import Principal, Role, check_exposure
from loramux.v1 import registry_pb2, registry_pb2_grpc
from registry.catalog import Catalog
from registry.config import RegistryConfig
from registry.db import make_engine, migrate
from registry.faults import short_reason
from registry.service import RegistryService
from registry.servicer import RegistryServicer
from registry.store import open_store

log = logging.getLogger(__name__)
ADMIN_TENANT = "admin"
ENGINE_TENANT = "engines"
SYSTEM = Principal(key_id="", tenant="system", role=Role.ADMIN)  # what the registry does by itself
SERVICE_NAME = registry_pb2.DESCRIPTOR.services_by_name["Registry"].full_name


PROBE_TIMEOUT_S = 5.0


def build_service(config: RegistryConfig, reclaim: bool = True) -> RegistryService:
    """Open the database (migrated to head) and the object store; reclaim what crashes left behind."""
    config.data_dir.mkdir(parents=True, exist_ok=True)
    engine = make_engine(config.resolved_database_url)
    migrate(engine)
    service = RegistryService(Catalog(engine), open_store(config.resolved_object_store), config)
    if config.auth:
        path = config.resolved_admin_key_file
        if service.access.ensure_key_file(path, ADMIN_TENANT, Role.ADMIN, SYSTEM):
            log.info("wrote the first admin key to %s (mode 0600)", path)
        engine_file = config.engine_key_file
        if engine_file is not None and service.access.ensure_key_file(engine_file, ENGINE_TENANT, Role.ENGINE, SYSTEM):
            log.info("wrote an engine key to %s (mode 0600)", engine_file)
    if reclaim:
        try:
            leftovers = service.reclaim_leftovers()
        except Exception as exc:  # the store may be down now; the next start or `registry gc` retries
            log.warning("could not reclaim leftovers of crashed registrations: %s", short_reason(exc))
        else:
            if leftovers:
                log.info("reclaimed %s", leftovers)
    return service


class RegistryServer:
    """A started registry; `port` is the bound port (useful when config.port is 0)."""

    def __init__(
        self,
        config: RegistryConfig,
        service: RegistryService | None = None,
        metrics: RegistryMetrics | None = None,
    ):
        """Create in the event loop's thread (grpc.aio binds to it); pass a service built elsewhere
        to keep the blocking database set-up out of the loop. Metrics are always counted; serving
        them over HTTP is the caller's choice (see `serve`)."""
        check_exposure(config.host, config.auth, config.allow_unauthenticated, "registry")
        self.config = config
        self.service = service or build_service(config)
        self.metrics = metrics or RegistryMetrics()
        self.servicer = RegistryServicer(self.service, self.metrics)
        self.host = ServiceHost([SERVICE_NAME])
        self.host.add_servicer(registry_pb2_grpc.add_RegistryServicer_to_server, self.servicer)
        credentials = config.tls.server_credentials() if config.tls.is_on else None
        self.port = self.host.bind(config.host, config.port, credentials)
        self._probe: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return self.host.address

    async def start(self) -> None:
        await self.servicer.feed.start()
        await self.host.start()
        await self.host.set_serving(True)
        self._probe = asyncio.create_task(self._probe_database())

    async def stop(self, grace: float | None = None) -> None:
        """Stop within the grace: registrations finish in it, or stop before their commit (see inflight)."""
        if self._probe is not None:
            self._probe.cancel()
        try:
            await (self.host.stop() if grace is None else self.host.stop(grace))
            await self.servicer.registrations.wait_workers()
            await self.servicer.feed.stop()
        finally:
            await asyncio.to_thread(self.servicer.close)
        await asyncio.to_thread(self.service.close)
        await asyncio.to_thread(self.service.catalog.engine.dispose)

    async def _probe_database(self) -> None:
        """Health follows the database: NOT_SERVING while it cannot be reached, SERVING once it can."""
        is_serving = True
        while True:
            await asyncio.sleep(self.config.health_probe_s)
            try:
                await asyncio.wait_for(asyncio.to_thread(self.service.catalog.ping), PROBE_TIMEOUT_S)
                reachable, reason = True, ""
            except Exception as exc:
                reachable, reason = False, short_reason(exc)
            if reachable != is_serving:
                if reachable:
                    log.info("the database is reachable again; serving")
                else:
                    log.warning("the database is unreachable (%s); health says NOT_SERVING", reason)
                await self.host.set_serving(reachable)
                is_serving = reachable


async def serve(config: RegistryConfig, stop: asyncio.Event, metrics_port: int | None = None) -> None:
    """Run until `stop` is set, then stop gracefully; /metrics on config.host:metrics_port if given."""
    server = RegistryServer(config, await asyncio.to_thread(build_service, config))
    await server.start()
    await serve_until_stopped("registry", server, stop, metrics_port)
