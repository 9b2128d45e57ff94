"""Decode-step time and prefill throughput of the engine's path (scheduler -> step plan -> model
workers -> sampled tokens), with random weights in a named shape, on 1..N tensor-parallel ranks.

    python benchmarks/engine_step.py --shape llama3-8b --device cuda --batch 1 32 --prompt-len 128
    python benchmarks/engine_step.py --shape llama3-70b --tensor-parallel-size 2 --adapters 0 1 8 32
    python benchmarks/engine_step.py --shape llama3-8b --batch 64 --mixed-chunk 64 256 1024 [--graph-max-tokens 0]

Reports, per batch size and number of distinct rank-16 adapters, the median time of a decode step
(every request computes one token and samples), next to the weight-read floors: the whole model's
parameter bytes / copy bandwidth, and one rank's (what each GPU reads per step), and the step's read floor:
the bytes a decode step cannot avoid reading (every weight but an untied embedding table, of which it
gathers its rows only, the KV cache its requests attend over, at the measured steps' mean context, and
each of its adapters once), / copy bandwidth; and prefill tokens/s. A row with adapters also gives its
throughput against the same batch's base step (throughput_vs_base), the ratio the adapters' bytes alone
allow (floor_vs_base: the base step's read floor over its own) and the share of that it reaches
(of_floor_vs_base).
With --mixed-chunk C, also the median mixed step: batch - 1 requests decoding beside C tokens of another
request's prompt (chunked prefill), replayed from a step graph or (--graph-max-tokens 0) run eagerly.
One engine (its slot pool sized for the most adapters, one decode graph per batch size) serves every row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks.* beside engine.*

from benchmarks.copy_rate import resolve_copy_gbps
from benchmarks.gpu_state import GpuState
from engine.adapter_cache import HostAdapterCache
from engine.adapter_slots import AdapterSlots
from engine.config import (
    DECODE_FUSED_TARGETS,
    DEFAULT_LORA_SM_CARVEOUT,
    LINEAR_WEIGHT_LAYOUTS,
    LORA_FUSED_TARGETS,
    PREFILL_FUSED_TARGETS,
    EngineConfig,
    parse_target_sms,
)
from engine.engine_loop import EngineLoop
from engine.kv_pool import PageAllocator, ReqToTokenPool
from engine.lora_manager import LoraManager
from engine.lora_pool import PackedAdapter, fused_targets
from engine.model_config import ModelConfig
from engine.named_shapes import NAMED_SHAPES
from engine.parallel import TensorParallel
from engine.radix_cache import RadixCache
from engine.request import Request
from engine.request_kv import RequestKV
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.text import StopMatcher
from engine.worker import WorkerSpec, start_workers
from lorakernels import tuned

# Llama-3-70B: 80 layers, hidden 8192, 64 heads / 8 KV heads, MLP 28672, vocab 128256 (70.6 B parameters)
LLAMA3_70B = replace(NAMED_SHAPES["llama3-8b"], hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64)
SHAPES: dict[str, ModelConfig] = {**NAMED_SHAPES, "llama3-70b": LLAMA3_70B}


class _NoText:
    """Benchmarks feed token ids: no detokenization."""

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_packed(
    digest: str, config: ModelConfig, rank: int, dtype: torch.dtype, seed: int, share: bool, fused: tuple[str, ...] = (),
    pin: bool = False,
) -> PackedAdapter:
    """A random adapter of `rank` on the fused targets `fused` (all four when empty: the seven
    projections), packed at full size (host memory: shared across processes with share, page-locked
    with pin, as the engine's host cache holds it for one GPU)."""
    gen = torch.Generator().manual_seed(seed)
    targets, layers = [t for t in fused_targets(config) if not fused or t.name in fused], config.num_layers
    a = {t.name: (torch.randn(layers, t.num_stack * rank, t.in_dim, generator=gen) * 0.01).to(dtype) for t in targets}
    b = {t.name: (torch.randn(layers, t.out_dim, rank, generator=gen) * 0.01).to(dtype) for t in targets}
    if share:
        for tensor in (*a.values(), *b.values()):
            tensor.share_memory_()
    if pin:
        a, b = ({name: t.pin_memory() for name, t in d.items()} for d in (a, b))
    return PackedAdapter(digest, rank, 2.0, a, b)


def build(config: ModelConfig, device: torch.device, tp: int, batches: list[int], max_context: int, attention: str, num_adapters: int, lora_backend: str, graphs: bool, nccl_only: bool = False, fused: tuple[str, ...] = (), graph_max_tokens: int = 2048, kv_tokens: int = 0, lora_sm_carveout: int = DEFAULT_LORA_SM_CARVEOUT, kernel_configs: str = "", decode_fused_expand: tuple[str, ...] = (), lora_sm_carveout_targets: tuple[tuple[str, int], ...] = (), decode_fused_delta: tuple[str, ...] = (), linear_weight_layout: str = "in_out", prefill_fused_expand: tuple[str, ...] = ("gate_up",), gemm_tail_blocks: int = 0, max_lora_rank: int = 16, decode_norm_shrink: tuple[str, ...] = (), kernel_pdl: bool = False, lora_pdl: bool = True, tune_decode_gemms: bool = True, graph_segments: tuple[int, ...] = ()):
    max_reqs = max(batches)
    engine = EngineConfig(
        model_dir="", device=device.type, max_running_requests=max_reqs, max_batch_tokens=max(8192, max_reqs),
        num_kv_slots=kv_tokens or max_reqs * max_context + 8, attention_backend=attention, max_loras_per_batch=num_adapters,
        max_lora_rank=max_lora_rank, lora_backend=lora_backend, cuda_graph_max_batch=max_reqs if graphs else 0, tensor_parallel_size=tp,
        cuda_graph_max_tokens=graph_max_tokens if graphs else 0,
        disable_custom_all_reduce=nccl_only, lora_sm_carveout=lora_sm_carveout, kernel_configs=kernel_configs,
        lora_decode_fused_expand=decode_fused_expand, lora_sm_carveout_targets=lora_sm_carveout_targets,
        lora_decode_fused_delta=decode_fused_delta, linear_weight_layout=linear_weight_layout,
        lora_prefill_fused_expand=prefill_fused_expand, lora_gemm_tail_blocks=gemm_tail_blocks,
        lora_decode_norm_shrink=decode_norm_shrink, kernel_pdl=kernel_pdl, lora_pdl=lora_pdl, lora_graph_segments=graph_segments,
        tune_decode_gemms=tune_decode_gemms,
    )  # fmt: skip
    spec = WorkerSpec(engine, max_context, TensorParallel(0, tp), random_config=config, graph_buckets=tuple(sorted(set(batches))))
    workers = start_workers(spec)
    allocator = PageAllocator(workers.info.num_kv_slots, 1)
    kv = RequestKV(allocator, ReqToTokenPool(max_reqs, max_context), RadixCache(1, allocator))
    lora = None
    if num_adapters:
        dtype = next(workers.local.runner.model.parameters()).dtype
        host = HostAdapterCache(num_adapters)
        # One random draw serves every adapter (the kernels' cost does not depend on the values; drawing
        # 32 adapters of a 70B shape on the host would take minutes); each still loads into its own slot.
        first = random_packed("adapter-0", config, 16, dtype, 0, share=tp > 1, fused=fused)
        for i in range(num_adapters):
            host.put(PackedAdapter(f"adapter-{i}", first.rank, first.scaling, first.a, first.b))
        lora = LoraManager(AdapterSlots(num_adapters), host)
    return EngineLoop(Scheduler(SchedulerConfig(max_reqs, max(8192, max_reqs)), kv, lora=lora), workers)


def make_request(i: int, prompt_len: int, vocab: int, max_new: int, namespace: str = "") -> Request:
    prompt = torch.randint(3, vocab, (prompt_len,), generator=torch.Generator().manual_seed(i)).tolist()
    return Request(
        rid=str(i), prompt_ids=prompt, params=SamplingParams(max_new_tokens=max_new, ignore_eos=True),
        namespace=namespace, sink=lambda event: None, detokenizer=_NoText(), stop_matcher=StopMatcher(()),
        eos_token_ids=frozenset(),
    )


def step(loop: EngineLoop) -> int:
    entries = loop.scheduler.schedule()
    plan, adapters = loop.plan(entries)
    tokens = loop.workers.execute(plan, adapters)
    for req, token in zip((e.req for e in entries if e.samples), tokens, strict=True):
        req.output_ids.append(token)
    for e in entries:
        if len(e.req.output_ids) >= e.req.params.max_new_tokens:
            loop.scheduler.finish(e.req, loop.scheduler.finished_event(e.req, None))
    return sum(e.extend_len for e in entries)


def measure(
    loop: EngineLoop, device: torch.device, batch: int, prompt_len: int, num_decode: int, num_adapters: int, salt: int = 0,
    gpu: GpuState | None = None,
) -> dict:  # fmt: skip
    """One round: `batch` requests over `num_adapters` distinct adapters, prefilled together, then decoded.
    With loop.overlap the decode steps go through the loop's own overlapped path (step k+1 launched
    before step k's tokens are read), each timed from one launch to the next. With `gpu`, its clocks
    are read after the 4th decode step, halfway and at the end (GpuState.summary's fields)."""
    model = loop.workers.local.runner.model
    for i in range(batch):
        namespace = f"adapter-{i % num_adapters}" if num_adapters else ""
        loop.scheduler.add(make_request(salt + 100_000 * batch + 1000 * num_adapters + i, prompt_len, model.config.vocab_size, num_decode + 1, namespace))
    sync(device)
    start = time.perf_counter()
    num_prefill = step(loop)  # the whole batch's prompts in one extend step
    sync(device)
    prefill_s = time.perf_counter() - start
    times = []
    if gpu is not None:
        gpu.reset()
    while loop.scheduler.running:
        start = time.perf_counter()
        if loop.overlap:
            loop._advance()
        else:
            step(loop)
            sync(device)
        times.append(time.perf_counter() - start)
        if gpu is not None and len(times) in (4, num_decode // 2):
            gpu.sample()
    while loop._in_flight is not None:  # a spare step planned before the last tokens were seen
        loop._advance()
    if gpu is not None:
        gpu.sample()
    sync(device)
    tp = model.tp.size
    rank_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    replicated = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "proj" not in n)
    param_bytes = tp * (rank_bytes - replicated) + replicated
    return {
        "batch": batch,
        "num_adapters": num_adapters,
        "decode_step_ms": statistics.median(times[3:]) * 1e3,
        # whether a slow median is every step slower or some steps much slower
        "decode_step_ms_p10_p90": [round(q * 1e3, 3) for q in _p10_p90(times[3:])],
        "prefill_tokens": num_prefill,
        "prefill_tok_s": num_prefill / prefill_s,
        "param_gb": param_bytes / 1e9,  # the whole model
        "rank_param_gb": rank_bytes / 1e9,  # what one GPU holds and reads per step
        "step_read_gb": (step_read_bytes(model, param_bytes, batch, prompt_len, len(times)) + adapter_read_bytes(loop, num_adapters)) / 1e9,
        **(gpu.summary() if gpu is not None else {}),
    }


def step_read_bytes(model, param_bytes: int, batch: int, prompt_len: int, num_steps: int) -> float:
    """The bytes a decode step of the whole model cannot avoid reading, averaged over the measured steps
    (the 4th to the last of num_steps): every parameter but an untied embedding table (a step gathers
    its batch's rows of it; a tied one is read whole by the LM head), and each request's KV cache, K and
    V of every layer over its context (prompt_len + 1 + i tokens at decode step i)."""
    c = model.full_config  # the whole model's KV heads (model.config is one rank's)
    embed = model.embed_tokens.weight
    unread = embed.numel() * embed.element_size() if model.lm_head is not None else 0
    kv_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * embed.element_size()
    measured = range(3, num_steps) if num_steps > 3 else range(num_steps)
    context = statistics.mean(prompt_len + 1 + i for i in measured) if measured else prompt_len
    return param_bytes - unread + batch * context * kv_per_token


def adapter_read_bytes(loop: EngineLoop, num_adapters: int) -> int:
    """The bytes of num_adapters adapters' A and B at the slots' rank on the pool's fused targets of the
    whole model (each adapter a step serves is read once: the LoRA kernels read a segment's adapter once
    and follow its rank)."""
    runner = loop.workers.local.runner
    pool = runner.lora_pool
    if pool is None or not num_adapters:
        return 0
    served = {t.name for t in pool.targets.values()}
    targets = [t for t in fused_targets(runner.model.full_config) if t.name in served]
    elements = sum(t.num_stack * pool.max_rank * t.in_dim + t.out_dim * pool.max_rank for t in targets)
    element_bytes = next(iter(pool.a.values())).element_size()
    return num_adapters * runner.model.full_config.num_layers * elements * element_bytes


def _p10_p90(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return deciles[0], deciles[-1]


def measure_mixed(loop: EngineLoop, device: torch.device, batch: int, prompt_len: int, chunk: int, num_adapters: int, num_steps: int = 12, salt: int = 0) -> dict:
    """batch - 1 requests decode while one more request's prompt is computed `chunk` tokens a step (the
    token budget is batch - 1 + chunk): the median of num_steps such mixed steps."""
    model, scheduler = loop.workers.local.runner.model, loop.scheduler
    vocab, budget = model.config.vocab_size, scheduler.config
    uid = salt + 900_000 + 1000 * num_adapters + batch
    for i in range(batch - 1):
        namespace = f"adapter-{i % num_adapters}" if num_adapters else ""
        scheduler.add(make_request(uid + i, prompt_len, vocab, 10 * num_steps, namespace))
    step(loop)  # their prompts
    scheduler.config = replace(budget, max_batch_tokens=batch - 1 + chunk)
    long = make_request(uid + batch, chunk * (num_steps + 4), vocab, 1, "adapter-0" if num_adapters else "")
    scheduler.add(long)
    times = []
    try:
        for _ in range(num_steps):
            sync(device)
            start = time.perf_counter()
            step(loop)
            sync(device)
            times.append(time.perf_counter() - start)
    finally:
        scheduler.config = budget
        for req in [*scheduler.running, *scheduler.waiting]:
            scheduler.finish(req, scheduler.finished_event(req, None))
    graphs = loop.workers.local.runner.step_graphs
    return {"batch": batch, "num_adapters": num_adapters, "mixed_chunk": chunk, "mixed_step_ms": statistics.median(times[2:]) * 1e3,
            "step_graph_replays": graphs.num_replays if graphs else 0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks (GPUs); ranks 1.. are spawned processes")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--num-decode", type=int, default=20)
    parser.add_argument("--attention", choices=("ref", "sdpa", "triton"), default="sdpa", help="the eager (prefill) attention backend")
    parser.add_argument("--adapters", type=int, nargs="+", default=[0], help="distinct rank-16 adapters (0 = base)")
    parser.add_argument("--lora-backend", default="triton", choices=("ref", "triton", "chunked", "splitk"))
    parser.add_argument(
        "--adapter-targets", nargs="+", default=[], choices=("qkv", "o", "gate_up", "down"),
        help="fused targets the adapters adapt (default all: the seven projections; qkv alone for q/v adapters)",
    )  # fmt: skip
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run every step eagerly")
    parser.add_argument(
        "--lora-sm-carveout", type=int, default=DEFAULT_LORA_SM_CARVEOUT, help="SMs decode GEMMs leave to the LoRA kernels (0 = none)"
    )
    parser.add_argument(
        "--lora-sm-carveout-target", nargs="*", default=[], type=parse_target_sms, metavar="TARGET=SMS",
        help="these fused targets' decode GEMMs leave SMS SMs in place of --lora-sm-carveout",
    )
    parser.add_argument("--kernel-configs", default="", help="tuned LoRA tile files' directory (default: the package's)")
    parser.add_argument(
        "--decode-fused-expand", nargs="*", default=[], choices=DECODE_FUSED_TARGETS, help="the engine's --lora-decode-fused-expand"
    )
    parser.add_argument("--kernel-pdl", action="store_true", help="the engine's --kernel-pdl")
    parser.add_argument("--disable-lora-pdl", action="store_true", help="the engine's --disable-lora-pdl")
    parser.add_argument("--disable-decode-gemm-tuning", action="store_true", help="the engine's --disable-decode-gemm-tuning")
    parser.add_argument(
        "--decode-norm-shrink", nargs="*", default=[], choices=DECODE_FUSED_TARGETS, help="the engine's --lora-decode-norm-shrink"
    )
    parser.add_argument(
        "--decode-fused-delta", nargs="*", default=[], choices=LORA_FUSED_TARGETS, help="the engine's --lora-decode-fused-delta"
    )
    parser.add_argument(
        "--prefill-fused-expand", nargs="*", default=["gate_up"], choices=PREFILL_FUSED_TARGETS,
        help="the engine's --lora-prefill-fused-expand",
    )
    parser.add_argument("--gemm-tail-blocks", type=int, default=4, help="the engine's --lora-gemm-tail-blocks (0: off)")
    parser.add_argument("--graph-segments", type=int, nargs="*", default=[], help="the engine's --lora-graph-segments")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="the engine's --max-lora-rank (the slots' rank capacity; adapters are rank 16)")
    parser.add_argument(
        "--linear-weight-layout", default="in_out", choices=LINEAR_WEIGHT_LAYOUTS, help="the engine's --linear-weight-layout"
    )
    parser.add_argument("--graph-max-tokens", type=int, default=2048, help="prefill and mixed steps up to N tokens replay step graphs (0 = eager)")
    parser.add_argument("--mixed-chunk", type=int, nargs="*", default=[], help="also time mixed steps: batch - 1 decodes + C prompt tokens")
    parser.add_argument("--disable-custom-all-reduce", action="store_true", help="every all-reduce through NCCL")
    parser.add_argument("--overlap", action="store_true", help="decode through the loop's overlapped schedule")
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="measure each batch's adapter counts N times in turn (rows carry 'repeat'): each ratio to base compares neighbours in time",
    )  # fmt: skip
    parser.add_argument(
        "--copy-gbps", type=float, default=0.0, help="device copy bandwidth for the floors, GB/s (0: measured on the device first)"
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.copy_gbps < 0:
        parser.error("--copy-gbps must be >= 0 (0: measure)")
    device = torch.device(args.device)
    args.copy_gbps = resolve_copy_gbps(args.copy_gbps, device)
    graphs = device.type == "cuda" and not args.no_cuda_graphs
    tp = args.tensor_parallel_size
    max_context = args.prompt_len + args.num_decode + 8
    # One engine (weights, KV, slot pool, one decode graph per batch size) serves every measurement.
    kv_tokens = 0
    if args.mixed_chunk:  # decoding requests run 10 tokens a timed step; the long prompt needs 16 chunks
        per_request = args.prompt_len + max(args.num_decode, 120) + 8
        kv_tokens = max(args.batch) * per_request + 16 * max(args.mixed_chunk) + 8
        max_context = max(per_request, 16 * max(args.mixed_chunk))
    loop = build(
        SHAPES[args.shape], device, tp, args.batch, max_context, args.attention, max(args.adapters), args.lora_backend, graphs,
        args.disable_custom_all_reduce, tuple(args.adapter_targets), args.graph_max_tokens, kv_tokens, args.lora_sm_carveout,
        args.kernel_configs, tuple(args.decode_fused_expand), tuple(args.lora_sm_carveout_target), tuple(args.decode_fused_delta),
        args.linear_weight_layout, tuple(args.prefill_fused_expand), args.gemm_tail_blocks, args.max_lora_rank,
        tuple(args.decode_norm_shrink), args.kernel_pdl, not args.disable_lora_pdl, not args.disable_decode_gemm_tuning,
        tuple(args.graph_segments),
    )  # fmt: skip
    carved = getattr(getattr(getattr(loop.workers, "local", None), "runner", None), "carved_gemms", None)
    for tuned_row in carved.report if carved is not None else []:
        print(json.dumps({"carved_gemm": tuned_row}), file=sys.stderr, flush=True)
    loop.overlap = args.overlap
    try:
        # A discarded round first (other prompts: no prefix hits later): kernels compile and the allocator
        # grows on their first steps
        measure(loop, device, max(args.batch), args.prompt_len, 4, max(args.adapters), salt=10**8)
        for chunk in args.mixed_chunk[:1]:
            measure_mixed(loop, device, max(args.batch), args.prompt_len, chunk, max(args.adapters), num_steps=3, salt=10**8)
        gpu = GpuState(device)
        for batch, repeat in [(b, r) for b in args.batch for r in range(args.repeats)]:
            base_ms = base_floor_ms = None
            for num_adapters in args.adapters:
                row = measure(loop, device, batch, args.prompt_len, args.num_decode, num_adapters, salt=repeat * 10**7, gpu=gpu)
                if args.repeats > 1:
                    row["repeat"] = repeat
                row["floor_ms"] = row["param_gb"] / args.copy_gbps * 1e3
                row["rank_floor_ms"] = row["rank_param_gb"] / args.copy_gbps * 1e3
                row["read_floor_ms"] = row["step_read_gb"] / args.copy_gbps * 1e3
                row["copy_gbps"] = round(args.copy_gbps, 1)
                if num_adapters == 0:
                    base_ms, base_floor_ms = row["decode_step_ms"], row["read_floor_ms"]
                if base_ms is not None:
                    row["throughput_vs_base"] = base_ms / row["decode_step_ms"]
                    # the ratio the adapters' bytes alone allow (the base step's read floor over this one's), and
                    # how much of it the step reaches: 1.0 would be a LoRA cost of its reads and nothing more
                    row["floor_vs_base"] = base_floor_ms / row["read_floor_ms"]
                    row["of_floor_vs_base"] = row["throughput_vs_base"] / row["floor_vs_base"]
                row.update(
                    shape=args.shape, tensor_parallel_size=tp, cuda_graphs=graphs, attention=args.attention,
                    lora_backend=args.lora_backend, adapter_targets=args.adapter_targets or "all", device=str(device), torch=torch.__version__,
                    all_reduce="nccl" if args.disable_custom_all_reduce or tp == 1 else "peer+nccl", overlap=args.overlap,
                    lora_sm_carveout=args.lora_sm_carveout, lora_sm_carveout_targets=dict(args.lora_sm_carveout_target), lora_tiles=tuned.describe(device), decode_fused_expand=args.decode_fused_expand,
                    decode_fused_delta=args.decode_fused_delta, linear_weight_layout=args.linear_weight_layout,
                    prefill_fused_expand=args.prefill_fused_expand, gemm_tail_blocks=args.gemm_tail_blocks, max_lora_rank=args.max_lora_rank,
                    decode_norm_shrink=args.decode_norm_shrink, kernel_pdl=args.kernel_pdl,
                    lora_pdl=not args.disable_lora_pdl, tune_decode_gemms=not args.disable_decode_gemm_tuning,
                    graph_segments=args.graph_segments,
                    decode_gemm_tune_s=round(carved.tune_seconds, 2) if carved is not None else 0.0,
                )  # fmt: skip
                print(json.dumps(row), flush=True)
                for chunk in args.mixed_chunk:
                    row = measure_mixed(loop, device, batch, args.prompt_len, chunk, num_adapters)
                    row.update(shape=args.shape, graph_max_tokens=args.graph_max_tokens if graphs else 0, lora_backend=args.lora_backend)
                    print(json.dumps(row), flush=True)
    finally:
        loop.workers.close()


if __name__ == "__main__":
    main()
