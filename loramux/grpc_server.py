"""What both services share around grpc.aio: health, reflection, the ready line, graceful stop."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from loramux.metrics import start_metrics_server
from loramux.ready import announce

# Chunks are <= 1 MiB of payload; leave room for framing and the first message's metadata.
log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 8 << 20
SHUTDOWN_GRACE_S = 5.0


class ServiceHost:
    """A grpc.aio server with health and reflection for the given fully qualified service names."""

    def __init__(self, service_names: Sequence[str], max_receive_bytes: int = MAX_MESSAGE_BYTES):
        self.service_names = tuple(service_names)
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", max_receive_bytes),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ]
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        self.bound_host = ""
        self.port = 0

    def bind(self, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
        """Bind host:port (0 = pick a free port), with TLS when credentials are given; returns the port."""
        self.bound_host = host
        address = f"{host}:{port}"
        if credentials is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, credentials)
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        return self.port

    @property
    def address(self) -> str:
        return f"{self.bound_host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace: float = SHUTDOWN_GRACE_S) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)


def stop_event_on_signals(signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM)) -> asyncio.Event:
    """An event set by SIGINT/SIGTERM in the running loop (Ctrl-C starts a graceful stop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in signals:
        if sys.platform != "win32":
            loop.add_signal_handler(sig, stop.set)
    return stop


async def serve_until_stopped(name: str, server, stop: asyncio.Event, metrics_port: int | None) -> None:
    """For a started server (`.host`, `.metrics`, `.stop()`): serve /metrics on its host when a port is
    given (0 = pick a free one), print the ready line, wait for `stop`, then stop gracefully."""
    metrics_server = None
    if metrics_port is not None:
        metrics_server, _ = start_metrics_server(server.metrics, server.host.bound_host, metrics_port)
    announce(name, server.host.bound_host, server.host.port)
    await stop.wait()
    log.info("%s shutting down", name)
    await server.stop()
    if metrics_server is not None:
        await asyncio.to_thread(metrics_server.shutdown)
