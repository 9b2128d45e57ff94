"""What both services share around grpc.aio: health, reflection, the ready line, graceful stop."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import sys
from collections.abc import Callable, Sequence

import grpc
from google.protobuf.message import DecodeError
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
                # gRPC Python turns SO_REUSEPORT on: a second server on a taken port would start
                # silently and the kernel would split connections between the two.
                ("grpc.so_reuseport", 0),
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
        if port and not _can_listen(host, port):  # before gRPC, which would log its own C++ error line
            raise OSError(port_taken_message(host, port))
        try:
            if credentials is None:
                self.port = self.server.add_insecure_port(address)
            else:
                self.port = self.server.add_secure_port(address, credentials)
        except RuntimeError:  # grpcio raises "Failed to bind to address ..." here
            self.port = 0
        if self.port == 0:
            raise OSError(port_taken_message(host, port))
        return self.port

    def add_servicer(self, add_to_server: Callable, servicer: object) -> None:
        """Register a generated servicer (`add_XServicer_to_server`) so that request bytes which do not
        parse end as INVALID_ARGUMENT naming the method, not as gRPC's UNKNOWN "Unexpected DecodeError",
        and so that a response stream may carry messages the method encoded itself (bytes: sent as they are)."""
        capture = _HandlerCapture()
        add_to_server(servicer, capture)
        handlers = {name: _encoded_passes(_tolerant(name, h)) for name, h in capture.handlers.items()}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(capture.service, handlers),))
        self.server.add_registered_method_handlers(capture.service, handlers)

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


def _can_listen(host: str, port: int) -> bool:
    """Whether nothing listens on host:port (SO_REUSEADDR: connections in TIME_WAIT do not count)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.errno != errno.EADDRINUSE
    return True


def port_taken_message(host: str, port: int) -> str:
    return f"cannot listen on {host}:{port}: the port is taken (another loramux? `loramux down`, or pick another port)"


class Malformed:
    """What a request that failed to parse becomes; the method wrapper answers INVALID_ARGUMENT."""

    def __init__(self, num_bytes: int):
        self.num_bytes = num_bytes


class _HandlerCapture:
    """Stands in for the server while generated code registers its handlers."""

    def __init__(self):
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # the same handlers arrive through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.service, self.handlers = service, dict(handlers)


def _tolerant(name: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer

    def deserialize(data: bytes):
        try:
            return parse(data)
        except DecodeError:
            return Malformed(len(data))

    if handler.unary_unary:
        respond = handler.unary_unary

        async def unary(request, context):
            await _refuse_malformed(name, request, context)
            return await respond(request, context)

        return handler._replace(request_deserializer=deserialize, unary_unary=unary)
    if handler.unary_stream:
        stream = handler.unary_stream

        async def streamed(request, context):
            await _refuse_malformed(name, request, context)
            async for item in stream(request, context):
                yield item

        return handler._replace(request_deserializer=deserialize, unary_stream=streamed)
    return handler._replace(request_deserializer=deserialize)  # request streams meet Malformed items themselves


def _encoded_passes(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A response stream's items may be messages or their encoded bytes (sent as they are)."""
    if not handler.response_streaming:
        return handler
    serialize = handler.response_serializer
    return handler._replace(response_serializer=lambda m: m if isinstance(m, bytes) else serialize(m))


async def _refuse_malformed(name: str, request, context) -> None:
    if isinstance(request, Malformed):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{name}: the request ({request.num_bytes} bytes) is not a valid protobuf message",
        )


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
