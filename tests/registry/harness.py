"""An in-process registry on a loopback port, with an async client stub."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from pathlib import Path

import grpc
import pytest

from loramux.registry_client import adapter_files, upload_requests
from loramux.security import auth_metadata, open_channel
from loramux.v1 import registry_pb2 as pb
from loramux.v1 import registry_pb2_grpc as pb_grpc
from registry.config import RegistryConfig
from registry.server import RegistryServer
from tests.registry.backends import fresh_postgres_database

BACKENDS = ["sqlite+local", "postgres+s3"]


@dataclasses.dataclass
class Harness:
    server: RegistryServer
    stub: pb_grpc.RegistryStub
    channel: grpc.aio.Channel
    metadata: tuple = ()  # sent with every call the harness makes (authorization)

    def as_key(self, key: str) -> Harness:
        """The same registry, called with `key` ('' = no key)."""
        return dataclasses.replace(self, metadata=auth_metadata(key))

    @property
    def service(self):
        return self.server.service

    @property
    def store(self):
        return self.server.service.store

    async def register_base(self, name: str, model_dir: Path) -> pb.BaseModel:
        config_json = (model_dir / "config.json").read_text()
        return await self.stub.RegisterBaseModel(pb.BaseModel(name=name, config_json=config_json), metadata=self.metadata)

    async def register(self, name: str, adapter_dir: Path | None = None, **spec_fields) -> pb.Adapter:
        spec = pb.AdapterSpec(name=name, **spec_fields)
        files = adapter_files(adapter_dir) if adapter_dir is not None else []
        return await self.stub.RegisterAdapter(_aiter(upload_requests(spec, files)), metadata=self.metadata)

    async def register_files(self, name: str, files: dict[str, bytes], **spec_fields) -> pb.Adapter:
        """Upload raw file contents (for malformed inputs)."""
        requests = [pb.RegisterAdapterRequest(spec=pb.AdapterSpec(name=name, **spec_fields))]
        for filename, data in files.items():
            for offset in range(0, max(len(data), 1), 1 << 20):
                chunk = pb.FileChunk(filename=filename, offset=offset, data=data[offset : offset + (1 << 20)])
                requests.append(pb.RegisterAdapterRequest(chunk=chunk))
        return await self.stub.RegisterAdapter(_aiter(iter(requests)), metadata=self.metadata)

    async def fetch(self, name: str, version: int = 0) -> tuple[pb.Adapter, bytes, list[int]]:
        """(adapter, artifact bytes, chunk sizes)."""
        adapter, parts = None, []
        request = pb.FetchAdapterRequest(name=name, version=version)
        async for chunk in self.stub.FetchAdapter(request, metadata=self.metadata):
            if chunk.WhichOneof("item") == "adapter":
                adapter = chunk.adapter
            else:
                assert chunk.data.offset == sum(len(p) for p in parts)
                parts.append(chunk.data.data)
        return adapter, b"".join(parts), [len(p) for p in parts]

    async def list_all(self, **request_fields) -> list[pb.Adapter]:
        request = pb.ListAdaptersRequest(page_size=1000, **request_fields)
        response = await self.stub.ListAdapters(request, metadata=self.metadata)
        return list(response.adapters)

    def stored_blobs(self) -> list[str]:
        return sorted(blob.digest for blob in self.store.list_blobs())


async def _aiter(items):
    for item in items:
        yield item


@asynccontextmanager
async def running_registry(
    data_dir: Path, database_url: str = "", object_store: str = "", **config
) -> AsyncIterator[Harness]:
    config.setdefault("port", 0)
    cfg = RegistryConfig(data_dir=data_dir, database_url=database_url, object_store=object_store, **config)
    server = RegistryServer(cfg)
    await server.start()
    channel = open_channel(server.address, cfg.tls, aio=True)
    # with --auth, the harness calls as the first admin (the key the registry wrote at start)
    admin = cfg.resolved_admin_key_file.read_text().strip() if cfg.auth else ""
    try:
        yield Harness(server, pb_grpc.RegistryStub(channel), channel, auth_metadata(admin))
    finally:
        await channel.close()
        await server.stop(grace=0.5)


@asynccontextmanager
async def registry_on_backend(
    request: pytest.FixtureRequest, data_dir: Path, base_model_dir: Path, **config
) -> AsyncIterator[Harness]:
    """A registry on the backend `request.param` names (one of BACKENDS), with base model "tiny"."""
    db, store = request.param.split("+")
    with ExitStack() as stack:
        db_url = stack.enter_context(fresh_postgres_database()) if db == "postgres" else ""
        store_url = ""
        if store == "s3":
            endpoint = request.getfixturevalue("s3_endpoint")
            store_url = f"s3://{request.getfixturevalue('s3_bucket')}?endpoint_url={endpoint}"
        async with running_registry(data_dir, db_url, store_url, **config) as harness:
            await harness.register_base("tiny", base_model_dir)
            yield harness


def config_json(model_dir: Path, **overrides) -> str:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(overrides)
    return json.dumps(cfg)
