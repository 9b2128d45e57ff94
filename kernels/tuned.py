"""Tile configurations of the decode LoRA kernels, tuned per device and shape and kept in JSON files.

`benchmarks/tune_decode_lora.py` times candidate configurations on a GPU (beside the base GEMM, as the
engine runs them) and writes the fastest to `kernels/configs/<device>.json`, the device named as
`torch.cuda.get_device_name` names it with every run of other characters made one `_` ("NVIDIA H200" ->
`NVIDIA_H200.json`). The kernels (kernels/sgmv_decode.py) look their launch up here by host ints only
(the shape and the step's token count), so a captured CUDA graph keeps the configuration it was captured
with; with no file for the device, or no entry for the shape, they keep their built-in configuration.

A file, one entry per kernel, shape and token count (`tokens`: the step's rows; a step of T rows takes
the entry of the least tuned count >= T, or of the largest when T is past them all):

    {"device": "NVIDIA H200", "triton": "3.6.0", "entries": [
        {"kernel": "shrink", "in_dim": 4096, "num_stack": 3, "max_rank": 16, "tokens": 32,
         "config": {"num_programs": 88, "block_k": 128, "num_warps": 4}},
        {"kernel": "expand", "out_dim": 4096, "num_stack": 3, "max_rank": 16, "tokens": 32,
         "config": {"block_n": 128, "num_warps": 4}}]}

`out_dim` of an expand is its widest output slice (the fused target's widest projection). Other keys of
an entry (the tuner's timings) are kept for people and ignored here.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_DIR = Path(__file__).parent / "configs"
BLOCK_K_CHOICES = (32, 64, 128, 256)
BLOCK_N_CHOICES = (16, 32, 64, 128, 256)
NUM_WARPS_CHOICES = (1, 2, 4, 8)


@dataclass(frozen=True)
class ShrinkTile:
    num_programs: int  # programs per stacked target that share the step's segments' splits
    block_k: int  # input columns a tensor-core dot covers
    num_warps: int


@dataclass(frozen=True)
class ExpandTile:
    block_n: int  # output columns a program covers
    num_warps: int


_SHAPE_KEYS = {"shrink": ("in_dim", "num_stack", "max_rank"), "expand": ("out_dim", "num_stack", "max_rank")}


class TunedTiles:
    """A device's tuned entries: (kernel, shape) -> token counts ascending and their tiles."""

    def __init__(self, entries: dict[tuple, list[tuple[int, ShrinkTile | ExpandTile]]]):
        self._entries = {key: sorted(rows, key=lambda row: row[0]) for key, rows in entries.items()}

    def __len__(self) -> int:
        return sum(len(rows) for rows in self._entries.values())

    def shrink(self, in_dim: int, num_stack: int, max_rank: int, num_tokens: int) -> ShrinkTile | None:
        return self._pick(("shrink", in_dim, num_stack, max_rank), num_tokens)

    def expand(self, out_dim: int, num_stack: int, max_rank: int, num_tokens: int) -> ExpandTile | None:
        return self._pick(("expand", out_dim, num_stack, max_rank), num_tokens)

    def _pick(self, key: tuple, num_tokens: int):
        rows = self._entries.get(key)
        if not rows:
            return None
        i = bisect.bisect_left([tokens for tokens, _ in rows], num_tokens)
        return rows[min(i, len(rows) - 1)][1]


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


def _entry(entry: dict) -> tuple[tuple, int, ShrinkTile | ExpandTile]:
    if not isinstance(entry, dict):
        raise TypeError("not an object")
    kernel = entry["kernel"]
    if kernel not in _SHAPE_KEYS:
        raise ValueError(f"unknown kernel {kernel!r} (expected one of {sorted(_SHAPE_KEYS)})")
    key = (kernel, *(_positive(entry, name) for name in _SHAPE_KEYS[kernel]))
    tokens = _positive(entry, "tokens")
    config = entry["config"]
    if not isinstance(config, dict):
        raise TypeError("'config' is not an object")
    if kernel == "shrink":
        tile = ShrinkTile(
            _positive(config, "num_programs"),
            _choice(config, "block_k", BLOCK_K_CHOICES),
            _choice(config, "num_warps", NUM_WARPS_CHOICES),
        )
    else:
        tile = ExpandTile(
            _choice(config, "block_n", BLOCK_N_CHOICES), _choice(config, "num_warps", NUM_WARPS_CHOICES)
        )
    return key, tokens, tile


def _positive(obj: dict, name: str) -> int:
    value = obj[name]
    if type(value) is not int or value <= 0:
        raise ValueError(f"{name!r} must be a positive integer, got {value!r}")
    return value


def _choice(obj: dict, name: str, choices: tuple[int, ...]) -> int:
    value = obj[name]
    if type(value) is not int or value not in choices:
        raise ValueError(f"{name!r} must be one of {choices}, got {value!r}")
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


def device_tiles(device: torch.device) -> TunedTiles:
    """The tuned tiles of `device` (a CUDA device by its name; any other by its type, "cpu": no such
    file ships, so the interpreter keeps the built-in tiles unless a test writes one)."""
    return tiles_for(device_name(device))


@functools.cache
def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
