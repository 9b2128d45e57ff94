"""benchmarks/cold_burst.py on a tiny shape: every adapter resolved and fetched whole in each pass; with
`apart`, every resolution ends before the first fetch does."""

from benchmarks import cold_burst


def test_cold_burst_smoke():
    rows = cold_burst.main(["--shape", "tiny", "--adapters", "3", "--concurrency", "2", "--passes", "1"])
    assert [r["mode"] for r in rows] == ["burst", "apart"]
    for row in rows:
        assert row["mb"] == row["registered_mb"] > 0, row  # each artifact received once, whole
        assert 0 < row["resolved_ms_p50"] <= row["resolved_ms_max"] and 0 < row["first_fetch_ms"] <= row["last_fetch_ms"], row
        assert row["mb_s"] > 0 and row.get("registry_cpu_s", 0) >= 0, row
    apart = rows[1]
    assert apart["resolved_ms_max"] <= apart["first_fetch_ms"]
