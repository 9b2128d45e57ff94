"""Profile decode steps of the engine (torch.profiler): where the host and the device spend a step.

    python benchmarks/profile_step.py --shape llama3-8b --batch 64 --adapters 32
    python benchmarks/profile_step.py --shape llama3-8b --batch 1 --adapters 8 --prefill-len 2048

First a host timeline of decode steps (median ms a step on rank 0): the front's schedule and plan, the
worker's preparation up to the graph launch, the launch call itself (`CUDAGraph.replay`), the wait for
the sampled tokens, and the device time of the replayed graph (CUDA events around it). Then the
torch.profiler tables, by host time and by device time.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.engine_step import SHAPES, build, make_request, step, sync
from engine.config import DECODE_FUSED_TARGETS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--adapters", type=int, default=0)
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--lora-backend", default="splitk" if torch.cuda.is_available() else "ref")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--gaps", action="store_true", help="then profile overlapped steps and list the device's idle gaps")
    parser.add_argument("--gaps-json", default="", help="with --gaps: write those steps' kernels and host calls to this file")
    parser.add_argument("--kernels-json", default="", help="then write every kernel of two steps (name, stream, start, duration in us) to this file")
    parser.add_argument("--prefill-len", type=int, default=0, help="profile prefill steps of prompts this long instead")
    parser.add_argument("--gemm-tail-blocks", type=int, default=4, help="the engine's --lora-gemm-tail-blocks (0: off)")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="the engine's --max-lora-rank (adapters are rank 16)")
    parser.add_argument("--kernel-pdl", action="store_true", help="the engine's --kernel-pdl")
    parser.add_argument("--disable-lora-pdl", action="store_true", help="the engine's --disable-lora-pdl")
    parser.add_argument("--decode-norm-shrink", nargs="*", default=[], choices=DECODE_FUSED_TARGETS, help="the engine's --lora-decode-norm-shrink")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    graphs = device.type == "cuda"
    if args.prefill_len:
        profile_prefill(args, device, graphs)
        return
    loop = build_loop(args, device, graphs, 64 + 64 + 8)
    vocab = loop.workers.local.runner.model.config.vocab_size
    for i in range(args.batch):
        loop.scheduler.add(make_request(i, 64, vocab, 64, f"adapter-{i % args.adapters}" if args.adapters else ""))
    for _ in range(5):
        step(loop)
    sync(device)
    start = time.perf_counter()
    for _ in range(5):
        step(loop)
    sync(device)
    print(f"decode step: {(time.perf_counter() - start) / 5 * 1e3:.2f} ms")
    if device.type == "cuda":
        timeline(loop, 20)
    with profile(activities=_activities(device)) as prof:
        for _ in range(3):
            step(loop)
        sync(device)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows))
        if args.gaps:
            idle_gaps(loop, args.rows, out=args.gaps_json)
        if args.kernels_json:
            kernel_lanes(loop, args.kernels_json)
    loop.workers.close()


def build_loop(args, device: torch.device, graphs: bool, max_len: int):
    """engine_step.py's engine for this run's options, its batch size's graphs, sequences up to max_len."""
    return build(
        SHAPES[args.shape], device, args.tensor_parallel_size, [args.batch], max_len, args.attention, args.adapters,
        args.lora_backend, graphs, gemm_tail_blocks=args.gemm_tail_blocks, max_lora_rank=args.max_lora_rank,
        decode_norm_shrink=tuple(args.decode_norm_shrink), kernel_pdl=args.kernel_pdl,
        lora_pdl=not args.disable_lora_pdl,
    )  # fmt: skip


def _activities(device: torch.device) -> list[ProfilerActivity]:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


# the LoRA kernels of a prefill step: lorakernels/sgmv.py's shrink/expand and split-K sum, and the expand
# fused into SiLU-mul (lorakernels/silu_mul.py), the GEMM tail's placement (lorakernels/gemm_tail.py; its shrink
# and expand are cuBLAS GEMMs, not told apart from the base's)
LORA_KERNELS = ("_sgmv_kernel", "_split_sum_kernel", "_silu_mul_expand_kernel", "_place_tail_kernel")


def lora_kernel_times(averages) -> tuple[float, dict[str, float]]:
    """(the device's time, us, and each LoRA kernel's) of a profile's key averages: the device's own
    events only, since a host op's self device time is its kernels' time again."""
    kernels = [e for e in averages if e.device_type != DeviceType.CPU]
    total = sum(e.self_device_time_total for e in kernels)
    return total, {e.key: e.self_device_time_total for e in kernels if e.key.startswith(LORA_KERNELS)}


def profile_prefill(args, device: torch.device, graphs: bool, steps: int = 3) -> None:
    """Prefill steps of `args.batch` prompts of `args.prefill_len` tokens: their mean wall time, the
    device-time table, and the LoRA kernels' share of the device time."""
    loop = build_loop(args, device, graphs, args.prefill_len + 8)
    vocab = loop.workers.local.runner.model.config.vocab_size
    rid = itertools.count()

    def prefill() -> int:
        for i in range(args.batch):
            loop.scheduler.add(make_request(next(rid), args.prefill_len, vocab, 1, f"adapter-{i % args.adapters}" if args.adapters else ""))
        tokens = step(loop)  # one new token each: the requests finish with the step
        if loop.scheduler.running:
            raise RuntimeError(f"{len(loop.scheduler.running)} requests still running: the prompts did not fit one step")
        return tokens

    try:
        for _ in range(2):  # compiles, slot loads, the allocator's growth
            prefill()
        sync(device)
        start = time.perf_counter()
        tokens = sum(prefill() for _ in range(steps))
        sync(device)
        wall = time.perf_counter() - start
        print(f"prefill step: {wall / steps * 1e3:.2f} ms, {tokens / wall:.0f} tok/s ({tokens // steps} tokens a step)")
        with profile(activities=_activities(device)) as prof:
            for _ in range(steps):
                prefill()
            sync(device)
        averages = prof.key_averages()
        print(averages.table(sort_by="self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total", row_limit=args.rows))
        if device.type == "cuda":
            total, lora = lora_kernel_times(averages)
            print(f"device time {total / steps / 1e3:.2f} ms a step; LoRA kernels {sum(lora.values()) / steps / 1e3:.2f} ms ({sum(lora.values()) / max(total, 1):.1%})")
            for name, us in sorted(lora.items(), key=lambda kv: -kv[1]):
                print(f"  {us / steps / 1e3:8.3f} ms  {name[:100]}")
    finally:
        loop.workers.close()


def idle_gaps(loop, rows: int, steps: int = 8, out: str = "") -> None:
    """Overlapped decode steps under the profiler: the device's busy share and its longest idle gaps,
    each with the kernels on either side (what the device waited between), from the third profiled
    step on (the profiler's own start-up falls in the first two). out: also write every profiled
    step's kernels (name, stream, start, duration in us) and the host's `_advance` calls (start,
    duration) there, as JSON, in us from the third call's start."""
    import json

    loop.overlap = True
    loop._advance()  # the pipeline fills
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2 + steps):
            with torch.profiler.record_function("advance"):
                loop._advance()
        torch.cuda.synchronize()
    traced = _device_events(prof, host_name="advance")
    calls = sorted(e["ts"] for e in traced if e.get("cat") == "user_annotation")
    events = [e for e in traced if e.get("cat") != "user_annotation"]
    if len(calls) < 3:
        raise RuntimeError(f"the trace holds {len(calls)} 'advance' ranges (want {2 + steps})")
    t0 = calls[2]  # the profiler's own start-up falls in the first two calls
    device = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e["ts"] >= t0)
    busy, gaps, end = 0.0, [], device[0][0]
    for i, (start, stop, name) in enumerate(device):
        if start > end:
            gaps.append((start - end, device[i - 1][2] if i else "", name))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - device[0][0]
    print(f"overlapped: {steps} steps in {span / 1e3:.2f} ms of device time line, busy {busy / span:.1%}, idle {(span - busy) / 1e3 / steps:.3f} ms a step")
    for gap, before, after in sorted(gaps, reverse=True)[:rows]:
        print(f"  idle {gap:8.1f} us   after {before[:60]:60s} before {after[:60]}")
    if out:
        kernels = [{"name": e["name"][:120], "stream": e.get("args", {}).get("stream"), "ts": round(e["ts"] - t0, 3), "dur": e["dur"]} for e in sorted(events, key=lambda e: e["ts"])]
        host = [{"ts": round(e["ts"] - t0, 3), "dur": e["dur"]} for e in traced if e.get("cat") == "user_annotation"]
        with open(out, "w") as f:
            json.dump({"kernels": kernels, "advance": host}, f)
        print(f"wrote {len(kernels)} kernels and {len(host)} advance calls to {out}")


def _device_events(prof, host_name: str = "") -> list[dict]:
    """The trace's device events (kernels, copies, memsets); with host_name, also the host ranges of
    that name (record_function), on the same clock."""
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return [
        e for e in trace["traceEvents"] if e.get("ph") == "X"
        and (e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") or (host_name and e.get("name") == host_name and e.get("cat") == "user_annotation"))
    ]  # fmt: skip


def kernel_lanes(loop, out: str, steps: int = 2) -> None:
    """Every kernel of `steps` decode steps with its stream, start and duration (us), as JSON: which
    kernels run beside which, and where the main stream waits."""
    import json

    step(loop)
    sync(loop.workers.local.runner.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(loop)
        torch.cuda.synchronize()
    events = sorted(_device_events(prof), key=lambda e: e["ts"])
    t0 = events[0]["ts"]
    rows = [{"name": e["name"][:120], "stream": e.get("args", {}).get("stream"), "ts": round(e["ts"] - t0, 3), "dur": e["dur"]} for e in events]
    with open(out, "w") as f:
        json.dump(rows, f)
    print(f"wrote {len(rows)} kernels of {steps} steps to {out}")


def timeline(loop, steps: int) -> None:
    """Median host milliseconds of each stage of a decode step, and the replayed graph's device time."""
    times: dict[str, list[float]] = defaultdict(list)
    graphs = loop.workers.local.runner.graphs
    replay_of = dict(graphs.steps)  # (batch, skipped targets, segments) -> the captured graph's replay
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            times[name].append((time.perf_counter() - start) * 1e3)
            return result

        return wrapper

    def replay(original):
        def wrapper():
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            logits = timed("graph launch (replay call)", original)()
            end.record()
            events.append((begin, end))
            return logits

        return wrapper

    graphs.steps = {key: replay(original) for key, original in replay_of.items()}
    schedule, plan, execute, run = loop.scheduler.schedule, loop.plan, loop.workers.execute, graphs.run
    loop.scheduler.schedule = timed("schedule", schedule)
    loop.plan = timed("plan", plan)
    loop.workers.execute = timed("execute (all of the worker's step)", execute)
    graphs.run = timed("graph run (inputs + launch)", run)
    try:
        for _ in range(steps):
            start = time.perf_counter()
            step(loop)
            times["step"].append((time.perf_counter() - start) * 1e3)
    finally:
        loop.scheduler.schedule, loop.plan, loop.workers.execute, graphs.run = schedule, plan, execute, run
        graphs.steps = replay_of
    torch.cuda.synchronize()
    times["graph on the device"] = [begin.elapsed_time(end) for begin, end in events]
    for name, values in times.items():
        print(f"{name:40s} {statistics.median(values):8.3f} ms")


if __name__ == "__main__":
    main()
