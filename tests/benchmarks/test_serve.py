"""benchmarks/serve.py end to end on the CPU with the demo model: a registry process, the engine in
process and as a process, HF+peft, a few requests per scenario; the report's fields are present and
consistent with the workload (every request's tokens arrive, latencies are ordered, adapter scenarios
load slots and look up the host cache, the base scenario does neither)."""

import json
import math
import platform

import pytest

from benchmarks import serve

pytestmark = pytest.mark.slow

NUM_REQUESTS, OUTPUT_LEN = 5, 3


def test_serve_benchmark_smoke(tmp_path):
    report_path = tmp_path / "report.json"
    args = [
        "--shape", "demo", "--device", "cpu", "--work-dir", str(tmp_path / "work"),
        "--num-requests", str(NUM_REQUESTS), "--prompt-len", "6", "--output-len", str(OUTPUT_LEN),
        "--scenarios", "base", "2", "zipf", "--hf-scenarios", "base", "2", "--num-adapters", "6",
        "--max-loras", "2", "--max-host-adapters", "3", "--max-running", "4",
        "--arrival", "all", "poisson", "--rate", "200", "--out", str(report_path),
    ]  # fmt: skip
    report = serve.main(args)
    assert json.loads(report_path.read_text()) == json.loads(json.dumps(report))
    assert {"date", "commit", "device", "torch"} <= set(report["environment"])
    assert report["environment"]["cpus"] >= 1 and report["environment"]["python"] == platform.python_version()
    assert report["environment"]["cpu"] == serve.host_cpu() and serve.host_cpu()  # this VM's /proc/cpuinfo names it
    assert report["environment"]["lora_tiles"] == "built-in"  # no tuned file for the CPU
    rows = {(r["engine"], r["scenario"], r["arrival"]): r for r in report["results"]}
    engines = [(e, s, a) for e in ("inproc", "grpc") for s in ("base", "2", "zipf") for a in ("all", "poisson")]
    assert set(rows) == set(engines) | {("hf_peft", "base", "batched"), ("hf_peft", "2", "batched")}
    for key, row in rows.items():
        assert row["output_tokens"] == NUM_REQUESTS * OUTPUT_LEN, key
        assert row["output_tok_s"] > 0 and row["wall_s"] > 0, key
    for key in engines:
        row = rows[key]
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"], key
        assert 0 <= row["itl_p50_ms"] <= row["itl_p99_ms"] and row["itl_mean_ms"] > 0, key
        assert row["vs_hf_peft"] > 0 if key[1] != "zipf" else "vs_hf_peft" not in row
        assert row["lora_vs_base"] > 0
        if key[1] == "base":
            lookups = row["host_cache_hits"] + row["host_cache_misses"] + row["host_cache_joined"]
            assert row["slot_loads"] == lookups == 0
            assert row["num_distinct_adapters"] == 0
        else:  # every adapter request looked its adapter up once; with 2 slots some had to be loaded
            lookups = row["host_cache_hits"] + row["host_cache_misses"] + row["host_cache_joined"]
            assert lookups == NUM_REQUESTS, key
            assert row["slot_loads_ahead"] <= row["slot_loads"], key
            assert row["slot_loads"] >= 1 and row["num_distinct_adapters"] >= 1, key
    zipf_all = rows[("inproc", "zipf", "all")]
    assert zipf_all["slot_loads"] >= zipf_all["num_distinct_adapters"] - 2  # 2 slots: most had to load
    assert rows[("hf_peft", "2", "batched")]["num_distinct_adapters"] == 2


def test_serve_benchmark_warm_pass_and_partial_targets(tmp_path):
    """--passes 2 over 2 adapters and 2 slots: the first pass fetches and loads both adapters, the
    second finds them in the host cache and their slots (no fetch, no load); --target-modules writes
    adapters on q_proj and v_proj alone, under their own names."""
    args = [
        "--shape", "demo", "--device", "cpu", "--work-dir", str(tmp_path / "work"), "--engines", "inproc",
        "--num-requests", "4", "--prompt-len", "6", "--output-len", "3", "--scenarios", "base", "2",
        "--max-loras", "2", "--max-host-adapters", "2", "--max-running", "4", "--passes", "2",
        "--target-modules", "v_proj", "q_proj", "--slow-steps", "1000", "--timeline-ms", "5",
    ]  # fmt: skip
    rows = {(r["scenario"], r["pass"]): r for r in serve.main(args)["results"]}
    for key, row in rows.items():  # --timeline-ms 5: every token and first token in one bucket of 5 ms
        buckets = row["timeline"]
        assert [b["t_s"] for b in buckets] == [round(i * 0.005, 6) for i in range(len(buckets))], key
        assert len(buckets) == max(1, math.ceil(row["wall_s"] / 0.005)), key
        assert sum(b["tokens"] for b in buckets) == row["output_tokens"], key
        assert sum(b["first_tokens"] for b in buckets) == 4 and all(0 <= b["streaming"] <= 4 for b in buckets), key
        for event in ("asked", "begun", "ended"):  # the cold pass fetched both
            assert sum(b[f"fetches_{event}"] for b in buckets) == (2 if key == ("2", 1) else 0), (key, event)
        # with --slow-steps: each gap in the bucket it ended in, its parts summed there
        assert sum(b["step_gaps"] for b in buckets) == row["step_gaps"], key
        assert sum(b["slot_loads"] for b in buckets) == sum(g["slot_loads"] for g in row["slow_steps"]), key
        assert sum(b["gap_ms"] for b in buckets) == pytest.approx(sum(g["gap_ms"] for g in row["slow_steps"]), abs=0.01 * len(buckets)), key
        assert all(b["gap_ms"] >= b["post_process_ms"] >= 0 and b["launch_host_ms"] >= b["slot_load_ms"] >= 0 for b in buckets), key
    for key, row in rows.items():  # --slow-steps 1000: every gap, the slowest first
        gaps = row["slow_steps"]
        assert len(gaps) == row["step_gaps"] >= 2, key  # 3 tokens a request: 2 gaps at least
        assert [g["gap_ms"] for g in gaps] == sorted((g["gap_ms"] for g in gaps), reverse=True), key
        assert all(g["gap_ms"] >= g["post_process_ms"] >= 0 and g["launch_host_ms"] >= 0 for g in gaps), key
        assert all(g["launch_host_ms"] >= g["slot_load_ms"] >= 0 for g in gaps), key  # the loads' calls, inside the launches
        assert all((g["slot_load_ms"] > 0) == (g["slot_loads"] > 0) for g in gaps), key
        # each gap holds a loop iteration, which schedules; no overlapped schedule on the CPU: none chained
        assert all(g["schedule_ms"] > 0 and g["chained"] == 0 for g in gaps), key
        assert 0 <= row["loop_lag_ms_p50"] <= row["loop_lag_ms_p99"] <= row["loop_lag_ms_max"], key
        assert all(g["decode_rows"] >= 1 for g in gaps), key  # a gap ends in a request's next token
        assert row["step_gap_p50_ms"] <= row["step_gap_p99_ms"] <= gaps[0]["gap_ms"], key
        assert row["traced"]["slot_loads"] == row["slot_loads"], key  # the hooks saw every step's loads
        prefilled = row["traced"]["prefill_tokens"]  # pass 2's prompts hit the prefix cache
        assert prefilled == 4 * 6 if key[1] == 1 else prefilled < 4 * 6, key  # (the cache is keyed by adapter)
        assert sum(g["slot_loads"] for g in gaps) <= row["slot_loads"], key
        assert any(g["lora_rows"] for g in gaps) == (key[0] == "2"), key
    cold, warm = rows[("2", 1)], rows[("2", 2)]
    assert cold["host_cache_misses"] == 2 and cold["slot_loads"] == 2
    assert (warm["host_cache_misses"], warm["host_cache_joined"], warm["slot_loads"]) == (0, 0, 0)
    assert cold["loads_timed"] == 2 and "loads_timed" not in warm  # the two fetches, each timed by stage
    for stage in ("fetch", "pack_wait", "pack"):
        assert 0 <= cold[f"load_{stage}_ms_p50"] <= cold[f"load_{stage}_ms_p99"] <= cold[f"load_{stage}_ms_max"], stage
    assert cold["load_fetch_ms_max"] > 0 and cold["load_pack_ms_max"] > 0
    # the registry fetches themselves: the turn waited for, the transfer, the rate of all together
    assert cold["fetches"] == 2 and "fetches" not in warm
    for part in ("turn_wait", "transfer"):
        assert 0 <= cold[f"fetch_{part}_ms_p50"] <= cold[f"fetch_{part}_ms_p99"] <= cold[f"fetch_{part}_ms_max"], part
    assert cold["fetch_transfer_ms_max"] > 0 and cold["fetch_mb_s"] > 0
    assert cold["fetch_transfer_ms_max"] <= cold["load_fetch_ms_max"]  # a load's fetch holds its transfer
    assert warm["host_cache_hits"] == 4 and warm["output_tokens"] == 12
    assert warm["lora_vs_base"] == warm["output_tok_s"] / rows[("base", 2)]["output_tok_s"]
    config = json.loads((tmp_path / "work" / "adapters" / "bench-qv-1" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "v_proj"]


def test_fetch_report_separates_the_wait_for_a_turn_from_the_transfer():
    from engine.registry_link import FetchTiming

    # two turns: a and b transfer side by side, c waits for a's turn; 30 MB over 0.3 s in all
    fetches = [FetchTiming(0.0, 0.0, 0.2, 10**7), FetchTiming(0.0, 0.0, 0.1, 10**7), FetchTiming(0.0, 0.1, 0.3, 10**7)]
    row = serve.fetch_report(fetches)
    assert row["fetches"] == 3
    assert row["fetch_turn_wait_ms_max"] == pytest.approx(100) and row["fetch_turn_wait_ms_p50"] == 0
    assert row["fetch_transfer_ms_p50"] == pytest.approx(200) and row["fetch_transfer_ms_max"] == pytest.approx(200)
    assert row["fetch_mb_s"] == pytest.approx(100)


@pytest.mark.parametrize("fetches", [None, "8"])
def test_serve_passes_engine_fetch_and_gil_settings(tmp_path, fetches):
    """--max-concurrent-fetches and --gil-switch-interval-ms reach the engine built in process (its
    EngineConfig); the defaults are the engine's own."""
    argv = ["--gil-switch-interval-ms", "0.5"] + (["--max-concurrent-fetches", fetches] if fetches else [])
    config = serve.engine_config(serve.parse_args(argv), tmp_path, "127.0.0.1:1")
    assert config.max_concurrent_fetches == (int(fetches) if fetches else serve.EngineConfig.max_concurrent_fetches)
    assert config.gil_switch_interval_ms == 0.5


def test_the_grpc_engine_gets_the_benchmarks_engine_config(tmp_path):
    """The engine process's arguments (`engine_serve_args`), read by the real CLI, build the EngineConfig
    the in-process engine gets, LoRA carve-outs per target included."""
    from loramux.shell import cli
    from loramux.shell.settings import engine_config

    argv = ["--lora-sm-carveout", "40", "--lora-sm-carveout-target", "gate_up=0", "o=16", "--lora-decode-fused-expand", "qkv",
            "--lora-decode-fused-delta", "o", "down", "--lora-gemm-tail-blocks", "9", "--lora-decode-norm-shrink", "gate_up",
            "--kernel-pdl", "--disable-lora-pdl", "--disable-decode-gemm-tuning", "--lora-graph-segments", "4", "16"]
    config = serve.engine_config(serve.parse_args(argv), tmp_path, "127.0.0.1:1")
    assert config.lora_sm_carveout_targets == (("gate_up", 0), ("o", 16))
    assert config.lora_gemm_tail_blocks == 9 and config.lora_graph_segments == (4, 16)
    args = cli.build_parser({}).parse_args(serve.engine_serve_args(config))
    rebuilt = engine_config(args, config.registry, 0)
    assert config.lora_decode_fused_delta == ("o", "down") and config.lora_decode_norm_shrink == ("gate_up",)
    assert config.kernel_pdl and not config.lora_pdl and not config.tune_decode_gemms
    for name in ("tune_decode_gemms", "lora_sm_carveout", "lora_sm_carveout_targets", "lora_decode_fused_expand", "lora_decode_fused_delta", "lora_decode_norm_shrink", "kernel_pdl", "lora_pdl", "max_loras_per_batch",
                 "max_running_requests", "lora_load_ahead", "max_concurrent_fetches", "lora_gemm_tail_blocks", "lora_graph_segments"):  # fmt: skip
        assert getattr(rebuilt, name) == getattr(config, name), name


def test_the_timeline_counts_each_token_in_its_bucket():
    start = 100.0
    traces = [
        serve.Trace(100.0, [(100.05, 1), (100.15, 2), (100.35, 1)]),  # streaming at the ends of buckets 0-2
        serve.Trace(100.0, [(100.25, 1)]),  # one token: streaming at no bucket's end
        serve.Trace(100.0, []),
    ]
    fetches = [(98.0, 98.5, 99.0), (99.0, 100.0, 100.01), (100.15, 100.25, 100.39), (100.25, 100.35, 100.5)]
    buckets = serve.timeline(traces, start, 0.4, 0.1, fetches=fetches)
    assert [b["tokens"] for b in buckets] == [1, 2, 1, 1]
    assert [b["first_tokens"] for b in buckets] == [1, 0, 1, 0]
    assert [b["streaming"] for b in buckets] == [1, 1, 1, 0]
    assert [b["fetches_ended"] for b in buckets] == [1, 0, 0, 2]  # before the start: not counted; after the end: the last bucket
    assert [b["fetches_asked"] for b in buckets] == [0, 1, 1, 0] and [b["fetches_begun"] for b in buckets] == [1, 0, 1, 1]
    assert "fetches_ended" not in serve.timeline(traces, start, 0.4, 0.1)[0]
    gap = dict.fromkeys(serve.STEP_SUMS, 1.5) | {"slot_loads": 2}
    gaps = [gap | {"end": 99.9}, gap | {"end": 100.12}, gap | {"end": 100.18, "gc_ms": 4.0}]  # the first before the start
    buckets = serve.timeline(traces, start, 0.4, 0.1, gaps=gaps)
    assert [b["step_gaps"] for b in buckets] == [0, 2, 0, 0]
    assert [b["gc_ms"] for b in buckets] == [0, 5.5, 0, 0] and buckets[1]["slot_loads"] == 4 and buckets[1]["gap_ms"] == 3.0
    assert "step_gaps" not in serve.timeline(traces, start, 0.4, 0.1)[0]
    with pytest.raises(SystemExit):
        serve.parse_args(["--timeline-ms", "-1"])
