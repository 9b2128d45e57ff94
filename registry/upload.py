"""Receiving a RegisterAdapter upload stream into spool files, under the size limit.

The stream is: one `spec`, then `chunk`s of adapter_config.json and adapter_model.safetensors, each
file's chunks in offset order. Reading stops at the first chunk that would pass the size limit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from loraformat.peft_files import ADAPTER_FILES, CONFIG_FILE, WEIGHTS_FILE, is_pickle_weights, pickle_refusal
from loramux.grpc_server import Malformed
from loramux.v1 import registry_pb2 as pb
from registry.errors import Code, InvalidArgument, RegistryError, ResourceExhausted, quote
from registry.types import AdapterFiles, AdapterSpecIn, make_spec

T = TypeVar("T")
MAX_CHUNK_BYTES = 1 << 20
MAX_CONFIG_BYTES = 1 << 20


@dataclass
class Upload:
    spec: AdapterSpecIn
    files: AdapterFiles | None  # None when spec.source_uri names a server-side source


async def receive_upload(
    requests: AsyncIterator[pb.RegisterAdapterRequest], spool: Path, max_bytes: int, idle_timeout_s: float
) -> Upload:
    """Read the whole stream into files under spool; raises before reading past max_bytes, and when
    the client sends nothing for idle_timeout_s."""
    requests = _with_idle_timeout(requests, idle_timeout_s)
    first = await anext(requests, None)
    if isinstance(first, Malformed):
        raise InvalidArgument("RegisterAdapter: a message of the stream is not a valid protobuf message")
    if first is None or first.WhichOneof("item") != "spec":
        raise InvalidArgument("the first RegisterAdapter message must be a spec")
    spec = first.spec
    checked = spec_from_pb(spec)  # before any byte is spooled, so a bad field costs nothing
    paths = {name: spool / name for name in ADAPTER_FILES}
    sizes: dict[str, int] = {}
    total = 0
    # ExitStack closes every handle even when one close() raises (a full disk fails at the flush);
    # a handle left open would keep the deleted file's space taken.
    with contextlib.ExitStack() as handles:
        files = {}
        async for request in requests:
            chunk = _check_chunk(request, spec, sizes)
            total += len(chunk.data)
            if total > max_bytes:
                raise ResourceExhausted(
                    f"upload is over the size limit of {max_bytes} bytes; stopped reading"
                )
            if chunk.filename not in files:
                files[chunk.filename] = handles.enter_context(paths[chunk.filename].open("wb"))
            files[chunk.filename].write(chunk.data)
            sizes[chunk.filename] = sizes.get(chunk.filename, 0) + len(chunk.data)
    if spec.source_uri:
        return Upload(checked, None)
    missing = [name for name in ADAPTER_FILES if name not in sizes]
    if missing:
        raise InvalidArgument(f"upload is missing {', '.join(missing)}")
    return Upload(checked, AdapterFiles(paths[CONFIG_FILE], paths[WEIGHTS_FILE]))


async def _with_idle_timeout(requests: AsyncIterator[T], idle_timeout_s: float) -> AsyncIterator[T]:
    iterator = aiter(requests)
    while True:
        try:
            async with asyncio.timeout(idle_timeout_s):  # no extra task: gRPC's reads stay in the handler's
                item = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise RegistryError(
                f"the upload sent nothing for {idle_timeout_s:g}s and was dropped; send chunks without pausing",
                Code.DEADLINE_EXCEEDED,
            ) from None
        yield item


def spec_from_pb(s: pb.AdapterSpec) -> AdapterSpecIn:
    return make_spec(s.name, s.base_model, s.pinned, s.description, dict(s.labels), s.source_uri, s.public)


def _check_chunk(
    request: pb.RegisterAdapterRequest, spec: pb.AdapterSpec, sizes: dict[str, int]
) -> pb.FileChunk:
    if isinstance(request, Malformed):
        raise InvalidArgument("RegisterAdapter: a message of the stream is not a valid protobuf message")
    if request.WhichOneof("item") != "chunk":
        raise InvalidArgument("only the first RegisterAdapter message may be a spec")
    if spec.source_uri:
        raise InvalidArgument("spec.source_uri is set: the upload must not also send file chunks")
    chunk = request.chunk
    _check_filename(chunk.filename)
    if len(chunk.data) > MAX_CHUNK_BYTES:
        raise InvalidArgument(
            f"chunk of {chunk.filename} holds {len(chunk.data)} bytes; at most {MAX_CHUNK_BYTES}"
        )
    expected = sizes.get(chunk.filename, 0)
    if chunk.offset != expected:
        raise InvalidArgument(
            f"chunk of {chunk.filename} at offset {chunk.offset}; expected offset {expected}"
        )
    if chunk.filename == CONFIG_FILE and expected + len(chunk.data) > MAX_CONFIG_BYTES:
        raise InvalidArgument(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    return chunk


def _check_filename(filename: str) -> None:
    if filename in ADAPTER_FILES:
        return
    if is_pickle_weights(filename):
        raise InvalidArgument(pickle_refusal(filename))
    raise InvalidArgument(f"filename {quote(filename)} is not one of {', '.join(ADAPTER_FILES)}")
