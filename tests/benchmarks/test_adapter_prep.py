"""benchmarks/adapter_prep.py on the CPU with the tiny shape: the loop stand-in alone, then beside packers
that pack every adapter asked for."""

from benchmarks.adapter_prep import main


def test_adapter_prep_benchmark_smoke():
    rows = main(["--shape", "tiny", "--threads", "1", "3", "--packs", "6", "--distinct", "2", "--rank", "4"])
    assert [r["pack_threads"] for r in rows] == [0, 1, 3]
    assert rows[0]["packs"] == 0 and rows[0]["iterations"] == 200
    for row in rows[1:]:
        assert row["packs"] == 6 and row["packs_per_s"] > 0 and row["iterations"] >= 1
        assert row["pack_ms_max"] >= row["pack_ms_median"] > 0
        assert row["packed_mb"] > 0 and row["loop_host_ms_max"] >= row["loop_host_ms_median"] > 0
