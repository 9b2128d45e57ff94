"""An artifact's bytes from a FetchAdapter stream, without protobuf's copies: `chunk_data` finds each
chunk's bytes in its message as a view, `receive_artifact` hashes and copies them into place. Shared by
the engine's registry link (engine/registry_link.py) and its fetch process (engine/fetch_process.py),
so this module imports neither torch nor the engine's model code.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Iterator

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from engine.errors import NotFound, Unavailable
from loramux.v1 import registry_pb2 as pb

FETCH_TIMEOUT_S = 300.0


def unavailable(what: str, exc: grpc.aio.AioRpcError) -> Unavailable:
    return Unavailable(f"{what}: the registry is unavailable ({exc.code().name}: {exc.details()})")


async def artifact_messages(fetch_raw, name: str, version: int, ref: str, metadata) -> AsyncIterator[bytes]:
    """FetchAdapter's messages in wire format, through `fetch_raw` (the method on a channel, its
    responses left unparsed); NOT_FOUND and UNAVAILABLE naming `ref` when the registry fails."""
    request = pb.FetchAdapterRequest(name=name, version=version)
    try:
        async for raw in fetch_raw(request, timeout=FETCH_TIMEOUT_S, metadata=metadata):
            yield raw
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            raise NotFound(f"adapter {ref!r} is not registered") from None
        raise unavailable(f"adapter {ref!r}", exc) from None


async def receive_artifact(messages: AsyncIterator[bytes], artifact: Artifact, ref: str) -> str:
    """Receives FetchAdapter's messages in wire format into `artifact` and returns their sha256. The
    event loop only finds each chunk's bytes in its message; a worker thread hashes the chunk and
    copies it into place while the next one arrives (hashlib and numpy let go of the GIL), into memory sized from the
    stream's leading Adapter message, so the new pages are first touched by that copy too. Appending to
    a growing bytearray on the event loop held the GIL for 53 ms of an 84 MB fetch on the VM, mostly
    faulting in new pages. A malformed message is UNAVAILABLE naming `ref`."""
    taking = None  # the previous chunk's hash and copy; chunks are taken in order
    try:
        async for raw in messages:
            try:
                data = chunk_data(raw)
                if data is None:
                    artifact.expect(raw)
                    continue
                offset = artifact.place(len(data))
            except ValueError as exc:
                raise Unavailable(f"adapter {ref!r}: the registry sent a malformed chunk ({exc})") from None
            if taking is not None:
                await asyncio.shield(taking)  # a cancel must not leave the copy running unwaited
            taking = asyncio.ensure_future(asyncio.to_thread(artifact.take, offset, data))  # a view of its own message
        if taking is not None:
            await asyncio.shield(taking)  # the last chunk's copy: its failure is the fetch's too
            taking = None
    finally:
        if taking is not None:  # the stream failed or was cancelled: the copy's thread has ended before
            await asyncio.wait([taking])  # the caller frees the memory it writes; its outcome is read
            if not taking.cancelled():
                taking.exception()
    return artifact.sha.hexdigest()


class Artifact:
    """An artifact's bytes as they arrive, in order: `place` reserves each chunk's range on the event
    loop, `take` hashes and copies the chunk in a worker thread. The size the stream's leading Adapter
    message declares sizes the memory up front (untouched until the copies); a stream that declares
    none grows a bytearray instead. The memory is a numpy array here; `_reserve` and `_write` are what
    another kind of memory overrides (the fetch process's memfd)."""

    def __init__(self):
        self.sha = hashlib.sha256()
        self.received = 0
        self.size: int | None = None  # as declared, once the memory is reserved
        self._array: np.ndarray | None = None
        self._grown = bytearray()

    def expect(self, raw: bytes) -> None:
        """Size the memory from an Adapter message (before any data: the registry sends it first)."""
        try:
            size = pb.AdapterChunk.FromString(raw).adapter.size_bytes
        except DecodeError as exc:
            raise ValueError(f"an Adapter message that does not decode: {exc}") from None
        if size and self.size is None and not self.received:
            try:
                self._reserve(size)
            except MemoryError:
                raise ValueError(f"a declared size of {size} bytes, more than this host can hold") from None
            self.size = size

    def place(self, length: int) -> int:
        """The offset of the next chunk of `length` bytes; ValueError when it overruns the declared size."""
        offset = self.received
        if self.size is not None and offset + length > self.size:
            raise ValueError(f"{offset + length} bytes of an artifact of {self.size}")
        self.received += length
        return offset

    def take(self, offset: int, data: memoryview) -> None:
        self.sha.update(data)
        if self.size is None:
            self._grown += data
        else:
            self._write(offset, data)

    def bytes(self) -> memoryview:
        """The bytes received, writable (the safetensors reader's tensors are views of them)."""
        if self._array is None:
            return memoryview(self._grown)
        return memoryview(self._array[: self.received])

    def _reserve(self, size: int) -> None:
        """Memory for `size` bytes (MemoryError when the host cannot give it)."""
        self._array = np.empty(size, np.uint8)

    def _write(self, offset: int, data: memoryview) -> None:
        self._array[offset : offset + len(data)] = np.frombuffer(data, np.uint8)


def chunk_data(raw: bytes) -> memoryview | None:
    """The artifact bytes an `AdapterChunk` in wire format carries, as a view into `raw` (no copy), or
    None when it carries its other item; as protobuf's parse reads them, a repeated field's last value
    wins and unknown fields (a known number with another wire type included) are skipped
    (registry/servicer.py `encode_data_chunk` writes these). Raises ValueError on malformed input and
    on group fields, which nothing writing an AdapterChunk emits."""
    data = None
    for number, wire, value in _wire_fields(memoryview(raw)):
        if number == 1 and wire == 2:  # the adapter item: the oneof's other member
            data = None
        elif number == 2 and wire == 2:  # DataChunk
            data = memoryview(b"") if data is None else data
            for inner_number, inner_wire, inner in _wire_fields(value):
                if inner_number == 2 and inner_wire == 2:
                    data = inner
    return data


def _wire_fields(buf: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) of each field of one protobuf message: an int for a varint,
    a view for the other wire types."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ValueError("a field numbered 0")
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire in (1, 2, 5):
            size, pos = (8, pos) if wire == 1 else (4, pos) if wire == 5 else _varint(buf, pos)
            if pos + size > len(buf):
                raise ValueError(f"field {number} runs past the message's {len(buf)} bytes")
            value, pos = buf[pos : pos + size], pos + size
        else:
            raise ValueError(f"field {number} has wire type {wire}")
        yield number, wire, value


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(buf):
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            break
    raise ValueError("a truncated or overlong varint")

