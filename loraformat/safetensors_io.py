"""A strict safetensors reader and a deterministic, streaming safetensors writer.

Layout of a file: `[8-byte little-endian N][N bytes of JSON header][data region]`. The header maps each
tensor name to `{"dtype", "shape", "data_offsets": [start, end]}`, offsets relative to the data region,
plus an optional `"__metadata__"` object of str -> str.

The reader trusts nothing: every tensor must lie inside the data region, tensors must tile it exactly
(no overlaps, no holes, no trailing bytes), and only F16/BF16/F32 are accepted. Tensors come back as
zero-copy views (`torch.frombuffer`) over a private memory map, so a 1 GB adapter is never copied whole.
Pure code: no databases, object stores or gRPC; the registry and the engine both import it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import threading
import types
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from loraformat import bounded_json
from loraformat.errors import InvalidArgument, ResourceExhausted, quote

DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}
METADATA_KEY = "__metadata__"
_REQUIRED_FIELDS = ("dtype", "shape", "data_offsets")


@dataclass(frozen=True)
class SafetensorsLimits:
    max_header_bytes: int = 16 * 1024 * 1024
    max_tensors: int = 4096
    # None: no limit here; the servicer enforces the upload limit while it receives bytes.
    max_file_bytes: int | None = None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors code: F16 | BF16 | F32
    shape: tuple[int, ...]
    start: int  # byte range [start, end) inside the data region
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


HEADER_CACHE_SIZE = 64  # parsed headers kept (_ParsedHeaders) at most
HEADER_CACHE_BYTES = 16 << 20  # and their bytes together at most, as _ParsedHeaders counts them
PARSED_ENTRY_BYTES = 512  # what one tensor's parsed entry holds beyond its header bytes, about (tracemalloc: ~400)


@dataclass(frozen=True, eq=False)
class ParsedHeader:
    """A header that parsed and passed every check, for a data region of its size: read-only, and
    shared by every file whose header bytes and data size are the same (`_ParsedHeaders`).

    `derived` keeps what readers compute from the header alone, each under a key of its own (the
    canonical artifact's fields checked against a model shape, a packing plan), so that it too is
    computed once per header. Only results that passed their checks go there."""

    metadata: Mapping[str, str]
    infos: Mapping[str, TensorInfo]
    derived: dict[Hashable, Any] = field(default_factory=dict, repr=False)

    def derive(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """`compute()` the first time `key` is asked for (an exception keeps nothing), kept after that.
        Two threads may both compute it once; either result is the same."""
        try:
            return self.derived[key]
        except KeyError:
            value = self.derived[key] = compute()
            return value


class _ParsedHeaders:
    """The latest parsed headers, by (header bytes, data region size, limits). The adapters of one
    base model, rank, alpha and targets share their artifact header byte for byte, and parsing and
    checking one is pure Python, a few calls per tensor (some 128 tensors for a q/v adapter of a
    32-layer model): a reader of thousands of them (the engine, which does it on threads beside its
    loop, under the GIL) parses each distinct header once. A header that fails is not kept: its error
    names the file it came from. At most `size` headers and `max_bytes` are kept, a header counted as
    its bytes and PARSED_ENTRY_BYTES for each tensor (a client's uploads choose their headers, up to the
    reader's limit each), the least recently used going first; a header over a quarter of `max_bytes`
    is never kept. What is derived from a header (ParsedHeader.derive) is not counted: a few values per
    model shape and target. Thread-safe."""

    def __init__(self, size: int, max_bytes: int = HEADER_CACHE_BYTES):
        self.size = size
        self.max_bytes = max_bytes
        self._headers: OrderedDict[tuple, ParsedHeader] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.num_hits = self.num_misses = 0

    def get(self, key: tuple) -> ParsedHeader | None:
        with self._lock:
            header = self._headers.get(key)
            if header is None:
                self.num_misses += 1
                return None
            self._headers.move_to_end(key)
            self.num_hits += 1
            return header

    def put(self, key: tuple, header: ParsedHeader) -> ParsedHeader:
        """Keep `header` (key: its raw bytes first), or return the one another thread kept first."""
        nbytes = _counted(key, header)
        if nbytes > self.max_bytes // 4:
            return header
        with self._lock:
            kept = self._headers.get(key)
            if kept is not None:
                self._headers.move_to_end(key)
                return kept
            self._headers[key] = header
            self._bytes += nbytes
            while len(self._headers) > self.size or self._bytes > self.max_bytes:
                self._bytes -= _counted(*self._headers.popitem(last=False))
            return header

    def __len__(self) -> int:
        return len(self._headers)

    @property
    def nbytes(self) -> int:
        """The bytes the headers kept count for (their own, and PARSED_ENTRY_BYTES a tensor)."""
        return self._bytes


def _counted(key: tuple, header: ParsedHeader) -> int:
    return len(key[0]) + PARSED_ENTRY_BYTES * len(header.infos)


_HEADERS = _ParsedHeaders(HEADER_CACHE_SIZE)


@dataclass(frozen=True)
class TensorSpec:
    """What the writer needs to lay out a tensor before its bytes exist."""

    dtype: torch.dtype
    shape: tuple[int, ...]


class SafetensorsFile:
    """A validated safetensors file: header, metadata and lazy zero-copy tensor views."""

    def __init__(self, label: str, buffer: Any, data_start: int, limits: SafetensorsLimits):
        self.label = label
        self._buffer = buffer
        self._data_start = data_start
        self.header = _parse_header(label, buffer, data_start, limits)
        self.metadata = dict(self.header.metadata)
        self.infos = self.header.infos

    @classmethod
    def open(cls, path: str | os.PathLike[str], limits: SafetensorsLimits | None = None) -> SafetensorsFile:
        limits = limits or SafetensorsLimits()
        label = Path(path).name
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            _check_file_size(label, size, limits)
            # ACCESS_COPY: the views are writable (torch.frombuffer wants that) yet writes stay private
            # to this process, and nothing is read from disk until a tensor is touched.
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return cls(label, buffer, _data_start(label, buffer, limits), limits)

    @classmethod
    def from_buffer(
        cls, data: bytes | bytearray | memoryview, label: str, limits: SafetensorsLimits | None = None
    ) -> SafetensorsFile:
        """From bytes in memory: a bytearray or a writable byte view is read in place; anything else
        (`bytes`) is copied once into a writable bytearray for the views."""
        limits = limits or SafetensorsLimits()
        writable = isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly)
        buffer = data if writable else bytearray(data)
        _check_file_size(label, len(buffer), limits)
        return cls(label, buffer, _data_start(label, buffer, limits), limits)

    @property
    def names(self) -> list[str]:
        return sorted(self.infos)

    def tensor(self, name: str) -> torch.Tensor:
        """A view of the tensor's bytes; it keeps the mapping alive on its own."""
        info = self.infos.get(name)
        if info is None:
            raise InvalidArgument(f"{self.label}: no tensor named {quote(name)}")
        if self._buffer is None:
            raise ValueError(f"{self.label}: read after close()")
        if info.numel == 0:
            return torch.empty(info.shape, dtype=info.torch_dtype)
        flat = torch.frombuffer(
            self._buffer, dtype=info.torch_dtype, count=info.numel, offset=self._data_start + info.start
        )
        return flat.view(info.shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: self.tensor(name) for name in self.names}

    def data_region(self) -> np.ndarray:
        """The bytes after the header, uint8, a view of the buffer (no copy)."""
        if self._buffer is None:
            raise ValueError(f"{self.label}: read after close()")
        return np.frombuffer(self._buffer, np.uint8, offset=self._data_start)

    def views(self) -> TensorViews:
        """name -> tensor view, each made when first looked up (TensorViews)."""
        return TensorViews(self)

    def close(self) -> None:
        # Never mmap.close(): torch.frombuffer keeps a reference to the mmap object but no buffer
        # export, so unmapping under a live view would crash. The views own the mapping; it goes
        # away with the last of them.
        self._buffer = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TensorViews(Mapping[str, torch.Tensor]):
    """A SafetensorsFile's tensors by name, each view made on first lookup and kept, plus the data
    region's bytes as one numpy array (`data_region`; each tensor's bytes lie at its info's [start,
    end)).

    Making a view is two torch calls, and each torch call lets go of the GIL and must take it back: a
    reader beside busy threads (the engine's packing threads beside its loop) waits up to a switch
    interval for each. A reader that wants bytes (engine/adapter_cache.py pack_adapter) reads them from
    the region and makes no view at all. Lookups from several threads may each make a view of one
    name; both are views of the same bytes."""

    def __init__(self, sf: SafetensorsFile):
        self._sf = sf
        self._views: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        view = self._views.get(name)
        if view is None:
            if name not in self._sf.infos:
                raise KeyError(name)
            view = self._views[name] = self._sf.tensor(name)
        return view

    def __contains__(self, name: object) -> bool:
        return name in self._sf.infos

    def __iter__(self) -> Iterator[str]:
        return iter(self._sf.names)

    def __len__(self) -> int:
        return len(self._sf.infos)

    def info(self, name: str) -> TensorInfo:
        return self._sf.infos[name]

    @property
    def header(self) -> ParsedHeader:
        """The file's parsed header, shared with every file of the same header (ParsedHeader.derive)."""
        return self._sf.header

    def data_region(self) -> np.ndarray:
        """The data region's bytes, uint8, without a copy (numpy: no torch call)."""
        return self._sf.data_region()


def load_safetensors(
    path: str | os.PathLike[str], limits: SafetensorsLimits | None = None
) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, name -> tensor view) of a validated file."""
    sf = SafetensorsFile.open(path, limits)
    return sf.metadata, sf.tensors()


# ---- reading: header validation ----


def _check_file_size(label: str, size: int, limits: SafetensorsLimits) -> None:
    if size < 8:
        raise InvalidArgument(f"{label}: {size} bytes is too short for a safetensors file (needs 8+)")
    if limits.max_file_bytes is not None and size > limits.max_file_bytes:
        raise ResourceExhausted(f"{label}: {size} bytes exceeds the limit of {limits.max_file_bytes} bytes")


def _data_start(label: str, buffer: Any, limits: SafetensorsLimits) -> int:
    header_len = int.from_bytes(buffer[:8], "little")
    if header_len > limits.max_header_bytes:
        raise InvalidArgument(
            f"{label}: header length {header_len} exceeds the limit of {limits.max_header_bytes} bytes"
            + _format_hint(buffer)
        )
    if 8 + header_len > len(buffer):
        raise InvalidArgument(
            f"{label}: header length {header_len} runs past the end of the file ({len(buffer)} bytes)"
            + _format_hint(buffer)
        )
    return 8 + header_len


def _format_hint(buffer: Any) -> str:
    # Only used on a failure path: a pickle's 0x80 could also start a valid header length.
    magic = bytes(buffer[:2])
    if magic == b"PK":
        return "; this looks like a torch.save zip archive: convert it to safetensors"
    if magic[:1] == b"\x80":
        return "; this looks like a pickle: convert it to safetensors"
    return ""


def _parse_header(label: str, buffer: Any, data_start: int, limits: SafetensorsLimits) -> ParsedHeader:
    raw = bytes(buffer[8:data_start])
    data_len = len(buffer) - data_start
    key = (raw, data_len, limits)
    parsed = _HEADERS.get(key)
    if parsed is not None:
        return parsed
    header = _load_header_json(label, raw, buffer)
    metadata = _parse_metadata(label, header.pop(METADATA_KEY, None))
    if len(header) > limits.max_tensors:
        raise InvalidArgument(f"{label}: {len(header)} tensors exceeds the limit of {limits.max_tensors}")
    infos = {name: _parse_entry(label, name, entry, data_len) for name, entry in header.items()}
    _check_layout(label, infos, data_len)
    return _HEADERS.put(key, ParsedHeader(types.MappingProxyType(dict(metadata)), types.MappingProxyType(infos)))


def _load_header_json(label: str, raw: bytes, buffer: Any) -> dict[str, Any]:
    try:
        # A header is three levels deep ({name: {"shape": [...]}}); anything deeper is not one.
        header = bounded_json.loads(
            raw, f"{label}: header", max_depth=4, object_pairs_hook=_no_duplicates, parse_constant=_no_nan
        )
    except InvalidArgument as err:
        raise InvalidArgument(f"{err}" + _format_hint(buffer)) from None
    if not isinstance(header, dict):
        raise InvalidArgument(f"{label}: header is not a JSON object")
    return header


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        duplicates = sorted(key for key, count in Counter(key for key, _ in pairs).items() if count > 1)
        raise ValueError(f"duplicate keys {duplicates}")
    return result


def _no_nan(token: str) -> None:
    raise ValueError(f"{token} is not JSON")


def _parse_metadata(label: str, raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{label}: {METADATA_KEY} is not an object")
    for key, value in raw.items():
        if not isinstance(value, str):
            raise InvalidArgument(f"{label}: {METADATA_KEY}[{quote(key)}] is not a string")
    return raw


def _parse_entry(label: str, name: str, entry: Any, data_len: int) -> TensorInfo:
    where = f"{label}: tensor {quote(name)}"
    if not isinstance(entry, dict):
        raise InvalidArgument(f"{where}: entry is not an object")
    missing = [field for field in _REQUIRED_FIELDS if field not in entry]
    if missing:
        raise InvalidArgument(f"{where}: missing {', '.join(missing)}")
    dtype = entry["dtype"]
    if dtype not in DTYPES:
        raise InvalidArgument(f"{where}: dtype {dtype!r} is not supported (F16, BF16, F32)")
    shape = _int_list(where, "shape", entry["shape"])
    offsets = _int_list(where, "data_offsets", entry["data_offsets"])
    if len(offsets) != 2:
        raise InvalidArgument(f"{where}: data_offsets must be [start, end], got {offsets}")
    info = TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])
    _check_extent(where, info, data_len)
    return info


def _int_list(where: str, field: str, value: Any) -> list[int]:
    if not isinstance(value, list) or not all(_is_count(v) for v in value):
        raise InvalidArgument(f"{where}: {field} must be a list of non-negative integers, got {value!r}")
    return value


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_extent(where: str, info: TensorInfo, data_len: int) -> None:
    nbytes = info.numel * info.torch_dtype.itemsize
    if info.end - info.start != nbytes:
        raise InvalidArgument(
            f"{where}: data_offsets [{info.start}, {info.end}] hold {info.end - info.start} bytes, "
            f"but {info.dtype} {list(info.shape)} needs {nbytes}"
        )
    if info.end > data_len:
        raise InvalidArgument(
            f"{where}: data_offsets [{info.start}, {info.end}] run past the data region "
            f"({data_len} bytes): the file is truncated"
        )


def _check_layout(label: str, infos: dict[str, TensorInfo], data_len: int) -> None:
    """The tensors must tile the data region exactly: [0, data_len) with no overlap and no hole."""
    covered, previous = 0, None
    for info in sorted(infos.values(), key=lambda i: (i.start, i.end)):
        if info.start < covered:
            raise InvalidArgument(f"{label}: tensors {quote(previous)} and {quote(info.name)} overlap")
        if info.start > covered:
            raise InvalidArgument(
                f"{label}: hole of {info.start - covered} bytes in the data region before {quote(info.name)}"
            )
        covered, previous = info.end, info.name
    if covered != data_len:
        raise InvalidArgument(
            f"{label}: data region not fully covered: {data_len - covered} bytes after the last tensor"
        )


# ---- writing ----


def write_safetensors(
    dest: str | os.PathLike[str] | IO[bytes], tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
) -> tuple[str, int]:
    """Writes `tensors` (sorted by name) and `metadata`; returns (sha256 hex, size in bytes)."""
    specs = {name: TensorSpec(t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    return write_safetensors_lazy(dest, specs, tensors.__getitem__, metadata)


def write_safetensors_lazy(
    dest: str | os.PathLike[str] | IO[bytes],
    specs: Mapping[str, TensorSpec],
    produce: Callable[[str], torch.Tensor],
    metadata: Mapping[str, str],
) -> tuple[str, int]:
    """Like `write_safetensors`, but asks `produce(name)` for each tensor only when its bytes are due,
    so at most one tensor is alive at a time. Same inputs -> same bytes."""
    header = encode_header(specs, metadata)
    with _open_dest(dest) as f:
        sink = _HashingWriter(f)
        sink.write(len(header).to_bytes(8, "little"))
        sink.write(header)
        for name in sorted(specs):
            sink.write(_tensor_bytes(name, produce(name), specs[name]))
    return sink.hexdigest(), sink.size


def encode_header(specs: Mapping[str, TensorSpec], metadata: Mapping[str, str]) -> bytes:
    """The JSON header, padded with spaces to a multiple of 8 so the data region starts aligned."""
    header: dict[str, Any] = {}
    if metadata:
        header[METADATA_KEY] = _checked_metadata(metadata)
    offset = 0
    for name in sorted(specs):
        spec = specs[name]
        if name == METADATA_KEY or spec.dtype not in DTYPE_CODES:
            raise InvalidArgument(f"tensor {quote(name)}: cannot write name or dtype {spec.dtype}")
        nbytes = _numel(spec.shape) * spec.dtype.itemsize
        entry = {"dtype": DTYPE_CODES[spec.dtype], "shape": list(spec.shape)}
        header[name] = entry | {"data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)


def _checked_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidArgument(f"metadata entry {quote(key)}: keys and values must be strings")
    return dict(metadata)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _tensor_bytes(name: str, tensor: torch.Tensor, spec: TensorSpec) -> memoryview:
    if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
        raise InvalidArgument(
            f"tensor {quote(name)}: produced {tensor.dtype} {list(tensor.shape)}, "
            f"header promised {spec.dtype} {list(spec.shape)}"
        )
    # Raw little-endian bytes without an extra copy when the tensor is already contiguous on the CPU.
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


@contextlib.contextmanager
def _open_dest(dest: str | os.PathLike[str] | IO[bytes]) -> Iterator[IO[bytes]]:
    if isinstance(dest, str | os.PathLike):
        with open(dest, "wb") as f:
            yield f
    else:
        yield dest


class _HashingWriter:
    """Writes through to a file while hashing and counting, so the file is never held in memory."""

    def __init__(self, f: IO[bytes]):
        self._f = f
        self._sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | memoryview) -> None:
        self._f.write(data)
        self._sha.update(data)
        self.size += len(data)

    def hexdigest(self) -> str:
        return self._sha.hexdigest()
