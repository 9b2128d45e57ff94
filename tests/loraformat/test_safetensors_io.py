"""The strict safetensors reader and the deterministic streaming writer."""

from __future__ import annotations

import hashlib
import io
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from loraformat.errors import InvalidArgument, ResourceExhausted
from loraformat.safetensors_io import (
    SafetensorsFile,
    SafetensorsLimits,
    load_safetensors,
    write_safetensors,
)


def sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "b.weight": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "a.weight": torch.randn(4, 2, generator=gen),
        "c.half": torch.randn(7, generator=gen).to(torch.float16),
        "d.scalar": torch.tensor(2.5),
        "e.empty": torch.zeros(0, 3),
    }


def raw_file(header: dict | bytes, data: bytes = b"", header_len: int | None = None) -> bytes:
    """A safetensors file byte for byte, with whatever header (valid or not) the test wants."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(body) if header_len is None else header_len
    return struct.pack("<Q", length) + body + data


def f32_entry(shape: list[int], start: int) -> dict:
    numel = 1
    for dim in shape:
        numel *= dim
    return {"dtype": "F32", "shape": shape, "data_offsets": [start, start + 4 * numel]}


# ---- writer ----


def test_writer_output_loads_with_safetensors_and_equals_inputs(tmp_path: Path):
    tensors = sample_tensors()
    path = tmp_path / "out.safetensors"
    digest, size = write_safetensors(path, tensors, {"format": "x", "note": "é"})
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "x", "note": "é"}
    assert size == path.stat().st_size
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()


def test_writer_is_deterministic_sorted_and_aligned(tmp_path: Path):
    tensors = sample_tensors()
    reversed_order = dict(reversed(list(tensors.items())))
    first = write_safetensors(tmp_path / "1", tensors, {"k": "v"})
    second = write_safetensors(tmp_path / "2", reversed_order, {"k": "v"})
    raw = (tmp_path / "1").read_bytes()
    assert first == second and raw == (tmp_path / "2").read_bytes()
    header_len = struct.unpack("<Q", raw[:8])[0]
    assert header_len % 8 == 0
    header = json.loads(raw[8 : 8 + header_len])
    assert [name for name in header if name != "__metadata__"] == sorted(tensors)


def test_writer_streams_into_a_file_object():
    buffer = io.BytesIO()
    digest, size = write_safetensors(buffer, sample_tensors(), {})
    assert size == len(buffer.getvalue())
    assert digest == hashlib.sha256(buffer.getvalue()).hexdigest()


def test_writer_refuses_unsupported_dtype_naming_the_tensor(tmp_path: Path):
    with pytest.raises(InvalidArgument, match="ints"):
        write_safetensors(tmp_path / "x", {"ints": torch.zeros(2, dtype=torch.int8)}, {})


# ---- reader: valid files ----


def test_reader_reads_files_written_by_safetensors(tmp_path: Path):
    tensors = sample_tensors()
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"a": "b"})
    metadata, loaded = load_safetensors(tmp_path / "ref.safetensors")
    assert metadata == {"a": "b"}
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_reader_views_are_zero_copy_and_outlive_close(tmp_path: Path):
    tensors = sample_tensors()
    write_safetensors(tmp_path / "x", tensors, {})
    with SafetensorsFile.open(tmp_path / "x") as sf:
        view = sf.tensor("a.weight")
        again = sf.tensor("a.weight")
        assert view.data_ptr() == again.data_ptr()  # both point into the same mapping
    assert torch.equal(view, tensors["a.weight"])


def test_reader_from_buffer_matches_file(tmp_path: Path):
    write_safetensors(tmp_path / "x", sample_tensors(), {"k": "v"})
    sf = SafetensorsFile.from_buffer((tmp_path / "x").read_bytes(), "artifact")
    assert sf.metadata == {"k": "v"}
    assert torch.equal(sf.tensor("b.weight"), sample_tensors()["b.weight"])


def test_views_are_made_on_first_lookup_and_bytes_need_none(tmp_path: Path):
    """TensorViews: a mapping of the file's tensors that makes each view when first looked up (and
    keeps it), and hands out the data region's bytes, where each tensor's lie at its info's range,
    without making a view."""
    tensors = sample_tensors()
    write_safetensors(tmp_path / "x", tensors, {})
    sf = SafetensorsFile.from_buffer(bytearray((tmp_path / "x").read_bytes()), "artifact")
    made: list[str] = []
    make = sf.tensor
    sf.tensor = lambda name: made.append(name) or make(name)
    views = sf.views()
    assert sorted(views) == sorted(tensors) and len(views) == len(tensors)
    assert "a.weight" in views and "nope" not in views and views.get("nope") is None
    region = views.data_region()
    for name, tensor in tensors.items():
        info = views.info(name)
        assert region[info.start : info.end].tobytes() == tensor.reshape(-1).view(torch.uint8).numpy().tobytes(), name
        assert info.torch_dtype == tensor.dtype
    assert made == []  # bytes and metadata: no view made
    assert torch.equal(views["b.weight"], tensors["b.weight"]) and views["b.weight"] is views["b.weight"]
    assert made == ["b.weight"]
    with pytest.raises(KeyError):
        views["nope"]
    sf.close()
    with pytest.raises(ValueError, match="after close"):
        sf.views().data_region()


# ---- reader: rejections ----

ONE = {"t": f32_entry([2], 0)}
TWO_FLOATS = b"\0" * 8


def too_many_tensors() -> bytes:
    header = {f"t{i}": f32_entry([1], 4 * i) for i in range(100_000)}
    return raw_file(header, b"\0" * 400_000)


BAD_FILES = {
    "too_short": (lambda: b"\x01\x00\x00", "too short"),
    "header_over_limit": (lambda: raw_file(b"{}", header_len=17 * 1024 * 1024), "exceeds the limit"),
    "header_past_eof": (
        lambda: raw_file(json.dumps(ONE).encode(), TWO_FLOATS, header_len=4000),
        "past the end",
    ),
    "corrupted_header": (
        lambda: raw_file(b'{"t": {"dtype": "F32", "sha\xff\xfe', TWO_FLOATS),
        "not valid JSON",
    ),
    "header_not_object": (lambda: raw_file([1, 2, 3]), "not a JSON object"),
    "duplicate_names": (
        lambda: raw_file(b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"t":{}}', b"\0" * 4),
        "duplicate keys ['t']",
    ),
    "nan_in_header": (lambda: raw_file(b'{"__metadata__":{"a":NaN}}'), "NaN"),
    "too_many_tensors": (too_many_tensors, "100000 tensors exceeds the limit of 4096"),
    "missing_dtype": (
        lambda: raw_file({"t": {"shape": [2], "data_offsets": [0, 8]}}, TWO_FLOATS),
        "'t': missing dtype",
    ),
    "missing_offsets": (
        lambda: raw_file({"t": {"dtype": "F32", "shape": [2]}}, TWO_FLOATS),
        "'t': missing data_offsets",
    ),
    "negative_shape": (
        lambda: raw_file({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, TWO_FLOATS),
        "'t': shape",
    ),
    "float_shape": (
        lambda: raw_file({"t": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, TWO_FLOATS),
        "'t': shape",
    ),
    "offsets_disagree_with_shape": (
        lambda: raw_file({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, TWO_FLOATS),
        "'t': data_offsets [0, 8] hold 8 bytes",
    ),
    "truncated_data": (
        lambda: raw_file(ONE, TWO_FLOATS[:5]),
        "'t': data_offsets [0, 8] run past the data region",
    ),
    "overlap": (
        lambda: raw_file({"a": f32_entry([2], 0), "b": f32_entry([2], 4)}, b"\0" * 12),
        "tensors 'a' and 'b' overlap",
    ),
    "hole": (lambda: raw_file({"a": f32_entry([1], 0), "b": f32_entry([1], 8)}, b"\0" * 12), "before 'b'"),
    "trailing_bytes": (lambda: raw_file(ONE, TWO_FLOATS + b"junk"), "4 bytes after the last tensor"),
    "int8": (
        lambda: raw_file({"q": {"dtype": "I8", "shape": [2], "data_offsets": [0, 2]}}, b"\0\0"),
        "tensor 'q': dtype 'I8' is not supported",
    ),
    "float64": (
        lambda: raw_file({"d": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}}, TWO_FLOATS),
        "'d': dtype 'F64'",
    ),
    "metadata_not_str": (lambda: raw_file({"__metadata__": {"epoch": 3}}), "__metadata__['epoch']"),
    "torch_zip": (lambda: b"PK\x03\x04" + b"\0" * 60, "torch.save zip archive"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_reader_rejects(tmp_path: Path, case: str):
    make, expected = BAD_FILES[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(make())
    with pytest.raises(InvalidArgument) as info:
        SafetensorsFile.open(path)
    assert expected in str(info.value)
    assert "bad.safetensors" in str(info.value)  # the file is always named


def test_reader_limits_are_parameters(tmp_path: Path):
    path = tmp_path / "x.safetensors"
    write_safetensors(path, sample_tensors(), {})
    with pytest.raises(InvalidArgument, match="5 tensors exceeds the limit of 4"):
        SafetensorsFile.open(path, SafetensorsLimits(max_tensors=4))
    with pytest.raises(InvalidArgument, match="exceeds the limit of 16 bytes"):
        SafetensorsFile.open(path, SafetensorsLimits(max_header_bytes=16))
    with pytest.raises(ResourceExhausted, match=r"x\.safetensors"):
        SafetensorsFile.open(path, SafetensorsLimits(max_file_bytes=100))


def test_parsed_headers_are_kept_within_a_count_and_a_byte_bound():
    """The reader's header cache keeps at most `size` headers and `max_bytes` of header bytes, the least
    recently used going first, and never one over a quarter of the bytes: a client's uploads choose
    their headers, each up to the reader's limit."""
    from loraformat.safetensors_io import ParsedHeader, _ParsedHeaders

    headers = _ParsedHeaders(size=3, max_bytes=400)  # headers of no tensors: counted as their bytes alone
    parsed = {n: ParsedHeader({}, {}) for n in "abcdef"}
    for n in "abc":
        assert headers.put((n.encode() * 60, 0, None), parsed[n]) is parsed[n]
    assert len(headers) == 3 and headers.nbytes == 180
    assert headers.get((b"a" * 60, 0, None)) is parsed["a"]  # a is now the most recent
    assert headers.put((b"a" * 60, 0, None), ParsedHeader({}, {})) is parsed["a"]  # the first kept stays
    headers.put((b"d" * 60, 0, None), parsed["d"])  # over the count: b, the least recent, goes
    assert headers.get((b"b" * 60, 0, None)) is None and len(headers) == 3
    headers.put((b"e" * 100, 0, None), parsed["e"])  # over the count again: c goes
    headers.put((b"f" * 100, 0, None), parsed["f"])  # and then a; d, e and f hold 260 bytes
    assert [headers.get((n.encode() * k, 0, None)) is not None for n, k in (("a", 60), ("d", 60), ("e", 100), ("f", 100))] == [False, True, True, True]
    assert headers.nbytes == 260
    big = ParsedHeader({}, {})
    assert headers.put((b"g" * 101, 0, None), big) is big and headers.get((b"g" * 101, 0, None)) is None  # over 400 / 4: not kept
    by_bytes = _ParsedHeaders(size=10, max_bytes=250)  # the byte bound alone
    for n in "xyzw":
        by_bytes.put((n.encode() * 60, 0, None), ParsedHeader({}, {}))  # 240 bytes: within
    by_bytes.put((b"v" * 60, 0, None), ParsedHeader({}, {}))  # 300 > 250: x, the least recent, goes
    assert by_bytes.nbytes == 240 and len(by_bytes) == 4 and by_bytes.get((b"x" * 60, 0, None)) is None
    # a tensor's parsed entry counts beside the header's bytes: a header of many small tensors is bounded too
    from loraformat.safetensors_io import PARSED_ENTRY_BYTES, TensorInfo

    infos = {f"t{i}": TensorInfo(f"t{i}", "F32", (1,), 4 * i, 4 * i + 4) for i in range(3)}
    per_entry = _ParsedHeaders(size=10, max_bytes=4 * (60 + 3 * PARSED_ENTRY_BYTES))
    kept = ParsedHeader({}, infos)
    assert per_entry.put((b"a" * 60, 12, None), kept) is kept and per_entry.nbytes == 60 + 3 * PARSED_ENTRY_BYTES
    bigger = ParsedHeader({}, infos | {"t3": TensorInfo("t3", "F32", (1,), 12, 16)})  # over a quarter: not kept
    assert per_entry.put((b"b" * 60, 16, None), bigger) is bigger and per_entry.get((b"b" * 60, 16, None)) is None
