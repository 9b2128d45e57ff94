"""benchmarks/carve_split.py on the CPU (Triton's interpreter, the tiny shape): a row per target, token
count, grouping and split, each split GEMM checked against the whole one before it is timed."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from benchmarks import carve_split

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU smoke run; the GPU measures for real")


def test_split_columns_round_to_the_tile_and_keep_the_ends():
    assert carve_split.split_columns(28672, 1.0) == 28672
    assert carve_split.split_columns(28672, 0.0) == 0
    assert carve_split.split_columns(28672, 0.35) == 9984  # 0.35 * 28672 / 128 = 78.4 -> 78 tiles
    assert carve_split.split_columns(64, 1.0) == 64  # narrower than a tile: all of it, not none
    assert carve_split.split_columns(64, 0.5) == 0


def test_rows_for_every_target_grouping_and_split():
    rows = carve_split.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--tokens", "4", "--adapters", "3", "--split", "1", "0.5", "0"])
    assert [(r["target"], r["adapters"], r["split"]) for r in rows] == [
        (t, 3, s) for t in ("qkv", "o", "gate_up", "down") for s in (1.0, 0.5, 0.0)
    ]
    for row in rows:
        assert row["beside_us"] > 0 and row["gemm_us"] > 0 and row["full_gemm_us"] > 0
        assert row["max_abs_diff"] < 1e-4
    assert {r["columns"] for r in rows if r["target"] == "gate_up"} == {352, 128, 0}  # tiny: 2 * 176 columns


def test_a_split_that_differs_from_the_whole_gemm_stops_the_run(monkeypatch):
    real_mm = torch.mm

    def off_by_one(a, b, *, out):  # the carved-out share, wrong
        real_mm(a, b, out=out)
        out.add_(1.0) if out.shape[1] == 128 else None

    monkeypatch.setattr(carve_split.torch, "mm", off_by_one)
    with pytest.raises(SystemExit, match="differs from the whole"):
        carve_split.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--tokens", "4", "--adapters", "2", "--targets", "gate_up", "--split", "0.5"])


def test_shares_outside_zero_to_one_are_refused():
    with pytest.raises(SystemExit):
        carve_split.main(["--shape", "tiny", "--device", "cpu", "--split", "1.5"])
