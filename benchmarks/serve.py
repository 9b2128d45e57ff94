"""End-to-end serving benchmark: the engine's real request path against HF transformers + peft.

    python benchmarks/serve.py --shape demo --device cpu --num-requests 8 --out report.json      # smoke
    python benchmarks/serve.py --shape llama-3-8b --device cuda --scenarios base 8 32 zipf       # H200

What runs, in one process and one run:
- a registry **process** (`loramux registry serve`, SQLite + local blobs in --work-dir) holding the base
  model and --num-adapters random PEFT adapters of the model's shape (rank --rank on all seven
  projections; random safetensors in PEFT's layout, uploaded once, reused by later runs of the same
  --work-dir);
- the engine **in process** (`start_engine`: the core, its registry link and loop thread, warmed up),
  driven through the admission path the gRPC and HTTP fronts call (engine/admission.py: resolve,
  checks, registry fetch into the host cache, submit, the request's event stream);
- the engine as a **process** (`loramux engine serve --registry ...`), driven over gRPC streams;
- HF transformers + peft on the same prompts and token counts: one batched greedy `generate` per
  adapter group (at most --max-running requests a batch), `set_adapter` between groups.

Scenarios: `base` (no adapter), `N` (request i uses adapter i mod N), `zipf` (Zipf(1.0) over all
--num-adapters adapters; more adapters than the engine's --max-loras slots, so fetches, host-cache hits
and slot loads are all real). Arrivals: all at once, or Poisson at --rate requests/s. Every request
sends --prompt-len random token ids and generates exactly --output-len tokens (ignore_eos).

Reported per (engine, scenario): output tok/s over the scenario's wall time, TTFT and inter-token
latency mean/p50/p99 (ms; a stream delta of k tokens counts as k gaps of its delay / k), adapter slot
loads (of them, loads ahead for queued requests) and host-cache hits/misses/joined lookups (a miss is
one fetch; a joined lookup waited for a fetch in flight) during the scenario (the engine's own counters
in process; its Prometheus /metrics over gRPC), LoRA/base throughput, and engine/HF+peft throughput.
--lora-load-ahead 0 turns load-ahead off for a comparison. --passes N runs each engine scenario N times
in a row (rows carry "pass"): the first pass fetches its adapters cold from the registry and loads their
slots, later ones find them in the host cache (and, with enough slots, still loaded): the steady state.
--target-modules picks the projections the adapters adapt (PEFT's default is q_proj and v_proj; all
seven by default). --slow-steps N (in-process engine) adds each scenario's N longest inter-token gaps
between the engine's token deliveries (`StepTrace`): what the delivered step computed, the host time and
slot loads of the launches made in the gap, and garbage collection inside it. --timeline-ms B adds
each engine scenario's timeline in buckets of B ms (`timeline`): where a cold pass falls behind the base
one; with --slow-steps too, each bucket also sums the step gaps that ended in it (their wait for the
device, launch host time, slot loads, collections). JSON to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import functools
import gc
import itertools
import json
import math
import os
import platform
import shutil
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from safetensors.torch import save_file

from engine.admission import GenerateInput
from engine.config import (
    DECODE_FUSED_TARGETS,
    DEFAULT_ADAPTER_PREP_THREADS,
    DEFAULT_FETCH_PROCESSES,
    DEFAULT_LORA_LOAD_AHEAD,
    DEFAULT_LORA_SM_CARVEOUT,
    LINEAR_WEIGHT_LAYOUTS,
    LORA_FUSED_TARGETS,
    EngineConfig,
    parse_target_sms,
)
from engine.request import Finished, TokenDelta
from engine.sampling import SamplingParams
from engine.server import start_engine
from lorakernels import tuned
from loramux.demo_model import LLAMA3_8B_CONFIG, write_llama_checkpoint
from loramux.engine_client import generate_request
from loramux.registry_client import RegistryClient
from loramux.testing.procs import Service
from loramux.v1 import engine_pb2_grpc
from loramux.v1 import registry_pb2 as reg_pb

SHAPES = {"demo": None, "llama-3-8b": LLAMA3_8B_CONFIG, "llama3-8b": LLAMA3_8B_CONFIG}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT_ID_RANGE = (3, 500)  # ids every vocabulary here has (the demo tokenizer's 512), past its specials


@dataclass(frozen=True)
class Workload:
    num_requests: int
    prompt_len: int
    output_len: int
    arrival: str  # "all" or "poisson"
    rate: float  # requests/s for poisson
    seed: int

    def prompts(self) -> list[list[int]]:
        rng = np.random.default_rng(self.seed)
        return [rng.integers(*PROMPT_ID_RANGE, self.prompt_len).tolist() for _ in range(self.num_requests)]

    def arrivals(self) -> list[float]:  # seconds after the scenario starts
        if self.arrival == "all":
            return [0.0] * self.num_requests
        gaps = np.random.default_rng(self.seed + 1).exponential(1.0 / self.rate, self.num_requests)
        return np.cumsum(gaps).tolist()


@dataclass(frozen=True)
class Scenario:
    name: str
    adapters: tuple[str, ...]  # per request: an adapter name, "" = the base model


def adapter_name(i: int, targets: tuple[str, ...] = TARGETS) -> str:
    """bench-<i> on all seven projections, else bench-<initials>-<i> (bench-qv-3: q_proj and v_proj)."""
    if set(targets) == set(TARGETS):
        return f"bench-{i}"
    return f"bench-{''.join(t[0] for t in targets)}-{i}"


def make_scenarios(
    names: list[str], num_requests: int, num_adapters: int, seed: int, targets: tuple[str, ...] = TARGETS
) -> list[Scenario]:
    name_of = functools.partial(adapter_name, targets=targets)
    out = []
    for name in names:
        if name == "base":
            adapters = ("",) * num_requests
        elif name == "zipf":  # Zipf(1.0): P(k-th most popular) ~ 1/k, popularity shuffled over names
            weights = 1.0 / np.arange(1, num_adapters + 1)
            rng = np.random.default_rng(seed + 2)
            ranks = rng.choice(num_adapters, num_requests, p=weights / weights.sum())
            names_by_rank = rng.permutation(num_adapters)
            adapters = tuple(name_of(int(names_by_rank[k])) for k in ranks)
        else:
            n = int(name)
            if not 1 <= n <= num_adapters:
                raise SystemExit(f"scenario {name}: want 1..--num-adapters ({num_adapters}) adapters")
            adapters = tuple(name_of(i % n) for i in range(num_requests))
        out.append(Scenario(name, adapters))
    return out


# -- model and adapters on disk ---------------------------------------------------------------------


def prepare_model(shape: str, work_dir: Path, device: str) -> Path:
    """The demo checkpoint, or a random bf16 checkpoint of a named shape (written once per work dir)."""
    model_dir = work_dir / f"model-{shape}"
    if (model_dir / "config.json").exists():
        return model_dir
    if SHAPES[shape] is None:
        return write_llama_checkpoint(model_dir)
    return write_random_hf_checkpoint(model_dir, SHAPES[shape], device)


def write_random_hf_checkpoint(model_dir: Path, config: dict, device: str) -> Path:
    """transformers' own random init drawn on `device` (fast where the CPU writer would take minutes),
    saved in HF format, with the demo tokenizer's files (prompts are token ids below its vocabulary)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    hf_config.architectures = config["architectures"]
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, torch_dtype=torch.bfloat16)
    model.save_pretrained(model_dir, safe_serialization=True, max_shard_size="5GB")
    del model
    tokenizer_dir = write_llama_checkpoint(model_dir.parent / "tokenizer-source")
    for path in tokenizer_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(path, model_dir / path.name)
    return model_dir


def module_dims(config: dict) -> dict[str, tuple[int, int]]:
    """PEFT target -> (in_dim, out_dim) for a Llama-family config.json."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    return {
        "q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size),
        "o_proj": (q_size, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }  # fmt: skip


def write_random_peft_adapter(
    out_dir: Path, config: dict, rank: int, seed: int, dtype: torch.dtype, targets: tuple[str, ...] = TARGETS
) -> Path:
    """A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) of the model's
    shape, rank `rank` on `targets`, random A and B (B nonzero): distinct content per seed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target, (in_dim, out_dim) in module_dims(config).items():
            if target not in targets:
                continue
            block = "self_attn" if target in TARGETS[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, in_dim, generator=gen) / in_dim**0.5).to(
                dtype
            )
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_dim, rank, generator=gen) * 0.02).to(dtype)
    save_file(tensors, out_dir / "adapter_model.safetensors", metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None,
        "base_model_name_or_path": config.get("_name_or_path", ""),
    }  # fmt: skip
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out_dir


def register_adapters(
    registry: str, model_dir: Path, work_dir: Path, num_adapters: int, rank: int, dtype, targets: tuple[str, ...] = TARGETS,
    workers: int = 8,
) -> dict[str, Path]:
    """Register the base model and adapters 0..N-1 on `targets` (skipping names already registered),
    `workers` adapters at a time (each written, uploaded and compiled while others are); name -> dir."""
    config = json.loads((model_dir / "config.json").read_text())
    base = model_dir.resolve().name
    names = [adapter_name(i, targets) for i in range(num_adapters)]
    dirs = {name: work_dir / "adapters" / name for name in names}
    with RegistryClient(registry) as client:
        client.register_base_model(base, model_dir)
        known = {a.name for a in client.list(base_model=base, latest_only=True)}

        def one(i: int) -> None:
            name = names[i]
            if not (dirs[name] / "adapter_config.json").exists():
                write_random_peft_adapter(dirs[name], config, rank, seed=1000 + i, dtype=dtype, targets=targets)
            if name not in known:
                client.register_adapter(reg_pb.AdapterSpec(name=name, base_model=base), dirs[name])

        with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
            list(pool.map(one, range(num_adapters)))  # re-raises the first failure
    return dirs


# -- clients: the engine in process, over gRPC ---------------------------------------------------------


class StepTrace:
    """The in-process engine's steps as its streams see them (--slow-steps). A loop iteration's tokens
    reach the streams when it ends (`after_step` runs last in it), so the time from one delivery to the
    next, where a request got a token in both, is an inter-token gap of that request. Each gap is
    recorded with the step whose tokens it delivered (its rows of one new token, decodes or prompts
    cached but for their last token; the new tokens of its other rows, prefill chunks; its rows with an
    adapter), the time inside post-processing (mostly the wait for the device), the launches made in the
    gap (their host time: planning, slot loads, the graph launch, and on the CPU the forward itself; and
    the slot loads they issued; under the overlapped schedule the next step goes out before this one's
    tokens are read, and delays them; of that, the time inside the slot loads' calls, from the runner's
    `recent_load_seconds`; how many of them were chained, launched before the step they follow was
    read), the time in the scheduler's `schedule` and `schedule_ahead` calls, and the garbage collection
    in it. Runs on the loop thread; `take` from any thread."""

    def __init__(self, loop, load_seconds: Sequence[float] = ()):
        self.gaps: list[dict] = []
        self._last_end: float | None = None  # the latest delivery (None: none since the last take)
        self._last_uids: frozenset[int] = frozenset()
        self._delivered: dict | None = None  # this iteration's post-processed step, not yet delivered
        self._start_gap()
        self.totals = {"slot_loads": 0, "prefill_tokens": 0}  # every step's since the last take, gap or not
        self.taken: list[dict] = []  # the gaps the last take returned
        self._gc_start: float | None = None
        real_launch, real_post, real_after = loop._launch, loop._post_process, loop.after_step
        scheduler = loop.scheduler
        real_schedule, real_ahead = scheduler.schedule, scheduler.schedule_ahead

        def launch(entries, previous=None):
            started = time.perf_counter()
            launched = None
            try:
                launched = real_launch(entries, previous)
                return launched
            finally:
                self._launch_ms += (time.perf_counter() - started) * 1e3
                self._chained += previous is not None and launched is not None
                loads = len(launched.plan.loads) if launched is not None else 0
                self._loads += loads
                if loads and load_seconds:  # this launch's loads are the runner's latest
                    self._load_ms += sum(itertools.islice(reversed(load_seconds), loads)) * 1e3
                self.totals["slot_loads"] += loads

        def timed(schedule):
            def call(*args):
                started = time.perf_counter()
                try:
                    return schedule(*args)
                finally:
                    self._schedule_ms += (time.perf_counter() - started) * 1e3

            return call

        def post_process(step) -> None:
            started = time.perf_counter()
            try:
                real_post(step)
            finally:
                self._add_delivered(step, (time.perf_counter() - started) * 1e3)

        def after_step() -> None:
            if real_after is not None:
                real_after()
            self._delivery(time.perf_counter())

        loop._launch, loop._post_process, loop.after_step = launch, post_process, after_step
        scheduler.schedule, scheduler.schedule_ahead = timed(real_schedule), timed(real_ahead)
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self._gc_ms += (time.perf_counter() - self._gc_start) * 1e3
            self._gc_start = None

    def _add_delivered(self, step, post_ms: float) -> None:
        plan, d = step.plan, self._delivered
        if d is None:
            d = self._delivered = {"uids": set(), "post_process_ms": 0.0, "decode_rows": 0, "prefill_tokens": 0, "lora_rows": 0}
        d["uids"] |= {e.req.uid for e in step.entries if e.samples}
        d["post_process_ms"] += post_ms
        prefill = sum(n for n in plan.extend_lens if n > 1)
        d["decode_rows"] += sum(1 for n in plan.extend_lens if n == 1)
        d["prefill_tokens"] += prefill
        self.totals["prefill_tokens"] += prefill
        d["lora_rows"] += sum(1 for slot in plan.lora_slots or () if slot >= 0)

    def _delivery(self, now: float) -> None:
        d, self._delivered = self._delivered, None
        if d is None:  # an iteration that delivered nothing (launches alone): its costs go to the next gap
            return
        uids = frozenset(d.pop("uids"))
        if self._last_end is not None and uids & self._last_uids:
            self.gaps.append({
                "gap_ms": (now - self._last_end) * 1e3, **d, "launch_host_ms": self._launch_ms, "chained": self._chained,
                "schedule_ms": self._schedule_ms, "slot_loads": self._loads, "slot_load_ms": self._load_ms, "gc_ms": self._gc_ms,
                "end": now,
            })  # fmt: skip
        self._last_end, self._last_uids = now, uids
        self._start_gap()

    def _start_gap(self) -> None:
        """Zero what the next gap accumulates: launch host time, chained launches, scheduling time, slot
        loads and their time, collection time."""
        self._launch_ms = self._load_ms = self._gc_ms = self._schedule_ms = 0.0
        self._loads = self._chained = 0

    def take(self, slowest: int) -> dict:
        """The gaps since the last take (p50/p99, and the `slowest` longest with their steps); gaps start
        again at the next delivery. The gaps themselves stay in `taken` (for the timeline)."""
        gaps, self.gaps, self._last_end = self.gaps, [], None
        self.taken = gaps
        totals, self.totals = self.totals, dict.fromkeys(self.totals, 0)
        ordered = sorted(gaps, key=lambda g: g["gap_ms"], reverse=True)
        values = np.array([g["gap_ms"] for g in gaps]) if gaps else None
        return {
            "step_gaps": len(gaps),
            "traced": totals,
            # rounded like the slow steps, so p99 never reads above the slowest gap it is taken from
            "step_gap_p50_ms": round(float(np.percentile(values, 50)), 3) if gaps else None,
            "step_gap_p99_ms": round(float(np.percentile(values, 99)), 3) if gaps else None,
            "slow_steps": [{k: round(v, 3) if isinstance(v, float) else v for k, v in g.items() if k != "end"} for g in ordered[:slowest]],
        }


class LoopLag:
    """How late the event loop runs a 1 ms timer while a scenario runs, in ms (p50 / p99 / max): in
    process, the engine's admission, its registry fetches and this benchmark's streams share one loop,
    and a fetch's chunks wait behind whatever else the loop runs. With --slow-steps only: its own
    wake-ups take the GIL a thousand times a second."""

    PERIOD_S = 0.001

    def __init__(self):
        self.lags: list[float] = []
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            started = time.perf_counter()
            await asyncio.sleep(self.PERIOD_S)
            self.lags.append(time.perf_counter() - started - self.PERIOD_S)

    async def stop(self) -> dict:
        self._task.cancel()
        await asyncio.wait([self._task])
        if not self.lags:
            return {}
        ms = np.array(self.lags) * 1e3
        return {"loop_lag_ms_p50": float(np.percentile(ms, 50)), "loop_lag_ms_p99": float(np.percentile(ms, 99)), "loop_lag_ms_max": float(ms.max())}


class InProcessClient:
    """The engine's admission path (engine/admission.py), called as the gRPC and HTTP fronts call it."""

    def __init__(self, server, slow_steps: int = 0):
        self.server = server
        self.core = server.core
        self.slow_steps = slow_steps
        runner = self.core.workers.local.runner
        self.trace = StepTrace(self.core.loop, runner.recent_load_seconds) if slow_steps > 0 else None

    async def stream(self, prompt: list[int], adapter: str, max_new: int) -> AsyncIterator[int]:
        params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
        generation = await self.server.admission.start(
            GenerateInput(adapter, params, token_ids=tuple(prompt))
        )
        async for event in generation.events():
            if isinstance(event, TokenDelta):
                yield len(event.token_ids)
            elif not isinstance(event, Finished):
                raise RuntimeError(f"request failed: {event}")

    async def counters(self) -> dict[str, int]:
        lora = self.core.lora
        if lora is None:
            return {}
        return {
            "slot_loads": lora.slots.num_loads,
            "slot_loads_ahead": lora.slots.num_loads_ahead,
            "host_cache_hits": lora.host_cache.num_hits,
            "host_cache_misses": lora.host_cache.num_misses,
            "host_cache_joined": lora.host_cache.num_joined,
            # adapters the pinned arena had no free block for (pinned fresh); absent with no arena
            **({"pinned_arena_misses": arena.num_misses} if (arena := self.core.pinned_arena) is not None else {}),
        }

    def step_report(self) -> dict:
        """--slow-steps: the scenario's step gaps (StepTrace.take); {} without."""
        return self.trace.take(self.slow_steps) if self.trace is not None else {}

    def fetch_times(self) -> list[tuple[float, float, float]]:
        """When each registry fetch since the last load_report was asked for, got its turn and ended
        (time.perf_counter); [] with no registry."""
        link = self.core.link
        return [(f.asked, f.started, f.done) for f in link.fetch_timings] if link is not None else []

    def load_report(self) -> dict:
        """The adapter loads into the host cache since the last call (EngineCore.load_timings): how many,
        and each stage's p50 / p99 / max in ms (getting the bytes, waiting for a packing thread,
        checking and packing); {} when none."""
        timings = list(self.core.load_timings)
        self.core.load_timings.clear()
        if not timings:
            return {}
        row: dict = {"loads_timed": len(timings)}
        for stage in ("fetch", "pack_wait", "pack"):
            row |= _spread(f"load_{stage}_ms", np.array([getattr(t, stage) for t in timings]) * 1e3)
        link = self.core.link
        if link is not None and link.fetch_timings:
            row |= fetch_report(list(link.fetch_timings))
            link.fetch_timings.clear()
        return row

    async def close(self) -> None:
        if self.trace is not None:
            gc.callbacks.remove(self.trace._on_gc)
        await self.server.stop()


def _spread(name: str, values: np.ndarray) -> dict:
    return {f"{name}_p50": float(np.percentile(values, 50)), f"{name}_p99": float(np.percentile(values, 99)), f"{name}_max": float(values.max())}


def fetch_report(fetches: list) -> dict:
    """The registry fetches of a scenario (RegistryLink.fetch_timings): the wait for a fetch turn and
    each transfer (p50 / p99 / max ms), and the bytes of all of them over the time from the first
    transfer's start to the last one's end (MB/s): which of the two bounds the fetching."""
    waits = np.array([f.started - f.asked for f in fetches]) * 1e3
    transfers = np.array([f.done - f.started for f in fetches]) * 1e3
    span = max(f.done for f in fetches) - min(f.started for f in fetches)
    return {
        "fetches": len(fetches), **_spread("fetch_turn_wait_ms", waits), **_spread("fetch_transfer_ms", transfers),
        "fetch_mb_s": sum(f.size for f in fetches) / 1e6 / span if span > 0 else None,
    }  # fmt: skip


class GrpcClient:
    """An engine process over gRPC; counters from its Prometheus endpoint."""

    METRICS: ClassVar[dict[str, str]] = {
        "slot_loads": "loramux_engine_adapter_loads_total",
        "slot_loads_ahead": "loramux_engine_adapter_loads_ahead_total",
        "host_cache_hits": "loramux_engine_host_cache_hits_total",
        "host_cache_misses": "loramux_engine_host_cache_misses_total",
        "host_cache_joined": "loramux_engine_host_cache_joined_total",
    }

    def __init__(self, process: Service, address: str, metrics_url: str):
        import grpc

        self.process = process
        self.metrics_url = metrics_url
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = engine_pb2_grpc.EngineStub(self.channel)

    async def stream(self, prompt: list[int], adapter: str, max_new: int) -> AsyncIterator[int]:
        request = generate_request(prompt, adapter, max_new_tokens=max_new, ignore_eos=True)
        async for response in self.stub.Generate(request):
            if response.WhichOneof("event") == "chunk":
                yield len(response.chunk.token_ids)

    async def counters(self) -> dict[str, int]:
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        )
        values = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            values[name] = value
        return {key: int(float(values.get(metric, "0"))) for key, metric in self.METRICS.items()}

    async def close(self) -> None:
        await self.channel.close()
        self.process.interrupt()


# -- one scenario: timed streams and their statistics --------------------------------------------------


@dataclass
class Trace:
    sent: float
    deltas: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in the delta)


async def timed_stream(
    client, start: float, arrival: float, prompt: list[int], adapter: str, max_new: int
) -> Trace:
    await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
    trace = Trace(time.perf_counter())
    async for num_tokens in client.stream(prompt, adapter, max_new):
        trace.deltas.append((time.perf_counter(), num_tokens))
    return trace


def latency_stats(prefix: str, values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {f"{prefix}_mean_ms": None, f"{prefix}_p50_ms": None, f"{prefix}_p99_ms": None}
    ms = np.asarray(values_s) * 1e3
    return {
        f"{prefix}_mean_ms": float(ms.mean()),
        f"{prefix}_p50_ms": float(np.percentile(ms, 50)),
        f"{prefix}_p99_ms": float(np.percentile(ms, 99)),
    }


def summarize(traces: list[Trace], wall_s: float) -> dict:
    ttft = [t.deltas[0][0] - t.sent for t in traces if t.deltas]
    itl = []
    for t in traces:
        for (prev, _), (now, n) in zip(t.deltas, t.deltas[1:], strict=False):
            itl += [(now - prev) / n] * n
    num_tokens = sum(n for t in traces for _, n in t.deltas)
    return {
        "output_tokens": num_tokens,
        "wall_s": wall_s,
        "output_tok_s": num_tokens / wall_s,
        **latency_stats("ttft", ttft),
        **latency_stats("itl", itl),
    }


STEP_SUMS = ("gap_ms", "post_process_ms", "launch_host_ms", "chained", "schedule_ms", "slot_loads", "slot_load_ms", "gc_ms")  # per bucket


def timeline(
    traces: list[Trace], start: float, wall_s: float, bucket_s: float, fetches: Sequence[tuple[float, float, float]] | None = None,
    gaps: Sequence[dict] | None = None,
) -> list[dict]:
    """The scenario in buckets of `bucket_s` from its start: output tokens delivered in each, requests
    that got their first token in it, requests streaming at its end (first token seen, last not yet),
    and, given their times (time.perf_counter: asked for, turn begun, ended), the registry fetches asked
    for, begun and ended in it; given the StepTrace gaps (each with its "end"), the gaps that ended in it
    and their sums (STEP_SUMS): how long the steps of that stretch took, and in what (the wait for the
    device, the launches' host time, slot loads, collections)."""
    num = max(1, math.ceil(wall_s / bucket_s - 1e-9))  # 0.4 / 0.1 is a hair over 4
    tokens, first, streaming = (np.zeros(num, dtype=np.int64) for _ in range(3))
    fetch_counts = {key: np.zeros(num, dtype=np.int64) for key in ("fetches_asked", "fetches_begun", "fetches_ended")}
    steps = np.zeros(num, dtype=np.int64)
    sums = {key: np.zeros(num) for key in STEP_SUMS}

    def bucket(when: float) -> int:
        return min(num - 1, max(0, int((when - start) / bucket_s)))

    for trace in traces:
        if not trace.deltas:
            continue
        for when, count in trace.deltas:
            tokens[bucket(when)] += count
        begin, end = bucket(trace.deltas[0][0]), bucket(trace.deltas[-1][0])
        first[begin] += 1
        streaming[begin:end] += 1
    for times in fetches or ():
        for key, when in zip(fetch_counts, times, strict=True):
            if when >= start:
                fetch_counts[key][bucket(when)] += 1
    for gap in gaps or ():
        if gap["end"] >= start:
            i = bucket(gap["end"])
            steps[i] += 1
            for key in STEP_SUMS:
                sums[key][i] += gap[key]
    return [
        {
            "t_s": round(i * bucket_s, 6), "tokens": int(tokens[i]), "first_tokens": int(first[i]), "streaming": int(streaming[i]),
            **({key: int(counts[i]) for key, counts in fetch_counts.items()} if fetches is not None else {}),
            **({"step_gaps": int(steps[i])} | {key: round(float(sums[key][i]), 2) for key in STEP_SUMS} if gaps is not None else {}),
        }
        for i in range(num)
    ]  # fmt: skip


async def run_scenario(client, scenario: Scenario, workload: Workload, timeline_s: float = 0.0) -> dict:
    prompts, arrivals = workload.prompts(), workload.arrivals()
    before = await client.counters()
    lag = None
    if isinstance(client, InProcessClient):
        client.step_report()  # the gaps and loads of this scenario alone
        client.load_report()
        lag = LoopLag() if client.trace is not None else None  # with --slow-steps: its wake-ups cost a little
    start = time.perf_counter()
    try:
        traces = await asyncio.gather(*(
            timed_stream(client, start, arrivals[i], prompts[i], scenario.adapters[i], workload.output_len)
            for i in range(workload.num_requests)
        ))  # fmt: skip
        wall_s = time.perf_counter() - start
    finally:
        lagged = await lag.stop() if lag is not None else {}
    after = await client.counters()
    row = summarize(traces, wall_s)
    row |= {key: after[key] - before.get(key, 0) for key in after}
    row["num_distinct_adapters"] = len({a for a in scenario.adapters if a})
    in_process = isinstance(client, InProcessClient)
    steps = client.step_report() if in_process else {}
    if timeline_s > 0:
        fetches = client.fetch_times() if in_process else None
        gaps = client.trace.taken if in_process and client.trace is not None else None
        row["timeline"] = timeline(traces, start, wall_s, timeline_s, fetches, gaps)
    if in_process:
        row |= steps | client.load_report() | lagged
    return row


async def run_engine(
    kind: str, make_client, scenarios: list[Scenario], workload: Workload, passes: int = 1, timeline_s: float = 0.0
) -> list[dict]:
    client = await make_client()
    rows = []
    try:
        for scenario in scenarios:
            for pass_ in range(1, passes + 1):
                row = {"engine": kind, "scenario": scenario.name, "arrival": workload.arrival, "pass": pass_}
                rows.append(row | await run_scenario(client, scenario, workload, timeline_s))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        await client.close()
    return rows


async def in_process_client(config: EngineConfig, slow_steps: int = 0) -> InProcessClient:
    return InProcessClient(await start_engine(config), slow_steps)


def engine_serve_args(config: EngineConfig) -> list[str]:
    """`loramux engine serve` arguments that build `config` in the engine process (ports picked there)."""
    args = [
        "engine", "serve", "--model", config.model_dir, "--port", "0", "--metrics-port", "0",
        "--registry", config.registry, "--device", config.device,
        "--max-loras-per-batch", str(config.max_loras_per_batch), "--max-lora-rank", str(config.max_lora_rank),
        "--max-host-adapters", str(config.max_host_adapters),
        "--host-pinned-gb", "auto" if config.host_pinned_gb is None else str(config.host_pinned_gb),
        "--adapter-prep-threads", str(config.adapter_prep_threads), "--gil-switch-interval-ms", str(config.gil_switch_interval_ms),
        "--max-concurrent-fetches", str(config.max_concurrent_fetches),
        *(["--disable-fetch-process"] if config.disable_fetch_process else []), "--fetch-processes", str(config.fetch_processes),
        "--max-running-requests", str(config.max_running_requests),
        "--max-batch-tokens", str(config.max_batch_tokens), "--max-context", str(config.max_context),
        "--num-kv-slots", str(config.num_kv_slots),
        "--max-queued-requests", str(config.max_queued_requests),
        "--lora-load-ahead", str(config.lora_load_ahead), "--cuda-graph-max-tokens", str(config.cuda_graph_max_tokens),
        "--lora-sm-carveout", str(config.lora_sm_carveout),
        *(["--lora-sm-carveout-target", *(f"{t}={n}" for t, n in config.lora_sm_carveout_targets)] if config.lora_sm_carveout_targets else []),
        "--lora-target-modules", *config.lora_target_modules,
    ]  # fmt: skip
    if config.kernel_configs:
        args += ["--kernel-configs", config.kernel_configs]
    if config.lora_decode_fused_expand:
        args += ["--lora-decode-fused-expand", *config.lora_decode_fused_expand]
    if config.lora_decode_fused_delta:
        args += ["--lora-decode-fused-delta", *config.lora_decode_fused_delta]
    if config.lora_decode_norm_shrink:
        args += ["--lora-decode-norm-shrink", *config.lora_decode_norm_shrink]
    if config.kernel_pdl:
        args += ["--kernel-pdl"]
    if not config.lora_pdl:
        args += ["--disable-lora-pdl"]
    if not config.tune_decode_gemms:
        args += ["--disable-decode-gemm-tuning"]
    args += ["--linear-weight-layout", config.linear_weight_layout]
    args += ["--lora-gemm-tail-blocks", str(config.lora_gemm_tail_blocks)]
    if config.lora_graph_segments:
        args += ["--lora-graph-segments", *map(str, config.lora_graph_segments)]
    if config.lora_backend:
        args += ["--lora-backend", config.lora_backend]
    return args


async def grpc_client(config: EngineConfig) -> GrpcClient:
    process = await asyncio.to_thread(Service, engine_serve_args(config), "engine", 900.0, ("metrics",))
    metrics_url = f"http://{process.addresses['metrics']}/metrics"
    return GrpcClient(process, process.address, metrics_url)


# -- HF transformers + peft ----------------------------------------------------------------------------


def run_hf_peft(
    model_dir: Path,
    adapter_dirs: dict[str, Path],
    scenarios: list[Scenario],
    workload: Workload,
    device: str,
    max_batch: int,
) -> list[dict]:
    """One greedy batched generate per adapter group, as a peft user serves a mixed batch."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype).to(device).eval()
    prompts = workload.prompts()
    peft_model, rows = None, []
    for scenario in scenarios:
        groups: dict[str, list[int]] = {}
        for i, adapter in enumerate(scenario.adapters):
            groups.setdefault(adapter, []).append(i)
        for adapter in groups:
            if adapter and (peft_model is None or adapter not in peft_model.peft_config):
                if peft_model is None:
                    peft_model = PeftModel.from_pretrained(model, adapter_dirs[adapter], adapter_name=adapter)
                else:
                    peft_model.load_adapter(adapter_dirs[adapter], adapter_name=adapter)
        _sync(device)
        start = time.perf_counter()
        num_tokens = sum(_hf_group(model, peft_model, adapter, [prompts[i] for i in rows_], workload.output_len, device, max_batch)
                         for adapter, rows_ in groups.items())  # fmt: skip
        wall_s = time.perf_counter() - start
        rows.append({
            "engine": "hf_peft", "scenario": scenario.name, "arrival": "batched", "output_tokens": num_tokens,
            "wall_s": wall_s, "output_tok_s": num_tokens / wall_s, "num_distinct_adapters": len(groups) - ("" in groups),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


@torch.inference_mode()
def _hf_group(
    model, peft_model, adapter: str, prompts: list[list[int]], output_len: int, device: str, max_batch: int
) -> int:
    if adapter:
        peft_model.set_adapter(adapter)
        runner = peft_model
    else:
        runner = model if peft_model is None else None
    num_tokens = 0
    for start in range(0, len(prompts), max_batch):
        ids = torch.tensor(prompts[start : start + max_batch], device=device)
        kwargs = {
            "max_new_tokens": output_len,
            "min_new_tokens": output_len,
            "do_sample": False,
            "pad_token_id": 0,
        }
        if runner is None:  # the base model inside a peft wrapper: adapters off for this group
            with peft_model.disable_adapter():
                out = peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        else:
            out = runner.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        _sync(device)
        num_tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return num_tokens


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- report --------------------------------------------------------------------------------------------


def add_ratios(rows: list[dict]) -> None:
    """lora_vs_base within each (engine, arrival, pass); vs_hf_peft for engine rows with an HF row alike."""

    def key(r: dict) -> tuple:
        return r["engine"], r["arrival"], r.get("pass")

    base = {key(r): r["output_tok_s"] for r in rows if r["scenario"] == "base"}
    hf = {r["scenario"]: r["output_tok_s"] for r in rows if r["engine"] == "hf_peft"}
    for r in rows:
        if key(r) in base:
            r["lora_vs_base"] = r["output_tok_s"] / base[key(r)]
        if r["engine"] != "hf_peft" and r["scenario"] in hf:
            r["vs_hf_peft"] = r["output_tok_s"] / hf[r["scenario"]]


def environment(device: str) -> dict:
    def version(module: str) -> str | None:
        try:
            return __import__(module).__version__
        except ImportError:
            return None

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit.stdout.strip() or None,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        **{name: version(name) for name in ("torch", "triton", "transformers", "peft")},
        "lora_tiles": tuned.describe(torch.device(device)),  # lorakernels/tuned.py: the tuned file, or built-in
        # the host: machines of one GPU kind differ in it, and a cold pass is partly host-bound
        "cpu": host_cpu(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
    }


def host_cpu() -> str | None:
    """The host CPU's model name (Linux's /proc/cpuinfo; the platform's processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def engine_config(args, model_dir: Path, registry: str) -> EngineConfig:
    max_context = args.prompt_len + args.output_len + 16
    return EngineConfig(
        model_dir=str(model_dir),
        device=args.device,
        registry=registry,
        max_loras_per_batch=args.max_loras,
        max_lora_rank=args.rank,
        lora_target_modules=tuple(args.lora_target_modules),
        max_host_adapters=args.max_host_adapters,
        host_pinned_gb=args.host_pinned_gb,
        adapter_prep_threads=args.adapter_prep_threads,
        gil_switch_interval_ms=args.gil_switch_interval_ms,
        max_concurrent_fetches=args.max_concurrent_fetches,
        disable_fetch_process=args.disable_fetch_process,
        fetch_processes=args.fetch_processes,
        max_running_requests=args.max_running,
        max_batch_tokens=args.max_batch_tokens,
        max_context=max_context,
        num_kv_slots=(args.max_running + 8) * max_context,
        max_queued_requests=max(1024, args.num_requests),
        lora_backend=args.lora_backend,
        lora_load_ahead=args.lora_load_ahead,
        cuda_graph_max_tokens=args.graph_max_tokens,
        lora_sm_carveout=args.lora_sm_carveout,
        lora_sm_carveout_targets=tuple(args.lora_sm_carveout_target),
        kernel_configs=args.kernel_configs,
        lora_decode_fused_expand=tuple(args.lora_decode_fused_expand),
        lora_decode_fused_delta=tuple(args.lora_decode_fused_delta),
        lora_decode_norm_shrink=tuple(args.lora_decode_norm_shrink),
        kernel_pdl=args.kernel_pdl,
        lora_pdl=not args.disable_lora_pdl,
        tune_decode_gemms=not args.disable_decode_gemm_tuning,
        linear_weight_layout=args.linear_weight_layout,
        lora_gemm_tail_blocks=args.lora_gemm_tail_blocks,
        lora_graph_segments=tuple(args.lora_graph_segments),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="demo", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--work-dir", default="/tmp/loramux-serve-bench", help="model, adapters, registry data")
    p.add_argument("--engines", nargs="+", default=["inproc", "grpc", "hf"], choices=("inproc", "grpc", "hf"))
    p.add_argument("--scenarios", nargs="+", default=["base", "1", "8", "32", "zipf"])
    p.add_argument(
        "--hf-scenarios",
        nargs="+",
        default=["base", "1", "8", "32"],
        help="HF+peft runs these of --scenarios",
    )
    p.add_argument("--arrival", nargs="+", default=["all"], choices=("all", "poisson"))
    p.add_argument("--rate", type=float, default=16.0, help="Poisson arrivals per second")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-adapters", type=int, default=1000, help="registered adapters (zipf draws over all)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--register-workers", type=int, default=8, help="adapters registered at a time before the runs")
    p.add_argument("--max-loras", type=int, default=32, help="the engine's GPU adapter slots")
    p.add_argument(
        "--lora-target-modules", nargs="*", default=[], choices=TARGETS,
        help="the engine's --lora-target-modules (slots only for these projections' targets; default all)",
    )
    p.add_argument("--max-host-adapters", type=int, default=64)
    p.add_argument(
        "--host-pinned-gb", type=lambda text: None if text == "auto" else float(text), default=None,
        help="the engine's --host-pinned-gb (0 = off; auto, the default: the engine's own size)",
    )  # fmt: skip
    p.add_argument("--adapter-prep-threads", type=int, default=DEFAULT_ADAPTER_PREP_THREADS, help="the engine's --adapter-prep-threads")
    p.add_argument("--gil-switch-interval-ms", type=float, default=0.0, help="the engine's --gil-switch-interval-ms (0 = Python's)")
    p.add_argument("--max-concurrent-fetches", type=int, default=4, help="the engine's --max-concurrent-fetches (registry fetches at once)")
    p.add_argument("--disable-fetch-process", action="store_true", help="the engine's --disable-fetch-process (fetch on its event loop)")
    p.add_argument("--fetch-processes", type=int, default=DEFAULT_FETCH_PROCESSES, help="the engine's --fetch-processes")
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--graph-max-tokens", type=int, default=2048, help="prefill and mixed steps up to N tokens replay graphs (0 = eager)")
    p.add_argument("--lora-backend", default="", help="the engine's SGMV backend (default: its own)")
    p.add_argument(
        "--lora-load-ahead", type=int, default=DEFAULT_LORA_LOAD_AHEAD,
        help="the engine's loads ahead per step for queued requests' adapters (0 = off)",
    )
    p.add_argument(
        "--lora-sm-carveout", type=int, default=DEFAULT_LORA_SM_CARVEOUT,
        help="the engine's SMs its decode GEMMs leave to the LoRA kernels (0 = none)",
    )
    p.add_argument(
        "--lora-sm-carveout-target", nargs="*", default=[], type=parse_target_sms, metavar="TARGET=SMS",
        help="the engine's --lora-sm-carveout-target",
    )
    p.add_argument("--kernel-configs", default="", help="the engine's --kernel-configs (tuned LoRA tiles' directory)")
    p.add_argument(
        "--lora-decode-fused-expand", nargs="*", default=[], choices=DECODE_FUSED_TARGETS, help="the engine's --lora-decode-fused-expand"
    )
    p.add_argument(
        "--lora-decode-fused-delta", nargs="*", default=[], choices=LORA_FUSED_TARGETS, help="the engine's --lora-decode-fused-delta"
    )
    p.add_argument("--kernel-pdl", action="store_true", help="the engine's --kernel-pdl")
    p.add_argument("--disable-lora-pdl", action="store_true", help="the engine's --disable-lora-pdl")
    p.add_argument("--disable-decode-gemm-tuning", action="store_true", help="the engine's --disable-decode-gemm-tuning")
    p.add_argument(
        "--lora-decode-norm-shrink", nargs="*", default=[], choices=DECODE_FUSED_TARGETS, help="the engine's --lora-decode-norm-shrink"
    )
    p.add_argument(
        "--linear-weight-layout", default="in_out", choices=LINEAR_WEIGHT_LAYOUTS, help="the engine's --linear-weight-layout"
    )
    p.add_argument(
        "--lora-graph-segments", nargs="*", type=int, default=[], help="the engine's --lora-graph-segments"
    )
    p.add_argument(
        "--lora-gemm-tail-blocks", type=int, default=EngineConfig.lora_gemm_tail_blocks,
        help="the engine's --lora-gemm-tail-blocks (0: off)",
    )
    p.add_argument(
        "--timeline-ms", type=float, default=0.0,
        help="add each engine scenario's timeline in buckets this long: tokens, first tokens, requests streaming,"
        " registry fetches ended (in process) (0: none)",
    )
    p.add_argument(
        "--slow-steps", type=int, default=0,
        help="in-process engine: report each scenario's N longest gaps between steps' token deliveries (StepTrace)",
    )
    p.add_argument("--passes", type=int, default=1, help="runs of each engine scenario in a row (2+: warm)")
    p.add_argument(
        "--target-modules", nargs="+", default=list(TARGETS), choices=TARGETS, help="the adapters' projections"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="write the JSON report here")
    args = p.parse_args(argv)
    if args.timeline_ms < 0:
        p.error(f"--timeline-ms must be >= 0, got {args.timeline_ms}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.passes < 1:
        raise SystemExit("--passes must be >= 1")
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(args.shape, work_dir, args.device)
    needs = [s for s in args.scenarios if s not in ("base", "zipf")]
    num_adapters = args.num_adapters if "zipf" in args.scenarios else max([int(s) for s in needs], default=0)
    targets = tuple(t for t in TARGETS if t in args.target_modules)
    scenarios = make_scenarios(args.scenarios, args.num_requests, num_adapters, args.seed, targets)
    registry = Service(["registry", "serve", "--port", "0", "--data-dir", str(work_dir / "registry"),
                        "--max-lora-rank", str(args.rank)], "registry")  # fmt: skip
    rows = []
    try:
        adapter_dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
        started = time.perf_counter()
        adapter_dirs = register_adapters(
            registry.address, model_dir, work_dir, num_adapters, args.rank, adapter_dtype, targets, args.register_workers
        )
        print(f"registry: {num_adapters} adapters ready in {time.perf_counter() - started:.1f}s", flush=True)
        config = engine_config(args, model_dir, registry.address)
        for arrival in args.arrival:
            workload = Workload(
                args.num_requests, args.prompt_len, args.output_len, arrival, args.rate, args.seed
            )
            if "inproc" in args.engines:
                rows += asyncio.run(
                    run_engine(
                        "inproc", lambda: in_process_client(config, args.slow_steps), scenarios, workload, args.passes,
                        args.timeline_ms / 1e3,
                    )
                )
                _free(args.device)
            if "grpc" in args.engines:
                rows += asyncio.run(
                    run_engine("grpc", lambda: grpc_client(config), scenarios, workload, args.passes, args.timeline_ms / 1e3)
                )
        if "hf" in args.engines:
            workload = Workload(
                args.num_requests, args.prompt_len, args.output_len, "all", args.rate, args.seed
            )
            hf_scenarios = [s for s in scenarios if s.name in args.hf_scenarios]
            rows += run_hf_peft(
                model_dir, adapter_dirs, hf_scenarios, workload, args.device, args.max_running
            )
    finally:
        registry.interrupt()
    add_ratios(rows)
    tuned.use_dir(args.kernel_configs or None)  # the tiles the engines read, for the report
    report = {"environment": environment(args.device), "args": vars(args), "results": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
