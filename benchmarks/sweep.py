"""One benchmark under several settings, each setting a fresh process, the settings taken in turn
round after round, so a machine's drift (its clocks, its neighbours, a cold first process) falls on
every setting alike; medians per setting of the JSON rows the benchmark prints.

    python benchmarks/sweep.py --rounds 3 --key batch num_adapters --metric decode_step_ms throughput_vs_base \
        --variant default= --variant gate_up0='--lora-sm-carveout-target gate_up=0' \
        --json sweep.json -- python benchmarks/engine_step.py --shape llama3-8b --overlap --batch 32 64 --adapters 0 8

A variant is NAME=ARGS: ARGS (split as a shell would) follow the command. Round r runs the variants
from the (r mod n)-th on, so none is always first. The benchmark prints one JSON object a line (other
lines are passed over); rows are matched across variants by the --key fields. The table gives each
variant's median over the rounds and, for the first metric, its ratio to the first variant's median.
A process that fails is reported (its exit status and the end of its stderr) and the sweep goes on;
the sweep's own exit status is then 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field


@dataclass
class Variant:
    name: str
    args: list[str]


@dataclass
class Run:
    variant: str
    round: int
    seconds: float
    returncode: int
    rows: list[dict] = field(default_factory=list)
    stderr_tail: str = ""


def parse_variant(text: str) -> Variant:
    name, sep, args = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"a variant is NAME=ARGS (ARGS may be empty), not {text!r}")
    try:
        return Variant(name, shlex.split(args))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"variant {name!r}: {exc}") from None


def json_rows(stdout: str) -> list[dict]:
    rows = []
    for line in stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def schedule(variants: list[Variant], rounds: int) -> list[tuple[int, Variant]]:
    """(round, variant) in the order they run: each round the variants in turn, from the next one on."""
    n = len(variants)
    return [(r, variants[(r + i) % n]) for r in range(rounds) for i in range(n)]


def run_one(command: list[str], variant: Variant, round_: int, timeout: float | None) -> Run:
    started = time.perf_counter()
    try:
        done = subprocess.run([*command, *variant.args], capture_output=True, text=True, timeout=timeout)
        returncode, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        returncode = 124
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        stderr = (exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or "") + f"\n(timed out after {timeout} s)"
    seconds = time.perf_counter() - started
    tail = "\n".join(stderr.strip().splitlines()[-20:]) if returncode != 0 else ""
    return Run(variant.name, round_, seconds, returncode, json_rows(stdout), tail)


def row_key(row: dict, keys: list[str]) -> tuple | None:
    if any(k not in row for k in keys):
        return None
    return tuple(row[k] for k in keys)


def summarise(runs: list[Run], variants: list[Variant], keys: list[str], metrics: list[str]) -> list[dict]:
    """One entry per key seen (first-seen order): per variant and metric, the values over the rounds
    and their median; for the first metric, each variant's median over the first variant's."""
    values: dict[tuple, dict[str, dict[str, list[float]]]] = {}
    for run in runs:
        for row in run.rows:
            key = row_key(row, keys)
            if key is None:
                continue
            per_variant = values.setdefault(key, {})
            for metric in metrics:
                if isinstance(row.get(metric), (int, float)):
                    per_variant.setdefault(run.variant, {}).setdefault(metric, []).append(float(row[metric]))
    summary = []
    for key, per_variant in values.items():
        entry = {"key": dict(zip(keys, key, strict=True)), "variants": {}}
        for variant in variants:
            got = per_variant.get(variant.name, {})
            entry["variants"][variant.name] = {
                metric: {"values": got[metric], "median": statistics.median(got[metric])} for metric in metrics if metric in got
            }
        first = entry["variants"][variants[0].name].get(metrics[0])
        for variant in variants:
            mine = entry["variants"][variant.name].get(metrics[0])
            if first and mine and first["median"]:
                mine["of_first"] = mine["median"] / first["median"]
        summary.append(entry)
    return summary


def table(summary: list[dict], variants: list[Variant], keys: list[str], metrics: list[str]) -> str:
    head = [*keys, *(f"{v.name} {m}" for m in metrics for v in variants)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for entry in summary:
        cells = [str(entry["key"][k]) for k in keys]
        for metric in metrics:
            for variant in variants:
                got = entry["variants"][variant.name].get(metric)
                if got is None:
                    cells.append("")
                    continue
                spread = "/".join(f"{v:.3f}" for v in got["values"])
                ratio = f" ({got['of_first']:.3f})" if "of_first" in got and variant is not variants[0] else ""
                cells.append(f"**{got['median']:.3f}**{ratio} [{spread}]")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    own, command = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        usage="%(prog)s [options] -- COMMAND [ARGS...]", description=__doc__.split("\n\n")[0], epilog="the benchmark's command line follows --"
    )
    parser.add_argument("--variant", type=parse_variant, action="append", required=True, help="NAME=ARGS, in the table's order")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--key", nargs="+", default=["batch", "num_adapters"], help="row fields that match rows across variants")
    parser.add_argument("--metric", nargs="+", default=["decode_step_ms"], help="row fields summarised (the first also as a ratio)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds a process may run")
    parser.add_argument("--json", default="", help="write the runs' rows and the summary here")
    args, extra = parser.parse_known_args(own)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)} (the benchmark's command line follows --)")
    if not command:
        parser.error("no benchmark command after --")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    names = [v.name for v in args.variant]
    if len(set(names)) != len(names):
        parser.error(f"variant names repeat: {names}")
    runs = []
    for round_, variant in schedule(args.variant, args.rounds):
        run = run_one(command, variant, round_, args.timeout)
        runs.append(run)
        status = "ok" if run.returncode == 0 else f"FAILED (exit {run.returncode})"
        print(f"round {round_} {variant.name}: {status}, {len(run.rows)} rows, {run.seconds:.1f} s", flush=True)
        if run.returncode != 0:
            print(run.stderr_tail, flush=True)
        if args.json:  # after every run: a sweep cut short keeps the runs it finished
            write_json(args.json, command, args.variant, runs, summarise(runs, args.variant, args.key, args.metric))
    summary = summarise(runs, args.variant, args.key, args.metric)
    print(table(summary, args.variant, args.key, args.metric), flush=True)
    return 1 if any(r.returncode != 0 for r in runs) else 0


def write_json(path: str, command: list[str], variants: list[Variant], runs: list[Run], summary: list[dict]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump({"command": command, "variants": [vars(v) for v in variants], "runs": [vars(r) for r in runs], "summary": summary}, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
