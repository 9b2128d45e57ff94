"""A small synchronous client of the Engine service (CLI, tests, benchmarks)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loramux.security import TlsFiles, open_channel
from loramux.v1 import engine_pb2 as pb
from loramux.v1 import engine_pb2_grpc as pb_grpc


@dataclass
class Generation:
    """What one Generate stream delivered."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    complete: pb.GenerateComplete | None = None
    num_chunks: int = 0

    @property
    def finish_reason(self) -> str:
        return pb.FinishReason.Name(self.complete.finish_reason) if self.complete else ""


def generate_request(prompt: str | list[int], adapter: str = "", request_id: str = "", **sampling_fields) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=request_id, adapter=adapter, sampling=pb.SamplingParams(**sampling_fields))
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


class EngineClient:
    def __init__(self, address: str, timeout: float | None = 600.0, api_key: str = "", tls: TlsFiles | None = None):
        self.address = address
        self.timeout = timeout
        self._channel = open_channel(address, tls, api_key=api_key)
        self.stub = pb_grpc.EngineStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_ready(self, timeout: float) -> None:
        """Poll the engine's health until SERVING; raises TimeoutError after `timeout` seconds."""
        health = health_pb2_grpc.HealthStub(self._channel)
        deadline = time.monotonic() + timeout
        while True:
            try:
                check = health.Check(health_pb2.HealthCheckRequest(service="loramux.v1.Engine"), timeout=5)
                if check.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine at {self.address} was not ready within {timeout:g}s")
            time.sleep(0.5)

    def stream(self, request: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
        return self.stub.Generate(request, timeout=self.timeout)

    def generate(self, request: pb.GenerateRequest) -> Generation:
        """Run one stream to its end and collect the deltas."""
        result = Generation()
        for response in self.stream(request):
            if response.WhichOneof("event") == "chunk":
                result.token_ids += response.chunk.token_ids
                result.text += response.chunk.text
                result.num_chunks += 1
            else:
                result.complete = response.complete
        return result
