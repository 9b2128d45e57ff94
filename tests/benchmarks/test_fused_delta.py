"""benchmarks/fused_delta.py on the CPU (Triton's interpreter, the tiny shape): a row per target, token
count and grouping, each with the fused delta checked against the unfused one before it is timed."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from benchmarks import fused_delta

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU smoke run; the GPU measures for real")


def test_rows_for_every_target_token_count_and_grouping():
    rows = fused_delta.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--tokens", "4", "--adapters", "1", "3"])
    assert [(r["target"], r["tokens"], r["adapters"]) for r in rows] == [
        (t, 4, n) for t in ("qkv", "o", "gate_up", "down") for n in (1, 3)
    ]
    for row in rows:
        assert row["unfused_us"] > 0 and row["fused_us"] > 0 and row["gemm_us"] > 0
        assert row["unfused_lora_us"] > 0 and row["fused_lora_us"] > 0
        assert row["copy_gbps"] > 0  # measured on the CPU: no --copy-gbps given
        assert row["fused_bw_frac"] == pytest.approx(row["lora_bytes"] / row["fused_lora_us"] * 1e-3 / row["copy_gbps"], rel=2e-2)
    # o of the tiny shape (64 -> 64), 4 tokens, 3 adapters at rank 16, float32
    (o3,) = [r for r in rows if r["target"] == "o" and r["adapters"] == 3]
    assert o3["lora_bytes"] == 4 * (4 * 64 + 3 * 16 * (64 + 64) + 4 * 64)


def test_a_fused_delta_that_differs_stops_the_run(monkeypatch):
    real = fused_delta.sgmv_lora_delta_decode
    monkeypatch.setattr(fused_delta, "sgmv_lora_delta_decode", lambda *a, **k: real(*a, **k) * 1.5)
    with pytest.raises(SystemExit, match="differs from the unfused one"):
        fused_delta.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--tokens", "4", "--adapters", "2", "--targets", "o"])


def test_graph_and_exact_segments_give_a_row_each():
    """--segments graph exact: 4 tokens over 2 adapters are 2 segments, padded to 4 in the graph's layout."""
    rows = fused_delta.main(
        ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--tokens", "4", "--adapters", "2", "4", "--targets", "o",
         "--segments", "graph", "exact"]
    )  # fmt: skip
    assert [(r["adapters"], r["segments"], r["num_segments"]) for r in rows] == [(2, "graph", 4), (2, "exact", 2), (4, "graph", 4), (4, "exact", 4)]
    assert all(r["unfused_lora_us"] > 0 and r["lora_bytes"] > 0 for r in rows)
    assert rows[0]["lora_bytes"] == rows[1]["lora_bytes"]  # the same work either way


def test_padding_that_changes_the_delta_stops_the_run(monkeypatch):
    real = fused_delta.live_segments

    def wrong(meta, device):  # the live segments, every one on adapter 1: another delta
        live = real(meta, device)
        ranks = list(live.host_ranks)
        return fused_delta.SgmvMeta.from_lists(list(live.host_seg_lens), [1] * live.num_segments, ranks, [2.0] * len(ranks), device)

    monkeypatch.setattr(fused_delta, "live_segments", wrong)
    with pytest.raises(SystemExit, match="padding segments change the delta"):
        fused_delta.main(
            ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--tokens", "4", "--adapters", "2", "--targets", "o", "--segments", "exact"]
        )  # fmt: skip


def test_per_kernel_times_each_kernel_of_the_chain_and_counts_its_bytes(monkeypatch):
    """--per-kernel: the split shrink, the reduce and the expand each timed alone with PDL off (the row's
    setting back after), and the bytes each must move: the tiny shape's o (64 -> 64), 4 tokens over 3
    adapters at rank 16, float32."""
    from lorakernels import pdl

    seen, switches = [], []
    real_reduce, real_set = fused_delta._reduce_partials, pdl.set_lora_enabled
    monkeypatch.setattr(fused_delta, "_reduce_partials", lambda *a, **k: (seen.append(pdl.lora_enabled()), real_reduce(*a, **k))[1])
    monkeypatch.setattr(pdl, "set_lora_enabled", lambda on: (switches.append(on), real_set(on))[1])
    rows = fused_delta.main(
        ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--tokens", "4", "--adapters", "3", "--targets", "o",
         "--per-kernel"]
    )  # fmt: skip
    assert seen and not any(seen)  # the reduce timed with PDL off
    # main: off for the checks, on for the row; per_kernel: off, then the row's setting back; main: off at the end
    assert switches == [False, True, False, True, False]
    (row,) = rows
    assert row["split_us"] > 0 and row["reduce_us"] > 0 and row["expand_us"] > 0
    assert row["split_bytes"] == 4 * (4 * 64 + 3 * 16 * 64)  # x, the three adapters' A
    assert row["expand_bytes"] == 4 * (4 * 16 + 3 * 16 * 64 + 4 * 64)  # v, B, the delta written
    assert row["expand_bw_frac"] == pytest.approx(row["expand_bytes"] / row["expand_us"] * 1e-3 / row["copy_gbps"], rel=2e-2)
    plain = fused_delta.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--tokens", "4", "--adapters", "3", "--targets", "o"])
    assert "split_us" not in plain[0]
