"""The CUDA-default engine path, run small on the CPU: Triton and SDPA attention, the Triton and chunked SGMV backends
(Triton's CPU interpreter, TRITON_INTERPRET=1, set here before any kernel is imported) and bfloat16.

In float32 every backend must give the reference backends' greedy tokens exactly, for a batch that mixes
the base model and two adapters. bfloat16 cannot match float32 token for token (near-tied logits of a
random model flip), so each bfloat16 token is checked against peft in float32 by teacher forcing: it
must be one of the tokens float32 ranks top within bfloat16's error.
"""

from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import threading  # noqa: E402

import pytest  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from engine.request import Finished, FinishReason, TokenDelta  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(HAS_CUDA, reason="with CUDA the GPU tests run these backends natively")

ADAPTERS = {
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=81),
    "all": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], seed=82),
}
JOBS = [("Hello world, this is", ""), ("The quick brown fox", "qv"), ("1 2 3 4 5", "all")]  # one batch
NUM_TOKENS = 4
BF16_LOGIT_SLACK = 0.1  # measured: bf16 picks are within 0.04 of the best fp32 logit; logits spread ~1


@pytest.fixture(scope="module")
def adapter_dirs(make_adapter):
    return {name: make_adapter(f"backends-{name}", **kwargs) for name, kwargs in ADAPTERS.items()}


def run_batch(
    model_dir, adapter_dirs, tmp_path, static_steps: tuple[int, ...] = (), static_decode: tuple[int, ...] = (), jobs=JOBS,
    replayed: list | None = None, step_fused_expand: frozenset[str] = frozenset({"gate_up"}), graph_segments: tuple[int, ...] = (),
    replayed_keys: list | None = None, **config,
) -> list[list[int]]:
    """JOBS submitted together before the loop starts (one batch); each job's greedy tokens.
    static_steps: token buckets of CUDA-graph steps (engine/step_graphs.py) run uncaptured on the CPU,
    which then serve every step, under the overlapped schedule (chained plans). static_decode: batch
    buckets of the decode graphs (engine/cuda_graphs.py) run uncaptured, which then serve every decode
    step, the paged decode-attention kernel included; replayed gets the LoRA variant (the targets it
    skips) of each decode step; graph_segments: the decode graphs' segment buckets; replayed_keys gets
    each decode replay's key (batch, skipped targets, segments) and the segments its step filled."""
    adapters = tuple((name, str(path)) for name, path in adapter_dirs.items())
    core = EngineCore.build(EngineConfig(model_dir=str(model_dir), adapters=adapters, work_dir=str(tmp_path / "work"), **config))
    if static_decode:
        from engine.attention import DecodeKernelBackend
        from engine.cuda_graphs import DecodeGraphs

        runner = core.workers.local.runner
        c = runner.model.config
        decode = DecodeKernelBackend(runner.req_to_token, c.num_heads, c.num_kv_heads, c.head_dim)
        runner.graphs = DecodeGraphs(
            runner.model, runner.kv, decode, max(static_decode), runner.lora_pool, runner.lora_ops, static_decode, capture=False,
            segment_buckets=graph_segments,
        )  # fmt: skip
        runner.graphs.capture()
        core.loop.overlap = True
        decode_eager, real_decode_eager = [], runner._run_eager
        runner._run_eager = lambda plan: decode_eager.append(plan.is_decode) or real_decode_eager(plan)
        decode_chained, real_decode = [], runner.graphs.run
        runner.graphs.run = lambda *args: decode_chained.append(args[-1] is not None) or real_decode(*args)
        if replayed is not None:
            runner.graphs.steps = {key: _counted(key, step, replayed) for key, step in runner.graphs.steps.items()}
        if replayed_keys is not None:  # each replay with the segment count of the fill before it
            fills, real_fill = [], runner.graphs.lora_meta.fill
            runner.graphs.lora_meta.fill = lambda seg_lens, *args: fills.append(len(seg_lens)) or real_fill(seg_lens, *args)
            runner.graphs.steps = {
                key: (lambda key=key, step=step: replayed_keys.append((key, fills[-1] if key[1] is not None else 0)) or step())
                for key, step in runner.graphs.steps.items()
            }
    if static_steps:
        from engine.step_graphs import StepGraphs

        runner = core.workers.local.runner
        runner.step_graphs = StepGraphs(
            runner.model, runner.kv, runner.req_to_token, max(static_steps), runner.lora_pool, runner.lora_ops,
            buckets=static_steps, capture=False, fused_expand=step_fused_expand, gemm_tail=runner.gemm_tail,
        )  # fmt: skip
        runner.step_graphs.capture()
        core.loop.overlap = True  # plans made before the last step's tokens arrive: chained input ids
        eager, real_eager = [], runner._run_eager
        runner._run_eager = lambda plan: eager.append(plan) or real_eager(plan)
        chained, real_run = [], runner.step_graphs.run
        runner.step_graphs.run = lambda *args: chained.append(args[-1] is not None) or real_run(*args)
    streams = []
    for prompt, adapter in jobs:
        tokens, finals, done = [], [], threading.Event()

        def sink(event, tokens=tokens, finals=finals, done=done):
            if isinstance(event, TokenDelta):
                tokens.extend(event.token_ids)
            else:
                finals.append(event)
                done.set()

        record = core.resolve_adapter(adapter) if adapter else None
        packed = asyncio.run(core.prepare(record)) if record is not None else None  # the one loading path
        params = SamplingParams(max_new_tokens=NUM_TOKENS, ignore_eos=True)
        core.loop.submit(core.new_request(core.prompt_ids(prompt, None), params, sink, adapter=record, packed=packed))
        streams.append((tokens, finals, done))
    core.loop.start()
    try:
        for _, finals, done in streams:
            assert done.wait(300), "no final event"
            assert finals == [Finished(FinishReason.LENGTH, "", finals[0].prompt_tokens, NUM_TOKENS, 0)]
    finally:
        core.loop.stop()
    if static_steps:
        assert core.workers.local.runner.step_graphs.num_replays >= NUM_TOKENS and not eager  # every step
        assert any(chained)  # some replays read the previous step's tokens on the device
    if static_decode:
        assert core.workers.local.runner.graphs.num_replays >= NUM_TOKENS - 1 and not any(decode_eager)
        pool = core.workers.local.runner.lora_pool  # a replay's unused segments name the base slot (rank 0)
        assert core.workers.local.runner.graphs.lora_meta.pad_slot == pool.base_slot and pool.ranks[pool.base_slot] == 0
        assert any(decode_chained)  # some replays read the previous step's tokens on the device
    return [tokens for tokens, _, _ in streams]


def _counted(key, step, replayed: list):
    def run():
        replayed.append(key[1])
        return step()

    return run


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, adapter_dirs, tmp_path_factory):
    """The reference backends' float32 tokens (the CPU defaults: "ref" attention and LoRA)."""
    return run_batch(tiny_llama_dir, adapter_dirs, tmp_path_factory.mktemp("ref"), attention_backend="ref", lora_backend="ref")


@pytest.mark.parametrize("lora_backend", ["triton", "chunked", "splitk"])
def test_sdpa_and_sgmv_backends_give_the_reference_tokens(tiny_llama_dir, adapter_dirs, reference, tmp_path, lora_backend):
    tokens = run_batch(tiny_llama_dir, adapter_dirs, tmp_path, attention_backend="sdpa", lora_backend=lora_backend)
    assert tokens == reference
    assert len({tuple(t) for t in tokens}) == len(JOBS)  # base and adapters differ: LoRA was applied


def test_triton_prefill_attention_gives_the_reference_tokens(tiny_llama_dir, adapter_dirs, reference, tmp_path, monkeypatch):
    """The Triton extend-attention kernel serves every eager step (prefill, prefix hits, decode)."""
    from lorakernels import extend_attention as module

    calls, real = [], module.extend_attention
    monkeypatch.setattr(module, "extend_attention", lambda *args, **kwargs: calls.append(args[4].num_tokens) or real(*args, **kwargs))
    tokens = run_batch(tiny_llama_dir, adapter_dirs, tmp_path, attention_backend="triton", lora_backend="ref")
    assert tokens == reference
    # the prefill step (every prompt) and decode steps (one token per request) both ran through it
    assert max(calls) > len(JOBS) and len(JOBS) in calls


@pytest.mark.parametrize(
    "budget, buckets, lora_backend",
    [(7, (2, 4, 7), "ref"), (7, (2, 4, 7), "splitk"), (40, (4, 16, 40), "triton"), (40, (4, 16, 40), "splitk")],
)
def test_graph_steps_over_static_buffers_give_the_reference_tokens(tiny_llama_dir, adapter_dirs, reference, tmp_path, budget, buckets, lora_backend):
    """The steps CUDA graphs replay (engine/step_graphs.py), run uncaptured: a 7-token budget splits the
    prompts into chunks beside decodes of base and adapter rows, a 40-token one takes them in one step
    (segments of more than 16 rows); each step is padded to a bucket, with the attention plan, LoRA
    segments and sample rows refilled in place, and chained input ids resolved on the device."""
    tokens = run_batch(
        tiny_llama_dir, adapter_dirs, tmp_path, static_steps=buckets, attention_backend="ref", lora_backend=lora_backend,
        max_batch_tokens=budget, max_running_requests=3,
    )  # fmt: skip
    assert tokens == reference


def test_graph_steps_leaving_o_and_down_expands_to_the_norm_give_the_reference_tokens(tiny_llama_dir, adapter_dirs, reference, tmp_path, monkeypatch):
    """--lora-prefill-fused-expand gate_up o down in the steps graphs replay, run uncaptured: the prompts'
    step, padded to 96 tokens (past a decode-sized step's 64-row segments), hands o's and down's expand on
    to the residual add + RMSNorm (on the CPU it adds it in line; lorakernels/rmsnorm.py
    `add_rmsnorm_expand` on CUDA), and the tokens are the reference's."""
    from engine.lora_inputs import PendingExpand
    from engine.models.blocks import RMSNorm

    pending, real = [], RMSNorm.add_forward
    monkeypatch.setattr(
        RMSNorm, "add_forward",
        lambda self, x, residual, delta=None, out=None, shrink=None: pending.append(isinstance(delta, PendingExpand))
        or real(self, x, residual, delta, out, shrink),
    )  # fmt: skip
    tokens = run_batch(
        tiny_llama_dir, adapter_dirs, tmp_path, static_steps=(4, 96), attention_backend="ref", lora_backend="splitk",
        max_batch_tokens=96, max_running_requests=3, step_fused_expand=frozenset({"gate_up", "o", "down"}),
    )  # fmt: skip
    assert tokens == reference
    assert sum(pending) >= 2 * 2  # the prompt step's o and down in both layers at least


@pytest.mark.parametrize("buckets, lora_backend", [((1, 2, 4), "triton"), ((4,), "splitk")])
def test_decode_steps_over_static_buffers_give_the_reference_tokens(tiny_llama_dir, adapter_dirs, reference, tmp_path, buckets, lora_backend):
    """The decode steps CUDA graphs replay (engine/cuda_graphs.py), run uncaptured: three requests (base,
    q/v, all seven projections) padded to the bucket (4: one padding row on the base slot), their LoRA
    segments and the decode-attention metadata refilled in place, chained input ids resolved on the
    device; every decode step goes through them."""
    tokens = run_batch(
        tiny_llama_dir, adapter_dirs, tmp_path, static_decode=buckets, attention_backend="ref", lora_backend=lora_backend,
    )  # fmt: skip
    assert tokens == reference


def test_decode_steps_of_qv_adapters_take_the_graph_that_skips_the_other_targets(tiny_llama_dir, adapter_dirs, reference, tmp_path):
    """A decode batch of the base model and a q/v adapter replays the variant whose o, gate_up and down
    projections run no LoRA kernels, and still gives the reference tokens; a batch with an adapter on
    all seven projections takes the variant that runs them all."""
    replayed: list = []
    tokens = run_batch(
        tiny_llama_dir, adapter_dirs, tmp_path, static_decode=(2,), jobs=JOBS[:2], replayed=replayed,  # base, q/v
        attention_backend="ref", lora_backend="splitk",
    )  # fmt: skip
    assert tokens == reference[:2]
    assert replayed and set(replayed) == {frozenset({"o", "gate_up", "down"})}
    replayed.clear()
    run_batch(tiny_llama_dir, adapter_dirs, tmp_path / "all", static_decode=(4,), replayed=replayed, attention_backend="ref", lora_backend="splitk")
    assert replayed and set(replayed) == {frozenset()}


def test_decode_steps_replay_the_graph_of_the_fewest_segments_that_hold_theirs(tiny_llama_dir, adapter_dirs, tmp_path):
    """--lora-graph-segments 1 2 3: batch 4's LoRA graphs are also captured for 1, 2 and 3 segments, and each
    decode step replays the one of the fewest that hold its own segments: two requests on the all-projection
    adapter and one on q/v (their rows, then the padding row's), with the tokens of the graphs of one
    segment a row; with no bucket that holds a step, the graph of one segment a row."""
    jobs = [("Hello world, this is", "all"), ("The quick brown fox", "all"), ("1 2 3 4 5", "qv")]
    kwargs = dict(static_decode=(4,), jobs=jobs, attention_backend="ref", lora_backend="splitk")
    replayed_keys: list = []
    plain = run_batch(tiny_llama_dir, adapter_dirs, tmp_path / "plain", replayed_keys=replayed_keys, **kwargs)
    assert {key[2] for key, _ in replayed_keys} == {4}
    replayed_keys.clear()
    tokens = run_batch(tiny_llama_dir, adapter_dirs, tmp_path, graph_segments=(1, 2, 3), replayed_keys=replayed_keys, **kwargs)
    assert tokens == plain
    assert replayed_keys and all(key[2] == filled for key, filled in replayed_keys)  # the step's own count, captured
    assert {key[2] for key, _ in replayed_keys} == {3}  # all, q/v, the padding row on the base slot
    replayed_keys.clear()
    tokens = run_batch(tiny_llama_dir, adapter_dirs, tmp_path / "one", graph_segments=(1, 2), replayed_keys=replayed_keys, **kwargs)
    assert tokens == plain
    assert {key[2] for key, _ in replayed_keys} == {4}  # three segments fit neither 1 nor 2


def test_segment_counts_start_where_a_batch_fits_and_end_at_one_a_row():
    from engine.cuda_graphs import DecodeGraphs

    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.segment_buckets = (2, 4, 8, 16, 64)
    assert graphs.segment_counts(1) == [1]
    assert graphs.segment_counts(8) == [2, 4, 8]
    assert graphs.segment_counts(64) == [4, 8, 16, 64]  # 64 rows are at least 4 runs of 16
    assert graphs.segment_counts(128) == [8, 16, 64, 128]


def test_bfloat16_default_path_picks_float32_top_tokens(tiny_llama_dir, adapter_dirs, tmp_path):
    """dtype bfloat16 with the Triton attention and splitk LoRA backends (the CUDA defaults but graphs): at every step the token
    chosen is within BF16_LOGIT_SLACK of the best float32 logit of peft for that adapter."""
    from transformers import AutoTokenizer

    from loramux.testing.peft_adapters import load_peft_model

    tokens = run_batch(tiny_llama_dir, adapter_dirs, tmp_path, dtype="bfloat16", attention_backend="triton", lora_backend="splitk")
    model = load_peft_model(tiny_llama_dir, adapter_dirs)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    for (prompt, adapter), generated in zip(JOBS, tokens, strict=True):
        prompt_ids = tokenizer(prompt).input_ids
        ids = torch.tensor([prompt_ids + generated])
        with torch.inference_mode():
            logits = model(input_ids=ids, adapter_names=[adapter or "__base__"]).logits[0].float()
        steps = logits[len(prompt_ids) - 1 : -1]  # [NUM_TOKENS, vocab]: the logits each token was chosen from
        chosen = steps.gather(1, torch.tensor(generated)[:, None])[:, 0]
        gaps = steps.max(dim=1).values - chosen
        assert (gaps <= BF16_LOGIT_SLACK).all(), (prompt, adapter, gaps.tolist())


def test_the_lora_sm_carveout_reaches_the_decode_graphs_lora_inputs(tiny_llama_dir, adapter_dirs, tmp_path, monkeypatch):
    """EngineConfig.lora_sm_carveout -> the worker's runner -> each LoRA decode graph's LoraInputs, where
    the base GEMMs beside the side stream take it (tests/engine/test_lora_slots.py; on the CPU there is
    no side stream, so only the hand-over shows here). The captures are stubbed: the steps are built."""
    import engine.cuda_graphs

    adapters = tuple((name, str(path)) for name, path in adapter_dirs.items())
    core = EngineCore.build(
        EngineConfig(
            model_dir=str(tiny_llama_dir), adapters=adapters, work_dir=str(tmp_path / "work"), lora_sm_carveout=12,
            lora_sm_carveout_targets=(("gate_up", 0),),
        )
    )
    runner = core.workers.local.runner
    assert runner.lora_sm_carveout == 12 and runner.lora_sm_carveout_targets == {"gate_up": 0}
    made, real = [], engine.cuda_graphs.LoraInputs

    def lora_inputs(*args, **kwargs):
        made.append((kwargs["sm_carveout"], kwargs["sm_carveout_targets"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.cuda_graphs, "LoraInputs", lora_inputs)
    monkeypatch.setattr(engine.cuda_graphs, "capture_steps", lambda keys, make, device, pool, capture: ({k: make(*k) for k in keys}, pool))
    runner.enable_cuda_graphs(2, (2,))
    assert runner.graphs.sm_carveout == 12
    assert made == [(12, {"gate_up": 0})] * len(runner.graphs.lora_variants)
    # eager steps: a decode step's LoraInputs (a side stream on CUDA; a stand-in here) take the carve-out,
    # a prefill step's (no side stream, no GEMM beside LoRA kernels) do not
    runner.lora_side = object()
    decode, prefill = runner._lora_inputs(two_row_plan(1)), runner._lora_inputs(two_row_plan(3))
    assert decode.side is runner.lora_side and decode.sm_carveout == 12 and decode.sm_carveout_targets == {"gate_up": 0}
    assert prefill.side is None and prefill.sm_carveout == 0 and prefill.sm_carveout_targets == {}


def test_decode_fused_expand_is_the_asked_targets_where_the_kernels_can_take_it():
    """--lora-decode-fused-expand fuses the decode expands asked for only on CUDA, with the Triton SGMV
    ops, for slots the SiLU-mul kernel loads whole; anywhere else it is a no-op, never an error."""
    from engine.lora_inputs import decode_fused_targets
    from lorakernels.silu_mul import FUSED_MAX_RANK

    cuda, cpu, both = torch.device("cuda", 0), torch.device("cpu"), ("qkv", "gate_up")
    assert decode_fused_targets(both, cuda, "splitk", 16) == decode_fused_targets(both, cuda, "triton", FUSED_MAX_RANK) == set(both)
    assert decode_fused_targets(("gate_up",), cuda, "splitk", 16) == {"gate_up"}
    assert not decode_fused_targets((), cuda, "splitk", 16)
    assert not decode_fused_targets(both, cpu, "splitk", 16)
    assert not decode_fused_targets(both, cuda, "chunked", 16) and not decode_fused_targets(both, cuda, "ref", 16)
    assert not decode_fused_targets(both, cuda, "splitk", 2 * FUSED_MAX_RANK)


def test_decode_fused_delta_is_the_asked_targets_where_the_splitk_kernels_run():
    """--lora-decode-fused-delta takes effect on CUDA with the splitk ops (whose kernel it is), for slots
    of a rank capacity its expand holds; anywhere else it is a no-op, never an error."""
    from engine.lora_inputs import fused_delta_targets
    from lorakernels.silu_mul import FUSED_MAX_RANK

    cuda, cpu, all_four = torch.device("cuda", 0), torch.device("cpu"), ("qkv", "o", "gate_up", "down")
    assert fused_delta_targets(all_four, cuda, "splitk", 16) == fused_delta_targets(all_four, cuda, "splitk", FUSED_MAX_RANK) == set(all_four)
    assert fused_delta_targets(("down",), cuda, "splitk", 16) == {"down"}
    assert not fused_delta_targets((), cuda, "splitk", 16) and not fused_delta_targets(all_four, cpu, "splitk", 16)
    assert not any(fused_delta_targets(all_four, cuda, backend, 16) for backend in ("triton", "chunked", "ref"))
    assert not fused_delta_targets(all_four, cuda, "splitk", 2 * FUSED_MAX_RANK)  # past what its expand holds


def test_lora_decode_fused_options_reach_the_decode_steps_lora_inputs(tiny_llama_dir, adapter_dirs, tmp_path, monkeypatch):
    """EngineConfig.lora_decode_fused_expand, lora_decode_fused_delta and lora_decode_norm_shrink -> the worker's runner (with its
    backend and rank capacity) -> each LoRA decode graph's LoraInputs and an eager decode step's, not a
    prefill step's (those fuse gate/up by their own rule). On the CPU the targets are stubbed: the kernels
    only run on CUDA (tests/engine/test_gpu.py)."""
    import engine.cuda_graphs
    import engine.model_runner

    asked, asked_delta = [], []

    def targets(wanted, device, backend, max_rank):
        asked.append((tuple(wanted), device.type, backend, max_rank))
        return frozenset(wanted)

    def delta_targets(wanted, device, backend, max_rank):
        asked_delta.append((tuple(wanted), device.type, backend, max_rank))
        return frozenset(wanted)

    monkeypatch.setattr(engine.model_runner, "decode_fused_targets", targets)
    monkeypatch.setattr(engine.model_runner, "fused_delta_targets", delta_targets)
    adapters = tuple((name, str(path)) for name, path in adapter_dirs.items())
    real = engine.cuda_graphs.LoraInputs
    cases = [((), (), ()), (("qkv", "gate_up"), ("o", "down"), ()), ((), ("qkv", "gate_up"), ()), (("qkv",), ("o",), ("gate_up",))]
    for i, (wanted, wanted_delta, wanted_norm) in enumerate(cases):
        config = EngineConfig(
            model_dir=str(tiny_llama_dir), adapters=adapters, work_dir=str(tmp_path / f"work{i}"), lora_backend="splitk",
            max_lora_rank=32, lora_decode_fused_expand=wanted, lora_decode_fused_delta=wanted_delta,
            lora_decode_norm_shrink=wanted_norm,
        )  # fmt: skip
        runner = EngineCore.build(config).workers.local.runner
        assert asked[-2:] == [(wanted, "cpu", "splitk", 32), (wanted_norm, "cpu", "splitk", 32)]
        assert asked_delta[-1] == (wanted_delta, "cpu", "splitk", 32)
        assert (runner._shrink_counters is not None) == bool(wanted_norm)  # the kernel's counts, once per runner
        made = []

        def lora_inputs(*args, made=made, real=real, counters=runner._shrink_counters, **kwargs):
            made.append((kwargs["decode_fused_expand"], kwargs["decode_fused_delta"], kwargs["decode_norm_shrink"]))
            assert kwargs["shrink_counters"] is counters
            return real(*args, **kwargs)

        monkeypatch.setattr(engine.cuda_graphs, "LoraInputs", lora_inputs)
        monkeypatch.setattr(engine.cuda_graphs, "capture_steps", lambda keys, make, device, pool, capture: ({k: make(*k) for k in keys}, pool))
        runner.enable_cuda_graphs(2, (2,))
        want = (frozenset(wanted), frozenset(wanted_delta), frozenset(wanted_norm))
        assert made == [want] * len(runner.graphs.lora_variants)

        runner.lora_side = object()  # a decode step's side stream on CUDA
        decode, prefill = runner._lora_inputs(two_row_plan(1)), runner._lora_inputs(two_row_plan(3))
        assert (decode.decode_fused_expand, decode.decode_fused_delta, decode.decode_norm_shrink) == want
        assert decode.shrink_counters is runner._shrink_counters
        assert prefill.decode_fused_expand == prefill.decode_fused_delta == prefill.decode_norm_shrink == frozenset()


def test_both_linear_weight_layouts_give_the_reference_tokens(tiny_llama_dir, adapter_dirs, reference, tmp_path, monkeypatch):
    """--linear-weight-layout: by default (in_out) the worker stores the base model's linears transposed (the
    GEMMs then read row-major [in, out] weights), with out_in it leaves them as loaded; a batch of the base
    model and two adapters gives the reference tokens either way."""
    import engine.worker

    moved, real = [], engine.worker.store_linears_in_out
    monkeypatch.setattr(engine.worker, "store_linears_in_out", lambda model: moved.append(real(model)) or model)
    core_weights = []
    real_build = engine.worker.ModelWorker.build
    monkeypatch.setattr(
        engine.worker.ModelWorker, "build",
        classmethod(lambda cls, spec: core_weights.append(w := real_build.__func__(cls, spec)) or w),
    )  # fmt: skip
    assert run_batch(tiny_llama_dir, adapter_dirs, tmp_path / "out_in", attention_backend="ref", lora_backend="ref", linear_weight_layout="out_in") == reference
    assert moved == [] and core_weights[-1].runner.model.lm_head.weight.is_contiguous()
    assert run_batch(tiny_llama_dir, adapter_dirs, tmp_path / "in_out", attention_backend="ref", lora_backend="ref") == reference
    assert moved == [4 * 2 + 1]  # four linears in each of the tiny model's two layers, and its LM head
    assert core_weights[-1].runner.model.lm_head.weight.t().is_contiguous()


def test_a_launched_step_runs_in_inference_mode(tiny_llama_dir, tmp_path):
    """ModelRunner.launch: the forward records no autograd state (an out= matmul refuses autograd, and a
    step's tensors would hold their graph)."""
    core = EngineCore.build(EngineConfig(model_dir=str(tiny_llama_dir), work_dir=str(tmp_path / "work")))
    runner = core.workers.local.runner
    seen = []
    runner.model.register_forward_pre_hook(lambda module, args: seen.append(torch.is_inference_mode_enabled()))
    runner.launch(dataclasses.replace(two_row_plan(3), lora_slots=None)).result()
    assert seen == [True]


def two_row_plan(extend: int):
    """A step of two requests of `extend` new tokens each, the first on slot 0, the second base."""
    from engine.sampling import SamplingParams
    from engine.step_plan import SampleRow, StepPlan

    row = SampleRow(1, SamplingParams())
    return StepPlan(
        input_ids=(5,) * 2 * extend, positions=(0,) * 2 * extend, out_cache_loc=(1,) * 2 * extend, req_rows=(0, 1),
        prefix_lens=(0, 0), extend_lens=(extend, extend), samples=(row, row), lora_slots=(0, -1),
    )  # fmt: skip


def test_the_engine_sets_the_gil_switch_interval_it_is_given(tiny_llama_dir, tmp_path):
    """--gil-switch-interval-ms sets the process's interval when the engine is built; 0 leaves Python's."""
    import sys

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        EngineCore.build(EngineConfig(model_dir=str(tiny_llama_dir), work_dir=str(tmp_path / "a")))
        assert sys.getswitchinterval() == 0.005
        EngineCore.build(EngineConfig(model_dir=str(tiny_llama_dir), work_dir=str(tmp_path / "b"), gil_switch_interval_ms=0.5))
        assert abs(sys.getswitchinterval() - 0.0005) < 1e-9
    finally:
        sys.setswitchinterval(before)


@pytest.fixture
def tail_calls(monkeypatch):
    """The token counts of the steps whose projections ran through the LoRA GEMM tail (one entry a
    projection), with the tail taking steps of 16+ tokens (engine/lora_tail.py MIN_TOKENS is 256)."""
    import engine.model_runner
    import engine.step_graphs
    import lorakernels.gemm_tail

    monkeypatch.setattr(engine.model_runner, "TAIL_MIN_TOKENS", 16)
    monkeypatch.setattr(engine.step_graphs, "TAIL_MIN_TOKENS", 16)
    calls, real = [], lorakernels.gemm_tail.place_lora_tail
    monkeypatch.setattr(lorakernels.gemm_tail, "place_lora_tail", lambda v, *args, **kwargs: calls.append(v.shape[0]) or real(v, *args, **kwargs))
    return calls


LONG_JOBS = [(" ".join(f"word{i}" for i in range(12)), ""), ("The quick brown fox " * 3, "qv"), ("1 2 3 4 5 6 7 8 9 10", "all")]


@pytest.fixture(scope="module")
def long_reference(tiny_llama_dir, adapter_dirs, tmp_path_factory):
    """The reference backends' float32 tokens of LONG_JOBS (whose prompts' step is 16+ tokens)."""
    return run_batch(tiny_llama_dir, adapter_dirs, tmp_path_factory.mktemp("ref-long"), jobs=LONG_JOBS, attention_backend="ref", lora_backend="ref")


@pytest.mark.parametrize("lora_backend", ["triton", "splitk"])
def test_gemm_tail_gives_the_reference_tokens(tiny_llama_dir, adapter_dirs, long_reference, tmp_path, tail_calls, lora_backend):
    """--lora-gemm-tail-blocks 2: the prompts' step (base, q/v and all-projection rows) adds its LoRA in
    the base GEMMs (engine/lora_tail.py): every projection of both layers went through the tail, the
    weights' tail rows held both adapters, and the tokens are the reference's; decode steps run in line."""
    tokens = run_batch(
        tiny_llama_dir, adapter_dirs, tmp_path, jobs=LONG_JOBS, attention_backend="sdpa", lora_backend=lora_backend, lora_gemm_tail_blocks=2,
    )  # fmt: skip
    assert tokens == long_reference
    assert len({tuple(t) for t in tokens}) == len(LONG_JOBS)
    assert len(tail_calls) == 2 * 4 and min(tail_calls) >= 16  # q/k/v, o, gate/up, down in two layers, one step


def test_gemm_tail_with_fewer_blocks_than_adapters_runs_in_line(tiny_llama_dir, adapter_dirs, long_reference, tmp_path, tail_calls):
    """One block for a step of two adapters: the step keeps the in-line path, with the same tokens."""
    tokens = run_batch(
        tiny_llama_dir, adapter_dirs, tmp_path, jobs=LONG_JOBS, attention_backend="sdpa", lora_backend="splitk", lora_gemm_tail_blocks=1,
    )  # fmt: skip
    assert tokens == long_reference
    assert not tail_calls


def test_graph_steps_with_the_gemm_tail_give_the_reference_tokens(tiny_llama_dir, adapter_dirs, long_reference, tmp_path, tail_calls):
    """The steps CUDA graphs replay, run uncaptured, with the tail in buckets of 16+ tokens: the prompts'
    step (padded to 64) covers every block, its padding rows get zero tails; the decode steps (bucket 4)
    run in line. Tokens are the reference's."""
    tokens = run_batch(
        tiny_llama_dir, adapter_dirs, tmp_path, jobs=LONG_JOBS, static_steps=(4, 64), attention_backend="ref", lora_backend="splitk",
        max_batch_tokens=64, max_running_requests=3, lora_gemm_tail_blocks=3,
    )  # fmt: skip
    assert tokens == long_reference
    assert tail_calls and set(tail_calls) == {64}


def test_graph_steps_with_more_adapters_than_tail_blocks_give_the_reference_tokens(
    tiny_llama_dir, adapter_dirs, long_reference, tmp_path, tail_calls, monkeypatch
):
    """One block: a step of two adapters replays its bucket's in-line LoRA graph (tail blocks 0), so it
    still replays a graph (run_batch checks none ran eagerly); steps of one adapter take the tail."""
    from engine.lora_tail import GemmTail

    assigned, real = [], GemmTail.assign
    monkeypatch.setattr(GemmTail, "assign", lambda self, pool, slots: assigned.append(real(self, pool, slots)) or assigned[-1])
    tokens = run_batch(
        tiny_llama_dir, adapter_dirs, tmp_path, jobs=LONG_JOBS, static_steps=(4, 64), attention_backend="ref", lora_backend="splitk",
        max_batch_tokens=64, max_running_requests=3, lora_gemm_tail_blocks=1,
    )  # fmt: skip
    assert tokens == long_reference
    assert None in assigned  # a step of more adapters than blocks: in line
