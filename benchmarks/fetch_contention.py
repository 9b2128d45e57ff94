"""The engine's registry fetches beside a thread that runs Python, as the engine loop does: the rate of
one `RegistryLink` (engine/registry_link.py) fetching adapters N at a time from a real `loramux registry
serve` process on loopback, alone, beside Python running on the link's own event loop (as admission
and the streams' deliveries run on the engine's), then beside a busy thread at each GIL switch interval.

    python benchmarks/fetch_contention.py [--shape llama3-8b] [--adapters 8] [--concurrency 1 4 8]
        [--switch-interval-ms 5 1 0.5] [--busy-loop-ms 1] [--fetchers loop process] [--fetch-processes 1 2]

The link's event loop needs the GIL for every 1 MiB chunk that arrives, and its hash-and-copy thread
for every chunk it takes: beside a thread that holds the GIL, each of those waits up to the switch
interval (the engine's --gil-switch-interval-ms); beside a busy loop, each chunk also waits for the
loop's turn. Through the fetch process (--fetchers process) the chunks meet neither: only each
artifact's answer needs this process's GIL; --fetch-processes N splits the turns between N of them
(one pass for each N, never more processes than fetches at once). Adapters are q/v rank-16 (PEFT's default targets),
each fetched once a round, --rounds rounds a pass over a warm link; one JSON line a pass, whose rate
counts the bytes the fetches received (before 2026-12-03 the pass asked for every adapter twice at
once, the link shared one fetch between the two calls, and the rate counted both: twice the real one).
Each row also has, on Linux, the CPU seconds a GB and the minor page faults a MB that the registry,
the fetch processes (together) and this process spent in the pass. --switch-interval-ms with no value
and --busy-loop-ms 0 leave out the passes beside a busy thread or loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.registry_transfer import write_peft_adapter
from engine.named_shapes import LLAMA3_8B_CONFIG, TINY_LLAMA_CONFIG
from engine.registry_link import RegistryLink, record_of
from loraformat.model_shapes import ModelShape
from loramux.registry_client import RegistryClient
from loramux.testing.procs import Service
from loramux.v1 import registry_pb2 as pb

SHAPES = {"llama3-8b": LLAMA3_8B_CONFIG, "tiny": TINY_LLAMA_CONFIG}


def process_usage(pid: int) -> tuple[float, int] | None:
    """(CPU seconds, minor page faults) a process has used so far; None where /proc cannot say."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


async def fetch_pass(
    address: str, adapters: list[pb.Adapter], concurrency: int, busy_loop_ms: float = 0.0, fetch_process: bool = False,
    rounds: int = 2, registry_pid: int | None = None, fetch_processes: int = 1,
) -> tuple[float, int, dict[str, tuple[float, int]]]:
    """(seconds, bytes received, usage) of fetching every adapter once a round, `concurrency` at a time,
    over one warm link; with `busy_loop_ms`, beside a task that runs Python on the link's event loop in
    slices of that long, as admission and the streams' deliveries do in the engine's process; with
    `fetch_process`, through the engine's fetch processes (engine/fetch_process.py; `fetch_processes` of
    them) instead of on the link's loop. usage: what each process ("registry", "fetch_process": all of
    them, "engine": this one) spent in the pass, (CPU seconds, minor page faults), where /proc says."""
    link = RegistryLink(
        address, adapters[0].base_model, "{}", on_event=lambda event: None, max_concurrent_fetches=concurrency,
        fetch_process=fetch_process, fetch_processes=fetch_processes,
    )  # fmt: skip
    busy = None
    try:
        await link.fetch(record_of(adapters[0]))  # opens the connection
        if busy_loop_ms:
            busy = asyncio.create_task(busy_loop(busy_loop_ms / 1e3))
        await asyncio.gather(*(link.fetch(record_of(a)) for a in adapters[: len(link.processes)]))  # each child started
        pids = {"registry": [registry_pid], "fetch_process": [p.pid for p in link.processes], "engine": [os.getpid()]}
        pids = {name: ids for name, ids in pids.items() if ids and None not in ids}
        used = {name: usage_of(ids) for name, ids in pids.items()}
        before, start = link.num_fetches, time.perf_counter()
        for _ in range(rounds):  # a round fetches each adapter once: calls for one digest at once share a fetch
            await asyncio.gather(*(link.fetch(record_of(a)) for a in adapters))
        seconds = time.perf_counter() - start
        usage = {}
        for name, ids in pids.items():
            now = usage_of(ids)
            if now is not None and used[name] is not None:
                usage[name] = (now[0] - used[name][0], now[1] - used[name][1])
        timings = list(link.fetch_timings)[before - link.num_fetches :] if link.num_fetches > before else []
        if len(timings) != rounds * len(adapters):
            raise RuntimeError(f"{len(timings)} fetches made, {rounds * len(adapters)} asked for")
        return seconds, sum(t.size for t in timings), usage
    finally:
        if busy is not None:
            busy.cancel()
        await link.close()


def usage_of(pids: list[int]) -> tuple[float, int] | None:
    """process_usage summed over `pids`; None if /proc does not say for one of them."""
    usages = [process_usage(pid) for pid in pids]
    if None in usages:
        return None
    return sum(u[0] for u in usages), sum(u[1] for u in usages)


async def busy_loop(slice_s: float) -> None:
    """Python on the event loop until cancelled, giving the loop back after each slice."""
    while True:
        end = time.perf_counter() + slice_s
        while time.perf_counter() < end:
            sum(range(2000))
        await asyncio.sleep(0)


class BusyThread:
    """A thread that runs pure Python until stopped: it lets the GIL go only when the interpreter makes it."""

    def __init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            sum(range(2000))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--rounds", type=int, default=2, help="fetches of every adapter a pass, one round after another")
    p.add_argument("--switch-interval-ms", type=float, nargs="*", default=[5.0, 1.0, 0.5], help="passes beside a busy thread at these switch intervals (none: no such pass)")
    p.add_argument("--busy-loop-ms", type=float, default=1.0, help="also fetch beside a busy event loop, in slices this long (0: not)")
    p.add_argument("--fetch-processes", type=int, nargs="+", default=[1], help="with --fetchers process: passes with this many fetch processes")
    p.add_argument(
        "--fetchers", nargs="+", default=["loop"], choices=("loop", "process"),
        help="where the link receives the bytes: its event loop, the engine's fetch process (Linux), or both in turn",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if min(args.fetch_processes) < 1:
        p.error(f"--fetch-processes must be >= 1, got {min(args.fetch_processes)}")
    if args.busy_loop_ms < 0:
        p.error(f"--busy-loop-ms must be >= 0, got {args.busy_loop_ms}")
    config, rows = SHAPES[args.shape], []
    shape = ModelShape.from_config(config)
    before = sys.getswitchinterval()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "model").mkdir()
        (root / "model" / "config.json").write_text(json.dumps(config))
        dirs = [root / f"adapter{i}" for i in range(args.adapters)]
        for i, d in enumerate(dirs):
            write_peft_adapter(d, shape, 16, seed=i, modules=("q_proj", "v_proj"))
        server = Service(["registry", "serve", "--port", "0", "--data-dir", str(root / "data")], "registry")
        try:
            with RegistryClient(server.address) as client:
                client.register_base_model("bench", root / "model")
                adapters = [client.register_adapter(pb.AdapterSpec(name=f"fetch-{i}"), d) for i, d in enumerate(dirs)]
            # (busy thread, busy loop slice ms, switch interval ms)
            settings = [(False, 0.0, None)] + ([(False, args.busy_loop_ms, None)] if args.busy_loop_ms else [])
            settings += [(True, 0.0, ms) for ms in args.switch_interval_ms]
            for busy, loop_ms, interval_ms in settings:
                sys.setswitchinterval(interval_ms / 1e3 if interval_ms else before)
                with BusyThread() if busy else contextlib.nullcontext():
                    passes = [("loop", 0)] if "loop" in args.fetchers else []
                    passes += [("process", n) for n in args.fetch_processes] if "process" in args.fetchers else []
                    for (fetcher, processes), concurrency in itertools.product(passes, args.concurrency):
                        if processes > concurrency:
                            continue  # as many as fetches at once at most
                        seconds, size, usage = asyncio.run(
                            fetch_pass(
                                server.address, adapters, concurrency, loop_ms, fetcher == "process", args.rounds, server.proc.pid,
                                max(processes, 1),
                            )
                        )  # fmt: skip
                        row = {
                            "fetcher": fetcher, **({"fetch_processes": processes} if processes else {}), "busy_thread": busy, "busy_loop_ms": loop_ms,
                            "switch_interval_ms": round(sys.getswitchinterval() * 1e3, 3), "concurrency": concurrency,
                            "fetches": args.rounds * len(adapters), "mb": round(size / 1e6, 3), "seconds": round(seconds, 3), "mb_s": round(size / 1e6 / seconds, 3),
                        }  # fmt: skip
                        for name, (cpu_s, faults) in usage.items():
                            row[f"{name}_cpu_s_per_gb"] = round(cpu_s / (size / 1e9), 3)
                            row[f"{name}_faults_per_mb"] = round(faults / (size / 1e6), 1)
                        print(json.dumps(row), flush=True)
                        rows.append(row)
        finally:
            sys.setswitchinterval(before)
            server.interrupt()
    return rows


if __name__ == "__main__":
    main()
