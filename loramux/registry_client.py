"""A small synchronous client of the Registry service, used by the CLI, tests and benchmarks."""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc

from loraformat.peft_files import ADAPTER_FILES, PICKLE_WEIGHTS_FILES, WEIGHTS_FILE
from loramux.security import TlsFiles, open_channel
from loramux.v1 import registry_pb2 as pb
from loramux.v1 import registry_pb2_grpc as pb_grpc

CHUNK_BYTES = 1 << 20

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


def channel(address: str, api_key: str = "", tls: TlsFiles | None = None) -> grpc.Channel:
    options = [("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20)]
    return open_channel(address, tls, options, api_key=api_key)


def adapter_files(adapter_dir: Path) -> list[Path]:
    """The files of a PEFT adapter directory to upload; pickle weights are sent so the server refuses them."""
    files = [adapter_dir / name for name in ADAPTER_FILES if (adapter_dir / name).is_file()]
    if not (adapter_dir / WEIGHTS_FILE).is_file():
        files += [adapter_dir / name for name in PICKLE_WEIGHTS_FILES if (adapter_dir / name).is_file()]
    return files


def upload_requests(spec: pb.AdapterSpec, files: list[Path], progress: Progress | None = None) -> Iterator[pb.RegisterAdapterRequest]:
    """The RegisterAdapter stream: the spec, then every file in chunks of CHUNK_BYTES."""
    yield pb.RegisterAdapterRequest(spec=spec)
    total = sum(path.stat().st_size for path in files)
    done = 0
    for path in files:
        with path.open("rb") as handle:
            offset = 0
            while data := handle.read(CHUNK_BYTES):
                yield pb.RegisterAdapterRequest(chunk=pb.FileChunk(filename=path.name, offset=offset, data=data))
                offset += len(data)
                done += len(data)
                if progress:
                    progress(done, total)


class RegistryClient:
    def __init__(self, address: str, timeout: float | None = 600.0, api_key: str = "", tls: TlsFiles | None = None):
        self.address = address
        self.timeout = timeout
        self._channel = channel(address, api_key, tls)
        self.stub = pb_grpc.RegistryStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def register_base_model(self, name: str, model_dir: Path) -> pb.BaseModel:
        config_json = (model_dir / "config.json").read_text()
        return self.stub.RegisterBaseModel(pb.BaseModel(name=name, config_json=config_json), timeout=self.timeout)

    def list_base_models(self) -> list[pb.BaseModel]:
        return list(self.stub.ListBaseModels(pb.ListBaseModelsRequest(), timeout=self.timeout).base_models)

    def register_adapter(self, spec: pb.AdapterSpec, adapter_dir: Path | None = None, progress: Progress | None = None) -> pb.Adapter:
        """Upload adapter_dir, or import spec.source_uri on the server when adapter_dir is None."""
        files = adapter_files(adapter_dir) if adapter_dir is not None else []
        return self.stub.RegisterAdapter(upload_requests(spec, files, progress), timeout=self.timeout)

    def get(self, name: str, version: int = 0) -> pb.Adapter:
        return self.stub.GetAdapter(pb.GetAdapterRequest(name=name, version=version), timeout=self.timeout)

    def list(self, base_model: str = "", name_prefix: str = "", latest_only: bool = False) -> Iterator[pb.Adapter]:
        token = ""
        while True:
            request = pb.ListAdaptersRequest(
                base_model=base_model, name_prefix=name_prefix, page_token=token, latest_only=latest_only
            )
            page = self.stub.ListAdapters(request, timeout=self.timeout)
            yield from page.adapters
            token = page.next_page_token
            if not token:
                return

    def delete(self, name: str, version: int = 0) -> list[pb.Adapter]:
        request = pb.DeleteAdapterRequest(name=name, version=version)
        return list(self.stub.DeleteAdapter(request, timeout=self.timeout).deleted)

    def set_pinned(self, name: str, version: int, pinned: bool) -> pb.Adapter:
        request = pb.SetPinnedRequest(name=name, version=version, pinned=pinned)
        return self.stub.SetPinned(request, timeout=self.timeout)

    def fetch(self, name: str, version: int = 0, sink=None) -> tuple[pb.Adapter, bytes | int]:
        """The adapter and its artifact: bytes, or the byte count written to `sink` when given."""
        adapter = None
        parts: list[bytes] = []
        size = 0
        for chunk in self.stub.FetchAdapter(pb.FetchAdapterRequest(name=name, version=version), timeout=self.timeout):
            if chunk.WhichOneof("item") == "adapter":
                adapter = chunk.adapter
                continue
            piece = chunk.data  # each read of a bytes field makes a new copy of it: read it once
            if piece.offset != size:
                raise ValueError(f"FetchAdapter chunk at offset {piece.offset}, expected {size}")
            data = piece.data
            size += len(data)
            if sink is None:
                parts.append(data)
            else:
                sink.write(data)
        if adapter is None:
            raise ValueError("FetchAdapter ended without the adapter message")
        return adapter, (b"".join(parts) if sink is None else size)


    # ---- keys and audit ----------------------------------------------------------------------

    def create_key(self, tenant: str, role: str, description: str = "") -> pb.CreateKeyResponse:
        request = pb.CreateKeyRequest(tenant=tenant, role=role, description=description)
        return self.stub.CreateKey(request, timeout=self.timeout)

    def list_keys(self) -> list[pb.ApiKey]:
        return list(self.stub.ListKeys(pb.ListKeysRequest(), timeout=self.timeout).keys)

    def revoke_key(self, key_id: str) -> pb.ApiKey:
        return self.stub.RevokeKey(pb.RevokeKeyRequest(key_id=key_id), timeout=self.timeout)

    def audit(self, limit: int = 100) -> list[pb.AuditEntry]:
        return list(self.stub.ListAudit(pb.ListAuditRequest(limit=limit), timeout=self.timeout).entries)


def _utc_time(seconds: float) -> str:
    """An epoch time as ISO 8601 in UTC (what a person reads; JSON tools parse it too)."""
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat(timespec="seconds")


def adapter_to_dict(adapter: pb.Adapter) -> dict:
    return {
        "name": adapter.name,
        "version": adapter.version,
        "digest": adapter.digest,
        "base_model": adapter.base_model,
        "rank": adapter.rank,
        "alpha": adapter.alpha,
        "scaling": adapter.scaling,
        "target_modules": list(adapter.target_modules),
        "pinned": adapter.pinned,
        "size_bytes": adapter.size_bytes,
        "created_at": _utc_time(adapter.created_at),
        "description": adapter.description,
        "labels": dict(adapter.labels),
        "tenant": adapter.tenant,
        "public": adapter.public,
    }


def adapter_json(adapter: pb.Adapter) -> str:
    return json.dumps(adapter_to_dict(adapter), indent=2, sort_keys=True)
