"""Greedy parity of tensor parallelism on GPUs in bf16: TP=N against TP=1, tie-aware.

    python benchmarks/tp_parity.py --tensor-parallel-size 2 --out tp_parity.json

A random Llama checkpoint (16 heads, 8 KV heads) and two random rank-16 PEFT adapters on all seven
projections; every prompt runs as the base model and under each adapter, through the whole engine (front,
plans, workers, CUDA-graph decode, Triton SGMV). Sums of bf16 partial products in another order round
differently, so sequences may part where two logits are within bf16 noise (bf16 logits near 2.5 are
1/64 apart, so several tokens often share the top value). Where TP=N's token first differs, both engines'
logits for that same prefix are read back: the divergence counts as a tie only when TP=1 scores TP=N's
token within `--tie-tolerance` (relative) of its own top logit; the report also gives the largest
difference between the two engines' logits there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import TokenDelta
from engine.sampling import SamplingParams
from loramux.demo_model import write_llama_checkpoint
from loramux.testing.peft_adapters import make_peft_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODEL = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
         "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 2048}  # fmt: skip


def generate(core: EngineCore, jobs: list[tuple[list[int], str]], num_tokens: int) -> list[list[int]]:
    results, done = [[] for _ in jobs], [threading.Event() for _ in jobs]
    for i, (prompt, adapter) in enumerate(jobs):
        record = core.resolve_adapter(adapter)
        packed = asyncio.run(core.prepare(record)) if record is not None else None

        def sink(event, i=i):
            if isinstance(event, TokenDelta):
                results[i] += event.token_ids
            else:
                done[i].set()

        params = SamplingParams(max_new_tokens=num_tokens, ignore_eos=True)
        core.loop.submit(core.new_request(prompt, params, sink, adapter=record, packed=packed))
    assert all(event.wait(600) for event in done)
    return results


def last_logits(core: EngineCore, prompt: list[int], adapter: str) -> torch.Tensor:
    """The logits [vocab] after `prompt` (one eager step on rank 0, read at its LM head)."""
    runner = core.workers.local.runner
    model = runner.model
    seen, real = [], model.compute_logits
    model.compute_logits = lambda hidden: seen.append(real(hidden)) or seen[-1]
    # A cached prompt makes a decode-shaped step, and a replayed graph computes its logits inside the graph,
    # out of this hook's reach: rank 0 runs the step eagerly (other ranks may replay theirs; the
    # collectives are the same).
    graphs, runner.graphs = runner.graphs, None
    try:
        generate(core, [(prompt, adapter)], 1)
    finally:
        model.compute_logits = real
        runner.graphs = graphs
    return seen[-1][-1].float().cpu()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--num-tokens", type=int, default=32)
    parser.add_argument("--tie-tolerance", type=float, default=0.02, help="top-2 gap / |top logit| counted as a tie")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tp-parity-"))
    model_dir = write_llama_checkpoint(root / "model", config=MODEL, seed=5)
    adapters = tuple((name, str(make_peft_adapter(model_dir, root / name, r=16, lora_alpha=32, target_modules=ALL, seed=s)))
                     for name, s in (("a", 1), ("b", 2)))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (int(n),), generator=gen).tolist() for n in torch.randint(8, 200, (args.num_prompts,), generator=gen)]
    jobs = [(p, a) for p in prompts for a in ("", "a", "b")]

    def core(tp: int) -> EngineCore:
        config = EngineConfig(model_dir=str(model_dir), device=args.device, adapters=adapters, work_dir=str(root / f"w{tp}"),
                              max_loras_per_batch=2, tensor_parallel_size=tp, num_kv_slots=200_000)  # fmt: skip
        c = EngineCore.build(config)
        c.loop.start()
        return c

    single = core(1)
    expected = generate(single, jobs, args.num_tokens)
    parallel = core(args.tensor_parallel_size)
    got = generate(parallel, jobs, args.num_tokens)
    graphs = parallel.workers.local.runner.graphs
    replays = graphs.num_replays if graphs is not None else 0
    del graphs  # a live reference would keep the captured collectives alive through the engines' close
    report = {"jobs": len(jobs), "tokens_per_job": args.num_tokens, "identical": 0, "ties": [], "mismatches": []}
    for (prompt, adapter), want, have in zip(jobs, expected, got, strict=True):
        if want == have:
            report["identical"] += 1
            continue
        j = next(i for i, (x, y) in enumerate(zip(want, have, strict=True)) if x != y)
        ours, theirs = last_logits(single, prompt + want[:j], adapter), last_logits(parallel, prompt + want[:j], adapter)
        top = float(ours.max())
        row = {"adapter": adapter, "position": j, "tp1": want[j], "tpn": have[j], "top": top,
               "tp1_logit_of_tpn": float(ours[have[j]]), "max_logit_diff": float((ours - theirs).abs().max()),
               "logit_std": float(ours.std())}  # fmt: skip
        is_tie = top - float(ours[have[j]]) <= args.tie_tolerance * abs(top)
        report["ties" if is_tie else "mismatches"].append(row)
    report["graph_replays_tpn"] = replays
    report["ok"] = not report["mismatches"]
    report.update(torch=torch.__version__, device=torch.cuda.get_device_name(0) if args.device == "cuda" else args.device, tensor_parallel_size=args.tensor_parallel_size)
    print(json.dumps(report), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    start = time.monotonic()
    parallel.close()
    single.close()
    print(f"engines closed in {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
