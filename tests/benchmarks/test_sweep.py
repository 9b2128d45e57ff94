"""benchmarks/sweep.py: settings in turn, a process each, medians matched by key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks import sweep

ROOT = Path(__file__).resolve().parents[2]

# A stand-in benchmark: logs each call's arguments, prints rows whose step time depends on --extra and
# on how many calls came before (so each round differs), and fails where told to.
FAKE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    log = Path(sys.argv[1])
    calls = log.read_text().splitlines() if log.exists() else []
    log.write_text("\\n".join([*calls, " ".join(sys.argv[2:])]) + "\\n")
    args = sys.argv[2:]
    if "--fail" in args:
        print("something broke", file=sys.stderr)
        sys.exit(3)
    extra = float(args[args.index("--extra") + 1]) if "--extra" in args else 0.0
    print("loading the model ...")
    for batch in (32, 64):
        for adapters in (0, 8):
            ms = batch / 8 + adapters / 4 + extra + len(calls) / 100
            print(json.dumps({"batch": batch, "num_adapters": adapters, "decode_step_ms": ms}))
    print(json.dumps({"batch": 32, "mixed_chunk": 64, "mixed_step_ms": 9.0}))
    """
)


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake.py"
    script.write_text(FAKE)
    return script, tmp_path / "calls.log"


def test_schedule_turns_the_order_each_round():
    a, b, c = (sweep.Variant(n, []) for n in "abc")
    order = [(r, v.name) for r, v in sweep.schedule([a, b, c], 3)]
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"), (2, "c"), (2, "a"), (2, "b")]


def test_a_sweep_runs_each_variant_each_round_and_gives_medians_by_key(fake, tmp_path, capsys):
    script, log = fake
    out = tmp_path / "sweep.json"
    argv = [
        "--rounds", "3", "--variant", "plain=", "--variant", "slower=--extra 2", "--json", str(out),
        "--", sys.executable, str(script), str(log),
    ]  # fmt: skip
    assert sweep.main(argv) == 0
    calls = log.read_text().splitlines()
    assert calls == ["", "--extra 2", "--extra 2", "", "", "--extra 2"]  # turned each round
    result = json.loads(out.read_text())
    entry = {(e["key"]["batch"], e["key"]["num_adapters"]): e for e in result["summary"]}
    assert set(entry) == {(32, 0), (32, 8), (64, 0), (64, 8)}  # the mixed row lacks num_adapters: left out
    plain = entry[32, 8]["variants"]["plain"]["decode_step_ms"]
    slower = entry[32, 8]["variants"]["slower"]["decode_step_ms"]
    # the n-th call (from 0) adds n/100: plain ran as calls 0, 3, 4; slower as 1, 2, 5
    assert plain["values"] == pytest.approx([6.0, 6.03, 6.04])
    assert slower["values"] == pytest.approx([8.01, 8.02, 8.05])
    assert plain["median"] == pytest.approx(6.03) and slower["median"] == pytest.approx(8.02)
    assert slower["of_first"] == pytest.approx(8.02 / 6.03) and plain["of_first"] == pytest.approx(1.0)
    table = capsys.readouterr().out
    assert "| 32 | 8 | **6.030** [6.000/6.030/6.040] | **8.020** (1.330) [8.010/8.020/8.050] |" in table


def test_a_failing_variant_is_reported_and_the_rest_still_summarised(fake, tmp_path, capsys):
    script, log = fake
    argv = ["--rounds", "2", "--variant", "ok=", "--variant", "broken=--fail", "--", sys.executable, str(script), str(log)]
    assert sweep.main(argv) == 1
    assert len(log.read_text().splitlines()) == 4  # the sweep went on after the first failure
    out = capsys.readouterr().out
    assert out.count("broken: FAILED (exit 3)") == 2 and "something broke" in out
    assert "[8.000/8.030] |  |" in out  # ok's calls were the 1st and 4th; broken has no value


def test_a_process_past_its_timeout_counts_as_failed(tmp_path, capsys):
    argv = ["--timeout", "0.5", "--rounds", "1", "--variant", "slow=", "--", sys.executable, "-c", "import time; time.sleep(30)"]
    assert sweep.main(argv) == 1
    assert "slow: FAILED (exit 124)" in capsys.readouterr().out


def test_a_sweep_killed_mid_way_keeps_the_runs_it_finished_in_its_json(fake, tmp_path):
    # the second call kills the sweep itself (as a device call's time limit would)
    script, log = fake
    killer = tmp_path / "killer.py"
    killer.write_text(
        "import os, runpy, signal, sys\n"
        f"if os.path.exists({str(log)!r}):\n"
        "    os.kill(os.getppid(), signal.SIGKILL)\n"
        "    sys.exit(0)\n"
        f"sys.argv = [{str(script)!r}, *sys.argv[1:]]\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
    )
    out = tmp_path / "sweep.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "sweep.py"), "--rounds", "2", "--variant", "a=", "--variant", "b=--extra 1"]
    done = subprocess.run([*command, "--json", str(out), "--", sys.executable, str(killer), str(log)], capture_output=True, text=True)
    assert done.returncode == -9
    result = json.loads(out.read_text())
    assert [(r["variant"], r["returncode"], len(r["rows"])) for r in result["runs"]] == [("a", 0, 5)]
    assert result["summary"][0]["variants"]["a"]["decode_step_ms"]["median"] == pytest.approx(4.0)
    assert not (tmp_path / "sweep.json.tmp").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--variant", "a=", sys.executable], "the benchmark's command line follows --"),
        (["--variant", "noequals", "--", "true"], "NAME=ARGS"),
        (["--variant", "a='unclosed", "--", "true"], "variant 'a'"),
        (["--variant", "a=", "--variant", "a=-x", "--", "true"], "variant names repeat"),
        (["--variant", "a=", "--rounds", "0", "--", "true"], "--rounds must be at least 1"),
        (["--variant", "a=", "--"], "no benchmark command"),
    ],
)
def test_bad_arguments_are_refused_with_a_reason(argv, message, capsys):
    try:
        code = sweep.main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_the_engine_step_benchmark_runs_under_the_sweep(tmp_path):
    """The real decode benchmark on the CPU's tiny model: its rows reach the summary."""
    out = tmp_path / "sweep.json"
    cmd = [
        sys.executable, "benchmarks/sweep.py", "--rounds", "1", "--metric", "decode_step_ms", "--json", str(out),
        "--variant", "short=--num-decode 6", "--variant", "long=--num-decode 8", "--",
        sys.executable, "benchmarks/engine_step.py", "--device", "cpu", "--batch", "2", "--prompt-len", "8", "--adapters", "0",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(out.read_text())["summary"]
    assert [e["key"] for e in summary] == [{"batch": 2, "num_adapters": 0}]
    for name in ("short", "long"):
        assert summary[0]["variants"][name]["decode_step_ms"]["median"] > 0
