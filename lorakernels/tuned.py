"""Tile configurations of the LoRA kernels, tuned per device and shape and kept in JSON files.

`benchmarks/tune_lora_tiles.py` times candidate tiles on a GPU the way the engine runs them (a decode
step's kernels beside the base GEMM, a prefill step's in line) and writes the fastest to
`lorakernels/configs/<device>.json`, the device named as `torch.cuda.get_device_name` names it with every
run of other characters made one `_` ("NVIDIA H200" -> `NVIDIA_H200.json`). The kernels look their
launch up here by host ints only (the shape and the step's token count), so a captured CUDA graph keeps
the tile it was captured with; with no file for the device, or no entry for the shape, they keep their
built-in tiles. The kernels: "shrink" and "expand" of decode-sized steps (lorakernels/sgmv_decode.py),
"sgmv_shrink" and "sgmv_expand" of prefill-sized ones (lorakernels/sgmv.py).

A file, one entry per kernel, shape and token count (`tokens`: the step's rows; a step of T rows takes
the entry of the largest tuned count <= T, and none, so the built-in tile, when T is below every tuned
count: prefill tiles tuned from 256 rows never serve a 32-row step):

    {"device": "NVIDIA H200", "triton": "3.6.0", "entries": [
        {"kernel": "shrink", "in_dim": 4096, "num_stack": 3, "max_rank": 16, "tokens": 32,
         "config": {"num_programs": 88, "block_k": 128, "num_warps": 4}},
        {"kernel": "expand", "out_dim": 4096, "num_stack": 3, "max_rank": 16, "tokens": 32,
         "config": {"block_n": 128, "num_warps": 4}},
        {"kernel": "sgmv_shrink", "in_dim": 14336, "num_stack": 1, "max_rank": 64, "tokens": 2048,
         "config": {"block_m": 64, "block_n": 16, "block_k": 128, "num_warps": 4, "num_stages": 3, "split_k": 2}}]}

`out_dim` of an expand is its widest output slice (the fused target's widest projection). Other keys of
an entry (the tuner's timings) are kept for people and ignored here. The parser admits only tiles the
kernels can run on any GPU of the kind: a decode shrink of at most MAX_DECODE_PROGRAMS programs and
BLOCK_K >= 64 (its fp32 split workspace is splits x T x R), a prefill tile whose pipelined operand tiles
fit SGMV_SMEM_BYTES of shared memory; `split_k` (a prefill shrink's split of in_dim, 1 when left out)
one of SPLIT_K_CHOICES, and 1 for an expand.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_DIR = Path(__file__).parent / "configs"
NUM_WARPS_CHOICES = (1, 2, 4, 8)
MAX_DECODE_PROGRAMS = 2048  # per stacked target: 8 an SM on a 256-SM GPU
SGMV_SMEM_BYTES = 200 * 1024  # below an H100/H200's 227 KB a block, with room for Triton's own
SGMV_ELEMENT_BYTES = 2  # bf16/fp16, what the engine serves


@dataclass(frozen=True)
class ShrinkTile:  # the decode shrink (lorakernels/sgmv_decode.py)
    num_programs: int  # programs per stacked target that share the step's segments' splits
    block_k: int  # input columns a tensor-core dot covers
    num_warps: int


@dataclass(frozen=True)
class ExpandTile:  # the decode expand (lorakernels/sgmv_decode.py)
    block_n: int  # output columns a program covers
    num_warps: int


@dataclass(frozen=True)
class SgmvTile:  # the shrink and expand of prefill-sized steps (lorakernels/sgmv.py)
    block_m: int  # a segment's rows a program covers (fewer where segments are shorter)
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # A shrink's programs per tile that split in_dim between them (their fp32 partials summed by a second
    # kernel): more programs where a step's row blocks are fewer than the SMs. Expands keep 1
    split_k: int = 1

    @property
    def smem_bytes(self) -> int:
        """Shared memory its software pipeline holds: num_stages copies of the input and weight tiles."""
        return self.num_stages * (self.block_m * self.block_k + self.block_k * self.block_n) * SGMV_ELEMENT_BYTES


# kernel -> (its shape's keys, its tile, each tile field's allowed values)
KINDS: dict[str, tuple[tuple[str, ...], type, dict[str, tuple[int, ...] | range]]] = {
    "shrink": (
        ("in_dim", "num_stack", "max_rank"),
        ShrinkTile,
        {"num_programs": range(1, MAX_DECODE_PROGRAMS + 1), "block_k": (64, 128, 256), "num_warps": NUM_WARPS_CHOICES},
    ),
    "expand": (
        ("out_dim", "num_stack", "max_rank"),
        ExpandTile,
        {"block_n": (16, 32, 64, 128, 256), "num_warps": NUM_WARPS_CHOICES},
    ),
}
_SGMV_FIELDS = {
    "block_m": (16, 32, 64, 128),
    "block_n": (16, 32, 64, 128, 256),
    "block_k": (16, 32, 64, 128, 256),
    "num_warps": NUM_WARPS_CHOICES,
    "num_stages": (1, 2, 3, 4),
}
KINDS["sgmv_shrink"] = (("in_dim", "num_stack", "max_rank"), SgmvTile, _SGMV_FIELDS)
KINDS["sgmv_expand"] = (("out_dim", "num_stack", "max_rank"), SgmvTile, _SGMV_FIELDS)
SPLIT_K_CHOICES = (1, 2, 4, 8, 16)
# kernel -> {tile field a config may leave out: (its allowed values, its value when left out)}
OPTIONAL: dict[str, dict[str, tuple[tuple[int, ...], int]]] = {
    "sgmv_shrink": {"split_k": (SPLIT_K_CHOICES, 1)},
    "sgmv_expand": {"split_k": ((1,), 1)},
}


def graph_median_us(fn: Callable[[int], object], device: torch.device, calls: int, replays: int) -> float:
    """Median microseconds a call of fn(i) on a CUDA device: fn(0..calls-1) captured in one graph (after
    one call outside it, which compiles and sets up cuBLAS), replayed `replays` times. What the tuners time
    (benchmarks/tune_lora_tiles.py, engine/carved_gemms.py): the launches as a captured step makes them."""
    fn(0)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


class TunedTiles:
    """A device's tuned entries: (kernel, shape) -> token counts ascending and their tiles."""

    def __init__(self, entries: dict[tuple, list[tuple[int, object]]]):
        self._entries = {key: sorted(rows, key=lambda row: row[0]) for key, rows in entries.items()}

    def __len__(self) -> int:
        return sum(len(rows) for rows in self._entries.values())

    def lookup(self, kernel: str, dim: int, num_stack: int, max_rank: int, num_tokens: int):
        """The tile of `kernel` (a key of KINDS) at this shape (dim: its in_dim, or its widest output
        slice for an expand) for a step of num_tokens rows: the largest tuned count's at or below it;
        None where none was tuned."""
        rows = self._entries.get((kernel, dim, num_stack, max_rank))
        i = bisect.bisect_right([tokens for tokens, _ in rows], num_tokens) if rows else 0
        return rows[i - 1][1] if i else None


NO_TILES = TunedTiles({})


def device_file_name(device_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json"


def parse(doc: object, source: str) -> TunedTiles:
    """A tuned file's content -> its tiles; ValueError naming `source` and the entry for anything that
    is not a valid entry (a bad file is refused whole, never half used)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
        raise ValueError(f"{source}: expected an object with an 'entries' list")
    entries: dict[tuple, list] = {}
    for i, entry in enumerate(doc["entries"]):
        try:
            key, tokens, tile = _entry(entry)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: entry {i}: {exc}") from None
        rows = entries.setdefault(key, [])
        if any(t == tokens for t, _ in rows):
            raise ValueError(f"{source}: entry {i}: a second entry for {key} at {tokens} tokens")
        rows.append((tokens, tile))
    return TunedTiles(entries)


def _entry(entry: dict) -> tuple[tuple, int, object]:
    if not isinstance(entry, dict):
        raise TypeError("not an object")
    kernel = entry["kernel"]
    if kernel not in KINDS:
        raise ValueError(f"unknown kernel {kernel!r} (expected one of {sorted(KINDS)})")
    shape_keys, tile_class, fields = KINDS[kernel]
    key = (kernel, *(_positive(entry, name) for name in shape_keys))
    tokens = _positive(entry, "tokens")
    config = entry["config"]
    if not isinstance(config, dict):
        raise TypeError("'config' is not an object")
    values = {name: _choice(config, name, choices) for name, choices in fields.items()}
    for name, (choices, default) in OPTIONAL.get(kernel, {}).items():
        values[name] = _choice(config, name, choices) if name in config else default
    tile = tile_class(**values)
    if isinstance(tile, SgmvTile) and tile.smem_bytes > SGMV_SMEM_BYTES:
        raise ValueError(f"{tile} needs {tile.smem_bytes} bytes of shared memory, over {SGMV_SMEM_BYTES}")
    return key, tokens, tile


def _positive(obj: dict, name: str) -> int:
    value = obj[name]
    if type(value) is not int or value <= 0:
        raise ValueError(f"{name!r} must be a positive integer, got {value!r}")
    return value


def _choice(obj: dict, name: str, choices: tuple[int, ...] | range) -> int:
    value = obj[name]
    if type(value) is not int or value not in choices:
        allowed = f"{choices.start}-{choices.stop - 1}" if isinstance(choices, range) else f"one of {choices}"
        raise ValueError(f"{name!r} must be {allowed}, got {value!r}")
    return value


def load_file(path: Path) -> TunedTiles:
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    return parse(doc, str(path))


_dir = DEFAULT_DIR


def use_dir(directory: Path | str | None) -> None:
    """Look tuned files up in `directory` from now on (None: the package's own); the engine's
    --kernel-configs. Files already read are read again."""
    global _dir
    _dir = Path(directory) if directory is not None else DEFAULT_DIR
    tiles_for.cache_clear()


def config_dir() -> Path:
    return _dir


@functools.cache
def tiles_for(device_name: str) -> TunedTiles:
    path = _dir / device_file_name(device_name)
    return load_file(path) if path.is_file() else NO_TILES


@functools.cache
def device_sms(device: torch.device) -> int:
    """SMs of a CUDA device (asked once per device: the launches that size grids by it run every step);
    0 elsewhere (Triton's CPU interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def device_tiles(device: torch.device) -> TunedTiles:
    """The tuned tiles of `device` (a CUDA device by its name; any other by its type, "cpu": no such
    file ships, so the interpreter keeps the built-in tiles unless a test writes one)."""
    return tiles_for(device_name(device))


def describe(device: torch.device) -> str:
    """Which tiles `device` runs, for benchmark reports: its tuned file and entry count, or "built-in"."""
    path = _dir / device_file_name(device_name(device))
    tiles = device_tiles(device)
    return f"{path} ({len(tiles)} entries)" if len(tiles) else "built-in"


@functools.cache
def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
