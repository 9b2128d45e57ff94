"""The engine on a CUDA device (skipped without one): greedy tokens equal the CPU oracle."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model_config import ModelConfig
from engine.request import TokenDelta
from engine.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = ["Hello world, this is", "The quick brown fox jumps over the lazy dog " * 4, "café 日本語"]


def generate_all(core: EngineCore, num_tokens: int, adapters=(None,), rounds: int = 1, prompts=PROMPTS) -> list[list[int]]:
    """Every prompt under every adapter record (None = the base model), submitted together; with rounds > 1
    the same jobs again once the previous round has finished (its prompts now cached prefixes)."""
    jobs = [(prompt, adapter) for prompt in prompts for adapter in adapters]
    results = [[] for _ in jobs * rounds]
    done = [threading.Event() for _ in jobs * rounds]

    def sink_for(i):
        def sink(event):
            if isinstance(event, TokenDelta):
                results[i] += event.token_ids
            else:
                done[i].set()

        return sink

    core.loop.start()
    try:
        for round_ in range(rounds):
            base = round_ * len(jobs)
            for i, (prompt, adapter) in enumerate(jobs, start=base):
                params = SamplingParams(max_new_tokens=num_tokens, ignore_eos=True)
                packed = asyncio.run(core.prepare(adapter)) if adapter is not None else None
                core.loop.submit(core.new_request(core.prompt_ids(prompt, None), params, sink_for(i), adapter=adapter, packed=packed))
            assert all(event.wait(120) for event in done[base : base + len(jobs)])
    finally:
        core.loop.stop()
    return results


@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_fp32_greedy_matches_cpu(tiny_llama_dir, page_size):
    def core(device):
        config = EngineConfig(model_dir=str(tiny_llama_dir), device=device, dtype="float32", page_size=page_size, num_kv_slots=4096)
        return EngineCore.build(config)

    cuda = core("cuda")
    torch.cuda.empty_cache()  # the default graphs (decode and step graphs in one pool) hold what they read
    assert generate_all(cuda, 16) == generate_all(core("cpu"), 16)
    runner = cuda.workers.local.runner
    assert runner.graphs.num_replays > 0 and runner.step_graphs.num_replays > 0  # decode and prefill steps


@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_triton_prefill_attention_matches_cpu(tiny_llama_dir, make_adapter, tmp_path, page_size):
    """The Triton extend kernel as the prefill backend: chunked prompts (8 tokens a step), prefixes the
    radix cache shares between prompts, base and adapter rows in one batch; the CPU reference's tokens."""
    adapters = (("qv", str(make_adapter("extend-qv", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=24))),)

    def run(device: str, attention: str) -> list[list[int]]:
        config = EngineConfig(
            model_dir=str(tiny_llama_dir), device=device, dtype="float32", page_size=page_size, num_kv_slots=4096,
            adapters=adapters, work_dir=str(tmp_path / f"{device}-{page_size}"), attention_backend=attention,
            max_batch_tokens=8, max_running_requests=8,
        )
        core = EngineCore.build(config)
        return generate_all(core, 6, [None, core.resolve_adapter("qv")], rounds=2)

    assert run("cuda", "triton") == run("cpu", "ref")


def test_cuda_bf16_generates(tiny_llama_dir):
    core = EngineCore.build(EngineConfig(model_dir=str(tiny_llama_dir), device="cuda", num_kv_slots=4096))
    assert next(core.workers.local.runner.model.parameters()).dtype == torch.bfloat16
    assert all(len(tokens) == 8 for tokens in generate_all(core, 8))


@pytest.mark.parametrize("lora_backend", ["triton", "chunked", "splitk"])
def test_cuda_lora_matches_cpu(tiny_llama_dir, make_adapter, tmp_path, lora_backend):
    """Mixed adapters on CUDA through the Triton SGMV kernels give the CPU reference's greedy tokens."""
    adapters = (
        ("qv", str(make_adapter("gpu-qv", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=21))),
        ("all", str(make_adapter("gpu-all", r=16, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], seed=22))),
    )

    def run(device: str, backend: str) -> list[list[int]]:
        config = EngineConfig(
            model_dir=str(tiny_llama_dir), device=device, dtype="float32", num_kv_slots=4096, adapters=adapters,
            work_dir=str(tmp_path / device), max_loras_per_batch=2, lora_backend=backend,
        )
        core = EngineCore.build(config)
        records = [None, core.resolve_adapter("qv"), core.resolve_adapter("all")]
        return generate_all(core, 12, records)

    expected = run("cpu", "ref")
    # Each adapter changes each prompt's decoded tokens, so a delta lost in the decode steps (computed on
    # a side stream on CUDA, in the graphs too) cannot pass the comparison below.
    for base, qv, all_ in zip(*[iter(expected)] * 3, strict=True):
        assert base[3:] != qv[3:] and base[3:] != all_[3:]
    assert run("cuda", lora_backend) == expected


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("lora_backend", ["splitk", "triton"])
def test_cuda_long_prompts_lora_matches_cpu(tiny_llama_dir, make_adapter, tmp_path, monkeypatch, lora_backend, graphs):
    """Prompts longer than a decode-sized segment (64 tokens): their prefill steps leave gate/up's LoRA
    expand to the SiLU-mul kernel (lorakernels/silu_mul.py `silu_mul_expand`), eagerly or in step graphs.
    Greedy tokens equal the CPU reference's, and the fused kernel did run."""
    import lorakernels.silu_mul

    adapters = three_adapters(make_adapter, "long", seed=60)
    prompts = ["The quick brown fox jumps over the lazy dog " * 12, "café 日本語 " * 20, "Hello world, this is"]
    calls = []
    real = lorakernels.silu_mul.silu_mul_expand

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    def run(device: str, backend: str) -> list[list[int]]:
        config = EngineConfig(
            model_dir=str(tiny_llama_dir), device=device, dtype="float32", num_kv_slots=4096, adapters=adapters,
            work_dir=str(tmp_path / device), max_loras_per_batch=3, lora_backend=backend,
            cuda_graph_max_tokens=1024 if graphs else 0,
            lora_gemm_tail_blocks=0,  # the in-line path (a 256-token bucket would take the GEMM tail)
        )  # fmt: skip
        core = EngineCore.build(config)
        records = [None, *(core.resolve_adapter(name) for name, _ in adapters)]
        return generate_all(core, 8, records, prompts=prompts)

    expected = run("cpu", "ref")
    monkeypatch.setattr(lorakernels.silu_mul, "silu_mul_expand", counted)
    assert run("cuda", lora_backend) == expected
    assert calls and max(calls) > 64


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_cuda_decode_fused_expand_matches_cpu(tiny_llama_dir, make_adapter, tmp_path, monkeypatch, graphs):
    """--lora-decode-fused-expand qkv gate_up: decode steps leave q/k/v's LoRA expand to the RoPE/KV-write
    kernel (lorakernels/rope_kv.py) and gate/up's to the SiLU-mul kernel (lorakernels/silu_mul.py), in the decode
    graphs or eagerly (no graphs at all: with step graphs alone, they would take the decode steps).
    Greedy tokens equal the CPU reference's with and without it, and both kernels took expands."""
    import lorakernels.rope_kv
    import lorakernels.silu_mul

    adapters = three_adapters(make_adapter, "decode-fused", seed=70)
    real_silu, real_rope = lorakernels.silu_mul.silu_mul_expand, lorakernels.rope_kv.rope_kv_write

    def run(device: str, fused: tuple[str, ...], calls: dict[str, int]) -> list[list[int]]:
        def silu(*args, **kwargs):
            calls["silu_mul"] = calls.get("silu_mul", 0) + 1
            return real_silu(*args, **kwargs)

        def rope(*args, **kwargs):
            calls["rope_kv"] = calls.get("rope_kv", 0) + (kwargs.get("expand") is not None)
            return real_rope(*args, **kwargs)

        monkeypatch.setattr(lorakernels.silu_mul, "silu_mul_expand", silu)
        monkeypatch.setattr(lorakernels.rope_kv, "rope_kv_write", rope)
        work_dir = tmp_path / f"{device}-{len(fused)}"
        return greedy_three_adapters(tiny_llama_dir, adapters, device, work_dir, graphs, lora_decode_fused_expand=fused)

    expected = run("cpu", (), {})
    plain, fused = {}, {}
    assert run("cuda", (), plain) == expected
    assert run("cuda", ("qkv", "gate_up"), fused) == expected
    assert plain.get("rope_kv", 0) == 0 and fused["rope_kv"] > 0
    assert fused["silu_mul"] > plain.get("silu_mul", 0)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_cuda_decode_norm_shrink_matches_cpu(tiny_llama_dir, make_adapter, tmp_path, monkeypatch, graphs):
    """--lora-decode-norm-shrink qkv gate_up: decode steps shrink q/k/v's and gate/up's input in the residual
    add + RMSNorm kernel (lorakernels/norm_shrink.py), run those GEMMs with nothing beside them, and expand
    in the RoPE/KV-write and SiLU-mul kernels, in the decode graphs or eagerly. Greedy tokens equal the CPU
    reference's, and the fused norm ran for both targets (never without the option)."""
    import lorakernels.norm_shrink

    adapters = three_adapters(make_adapter, "decode-norm-shrink", seed=110)
    real = lorakernels.norm_shrink.add_rmsnorm_shrink

    def run(device: str, targets: tuple[str, ...], widths: list[int]) -> list[list[int]]:
        def counted(x, residual, weight, eps, A, *args, **kwargs):
            widths.append(A.shape[1])
            return real(x, residual, weight, eps, A, *args, **kwargs)

        monkeypatch.setattr(lorakernels.norm_shrink, "add_rmsnorm_shrink", counted)
        work_dir = tmp_path / f"{device}-{len(targets)}"
        return greedy_three_adapters(tiny_llama_dir, adapters, device, work_dir, graphs, lora_decode_norm_shrink=targets)

    expected = run("cpu", (), [])
    plain, fused = [], []
    assert run("cuda", (), plain) == expected
    assert run("cuda", ("qkv", "gate_up"), fused) == expected
    assert not plain
    max_rank = EngineConfig(model_dir="m").max_lora_rank
    assert set(fused) == {3 * max_rank, 2 * max_rank}  # q/k/v's three stacked targets, gate/up's two


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_cuda_kernel_pdl_matches_cpu(tiny_llama_dir, make_adapter, tmp_path, monkeypatch, graphs):
    """--kernel-pdl: the decode path's Triton kernels launched with programmatic dependent launch (each
    waits for the grid before it on the device), in graphs or eagerly, with adapters and
    --lora-decode-norm-shrink on q/k/v: greedy tokens equal the CPU reference's, and the kernels were
    launched with PDL (an H100 or H200)."""
    from lorakernels import pdl

    adapters = three_adapters(make_adapter, "kernel-pdl", seed=130)
    launches, real = [], pdl.launch
    monkeypatch.setattr(pdl, "launch", lambda device: launches.append(bool(r := real(device))) or r)
    try:
        expected = greedy_three_adapters(tiny_llama_dir, adapters, "cpu", tmp_path / "cpu", graphs)
        got = greedy_three_adapters(
            tiny_llama_dir, adapters, "cuda", tmp_path / "cuda", graphs, kernel_pdl=True, lora_decode_norm_shrink=("qkv",)
        )  # fmt: skip
    finally:
        pdl.set_enabled(False)
    assert got == expected
    assert launches and all(launches) == (torch.cuda.get_device_capability()[0] >= 9)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_cuda_lora_pdl_matches_cpu(tiny_llama_dir, make_adapter, tmp_path, monkeypatch, graphs):
    """--lora-pdl: the decode LoRA chain on the side stream (split shrink, reduce, expand) with early
    release and programmatic dependent launch, in graphs or eagerly, with three adapters: greedy tokens
    equal the CPU reference's, and the chain's kernels after the first were launched with PDL (an H100 or
    H200)."""
    from lorakernels import pdl

    adapters = three_adapters(make_adapter, "lora-pdl", seed=140)
    launches, real = [], pdl.lora_launch
    monkeypatch.setattr(pdl, "lora_launch", lambda device, first: launches.append((first, real(device, first=first))) or launches[-1][1])
    try:
        expected = greedy_three_adapters(tiny_llama_dir, adapters, "cpu", tmp_path / "cpu", graphs)
        got = greedy_three_adapters(tiny_llama_dir, adapters, "cuda", tmp_path / "cuda", graphs, lora_pdl=True)
    finally:
        pdl.set_lora_enabled(False)
    assert got == expected
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert {first for first, _ in launches} == {True, False}
    assert all(kwargs.get("launch_pdl", False) == (hopper and not first) for first, kwargs in launches)
    assert all(kwargs.get("RELEASE", False) == hopper for _, kwargs in launches)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_cuda_decode_fused_delta_matches_cpu(tiny_llama_dir, make_adapter, tmp_path, monkeypatch, graphs):
    """--lora-decode-fused-delta on all four fused targets: decode steps compute each LoRA delta beside the
    base GEMM in one pass from x (lorakernels/sgmv_decode.py `sgmv_lora_delta_decode`, the expand summing
    the split shrink's partials), in the decode graphs or eagerly. Greedy tokens equal the CPU reference's,
    and the fused kernel ran for every target (none without the option)."""
    import lorakernels.sgmv_decode

    adapters = three_adapters(make_adapter, "decode-fused-delta", seed=90)
    real = lorakernels.sgmv_decode.sgmv_lora_delta_decode

    def run(device: str, fused: tuple[str, ...], widths: list[int]) -> list[list[int]]:
        def counted(x, A, B, *args, **kwargs):
            widths.append(B.shape[1])
            return real(x, A, B, *args, **kwargs)

        monkeypatch.setattr(lorakernels.sgmv_decode, "sgmv_lora_delta_decode", counted)
        work_dir = tmp_path / f"{device}-{len(fused)}"
        return greedy_three_adapters(tiny_llama_dir, adapters, device, work_dir, graphs, lora_decode_fused_delta=fused)

    expected = run("cpu", (), [])
    plain, fused = [], []
    assert run("cuda", (), plain) == expected
    assert run("cuda", ("qkv", "o", "gate_up", "down"), fused) == expected
    assert not plain
    c = ModelConfig.from_hf(json.loads((tiny_llama_dir / "config.json").read_text()))
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    assert set(fused) == {qkv, c.hidden_size, 2 * c.intermediate_size}  # o and down: hidden_size wide


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_cuda_linears_stored_in_out_match_cpu(tiny_llama_dir, make_adapter, tmp_path, graphs):
    """--linear-weight-layout in_out on CUDA: every base GEMM reads its weight as a row-major [in, out]
    matrix (cuBLASLt's other operand layout), eagerly or in the decode and step graphs, with LoRA beside
    it; greedy tokens equal the CPU reference's."""
    adapters = three_adapters(make_adapter, "in-out", seed=95)
    expected = greedy_three_adapters(tiny_llama_dir, adapters, "cpu", tmp_path / "cpu", graphs)
    assert greedy_three_adapters(tiny_llama_dir, adapters, "cuda", tmp_path / "cuda", graphs, linear_weight_layout="in_out") == expected


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_cuda_prefill_fused_o_and_down_expands_match_cpu(tiny_llama_dir, make_adapter, tmp_path, monkeypatch, graphs):
    """--lora-prefill-fused-expand gate_up o down: prefill-sized steps leave o's and down's LoRA expand to
    the residual add + RMSNorm (lorakernels/rmsnorm.py `add_rmsnorm_expand`), eagerly or in step graphs.
    Greedy tokens equal the CPU reference's, and the fused kernel ran on prompt-sized steps for both
    targets (a layer's o and down, the last layer's down in the final norm)."""
    import lorakernels.rmsnorm

    adapters = three_adapters(make_adapter, "norm-expand", seed=97)
    prompts = ["The quick brown fox jumps over the lazy dog " * 12, "café 日本語 " * 20, "Hello world, this is"]
    calls = []
    real = lorakernels.rmsnorm.add_rmsnorm_expand

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    def run(device: str, **options) -> list[list[int]]:
        config = EngineConfig(
            model_dir=str(tiny_llama_dir), device=device, dtype="float32", num_kv_slots=4096, adapters=adapters,
            work_dir=str(tmp_path / device), max_loras_per_batch=3, lora_backend="splitk" if device == "cuda" else "ref",
            cuda_graph_max_tokens=1024 if graphs else 0,
            lora_gemm_tail_blocks=0,  # the in-line path (a 256-token bucket would take the GEMM tail)
            **options,
        )  # fmt: skip
        core = EngineCore.build(config)
        records = [None, *(core.resolve_adapter(name) for name, _ in adapters)]
        return generate_all(core, 8, records, prompts=prompts)

    expected = run("cpu")
    monkeypatch.setattr(lorakernels.rmsnorm, "add_rmsnorm_expand", counted)
    assert run("cuda", lora_prefill_fused_expand=("gate_up", "o", "down")) == expected
    assert calls and max(calls) > 64
    calls.clear()
    assert run("cuda") == expected  # by default gate/up's alone
    assert not calls


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_cuda_gemm_tail_matches_cpu(tiny_llama_dir, make_adapter, tmp_path, monkeypatch, graphs):
    """--lora-gemm-tail-blocks: prefill-sized steps add their LoRA in the base GEMMs (engine/lora_tail.py),
    eagerly or in step graphs (every block), with the producers writing x into x_aug's head (the residual
    add + RMSNorm, extend attention, SiLU-mul). Greedy tokens equal the CPU reference's with three blocks
    (every step fits) and with one (steps of several adapters run in line), and the tail ran."""
    import engine.model_runner
    import engine.step_graphs
    import lorakernels.gemm_tail

    monkeypatch.setattr(engine.model_runner, "TAIL_MIN_TOKENS", 16)  # the tiny model's steps are short
    monkeypatch.setattr(engine.step_graphs, "TAIL_MIN_TOKENS", 16)
    calls, real = [], lorakernels.gemm_tail.place_lora_tail
    monkeypatch.setattr(lorakernels.gemm_tail, "place_lora_tail", lambda v, *args, **kwargs: calls.append(v.shape[0]) or real(v, *args, **kwargs))
    adapters = three_adapters(make_adapter, "gemm-tail", seed=113)
    expected = greedy_three_adapters(tiny_llama_dir, adapters, "cpu", tmp_path / "cpu", graphs)
    for blocks in (3, 1):
        calls.clear()
        work_dir = tmp_path / f"cuda-{blocks}"
        assert greedy_three_adapters(tiny_llama_dir, adapters, "cuda", work_dir, graphs, lora_gemm_tail_blocks=blocks) == expected
        if blocks == 3:
            assert calls and min(calls) >= 16


def test_cuda_lora_graph_segments_match_cpu(tiny_llama_dir, make_adapter, tmp_path):
    """--lora-graph-segments 2 4 8: decode graphs also captured for 2, 4 and 8 LoRA segments; steps of the
    base model and three adapters over the prompts replay the graph of the fewest segments that hold their
    own (fewer than their rows at some steps): greedy tokens equal the CPU reference's."""
    adapters = three_adapters(make_adapter, "graph-segments", seed=150)
    expected = greedy_three_adapters(tiny_llama_dir, adapters, "cpu", tmp_path / "cpu", False)
    config = EngineConfig(
        model_dir=str(tiny_llama_dir), device="cuda", dtype="float32", num_kv_slots=4096, adapters=adapters,
        work_dir=str(tmp_path / "cuda"), max_loras_per_batch=3, lora_backend="splitk", cuda_graph_max_batch=16,
        cuda_graph_max_tokens=1024, lora_graph_segments=(2, 4, 8),
    )  # fmt: skip
    core = EngineCore.build(config)
    graphs = core.workers.local.runner.graphs
    replayed = []
    graphs.steps = {key: (lambda key=key, step=step: replayed.append(key) or step()) for key, step in graphs.steps.items()}
    got = generate_all(core, 8, [None, *(core.resolve_adapter(name) for name, _ in adapters)])
    assert got == expected
    assert any(skipped is not None and segments < batch for batch, skipped, segments in replayed)


def greedy_three_adapters(model_dir, adapters, device: str, work_dir, graphs: bool, **options) -> list[list[int]]:
    """Greedy tokens of 8 prompts over the base model and `adapters` (three_adapters) in fp32: the CPU
    reference engine, or CUDA with the splitk ops, decode graphs and step graphs (graphs) or neither, and
    `options` (EngineConfig fields)."""
    config = EngineConfig(
        model_dir=str(model_dir), device=device, dtype="float32", num_kv_slots=4096, adapters=adapters, work_dir=str(work_dir),
        max_loras_per_batch=3, lora_backend="splitk" if device == "cuda" else "ref", cuda_graph_max_batch=16 if graphs else 0,
        cuda_graph_max_tokens=1024 if graphs else 0, **options,
    )  # fmt: skip
    core = EngineCore.build(config)
    return generate_all(core, 8, [None, *(core.resolve_adapter(name) for name, _ in adapters)])


def three_adapters(make_adapter, prefix: str, seed: int) -> tuple[tuple[str, str], ...]:
    """(name, dir) of three adapters of different targets and ranks: q/v rank 4, the MLP rank 8, o rank 12."""
    targets = [("qv", ["q_proj", "v_proj"]), ("mlp", ["gate_proj", "up_proj", "down_proj"]), ("o", ["o_proj"])]
    return tuple(
        (name, str(make_adapter(f"{prefix}-{name}", r=4 * (i + 1), lora_alpha=16, target_modules=modules, seed=seed + i)))
        for i, (name, modules) in enumerate(targets)
    )


def test_cuda_overlapped_schedule_with_slot_evictions_matches_cpu(tiny_llama_dir, make_adapter, tmp_path):
    """The overlapped schedule on CUDA (its default) with one slot for three adapters: a slot is
    reloaded for the next adapter while the step planned before its last user finished may still read
    it (the copy stream waits for the compute stream); graphs replay chained plans. CPU tokens."""
    adapters = three_adapters(make_adapter, "overlap", seed=25)

    def run(device: str) -> list[list[int]]:
        config = EngineConfig(
            model_dir=str(tiny_llama_dir), device=device, dtype="float32", num_kv_slots=4096, adapters=adapters,
            work_dir=str(tmp_path / device), max_loras_per_batch=1, lora_load_ahead=0,
        )
        core = EngineCore.build(config)
        assert core.loop.overlap == (device == "cuda")
        tokens = generate_all(core, 10, [None, *(core.resolve_adapter(name) for name, _ in adapters)])
        assert core.lora.slots.num_evictions >= 2
        return tokens

    assert run("cuda") == run("cpu")


def test_cuda_adapters_packed_into_a_pinned_arena_match_cpu(tiny_llama_dir, make_adapter, tmp_path):
    """--host-pinned-gb: adapters packed into blocks of one pinned buffer taken at startup. Two 1 MiB
    blocks for three adapters, one slot and one host-cache entry: blocks go back as the host cache drops
    adapters and are lent again (after the copies that read them), and an adapter that finds no free
    block is pinned as before. CPU tokens."""
    adapters = three_adapters(make_adapter, "arena", seed=70)

    def run(device: str) -> tuple[list[list[int]], EngineCore]:
        config = EngineConfig(
            model_dir=str(tiny_llama_dir), device=device, dtype="float32", num_kv_slots=4096, adapters=adapters,
            work_dir=str(tmp_path / device), max_loras_per_batch=1, max_host_adapters=1, lora_load_ahead=0,
            host_pinned_gb=2 / 1024,
        )  # fmt: skip
        core = EngineCore.build(config)
        records = [None, *(core.resolve_adapter(name) for name, _ in adapters)]
        return generate_all(core, 10, records, rounds=2), core

    expected, cpu = run("cpu")
    assert cpu.pinned_arena is None
    tokens, core = run("cuda")
    assert tokens == expected
    arena = core.pinned_arena
    assert arena.capacity == 2 << 20 and arena.num_lent > 2  # blocks came back and were lent again
    packed = asyncio.run(core.prepare(core.resolve_adapter(adapters[0][0])))
    start = arena.buffer.data_ptr()
    tensors = [*packed.a.values(), *packed.b.values()]
    if all(start <= t.data_ptr() < start + arena.capacity for t in tensors):  # else it found no free block
        assert all(t.is_pinned() for t in tensors)  # registered memory: the loads' copies stay asynchronous


def test_cuda_graph_decode_matches_eager_decode(tiny_llama_dir, make_adapter, tmp_path):
    """Replayed decode graphs (batch padding, LoRA segments refilled in place) give the eager tokens."""
    adapters = (("qv", str(make_adapter("graph-qv", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=23))),)

    def run(max_batch: int) -> list[list[int]]:
        config = EngineConfig(
            model_dir=str(tiny_llama_dir), device="cuda", dtype="float32", num_kv_slots=4096, adapters=adapters,
            work_dir=str(tmp_path / str(max_batch)), cuda_graph_max_batch=max_batch, cuda_graph_max_tokens=0,
            max_running_requests=16,
        )  # fmt: skip
        core = EngineCore.build(config)
        # unmap the allocator's free memory: a graph that names memory it does not hold would fault
        torch.cuda.empty_cache()
        tokens = generate_all(core, 12, [None, core.resolve_adapter("qv")])
        runner = core.workers.local.runner
        assert (runner.graphs is not None) == (max_batch > 0) and runner.step_graphs is None
        return tokens

    assert run(16) == run(0)


@pytest.mark.parametrize("lora_backend", ["splitk", "triton"])
def test_cuda_graph_mixed_steps_match_eager_steps(tiny_llama_dir, make_adapter, tmp_path, lora_backend):
    """Prefill, chunked-prefill and mixed prefill + decode steps replayed from graphs captured per padded
    token count: a 24-token budget splits the prompts into chunks beside other requests' decodes, the
    second round's prompts hit cached prefixes, and three adapters of different targets and ranks share
    two slots, so each replay brings new lengths, prefixes and slots. Tokens equal the eager steps'."""
    adapters = three_adapters(make_adapter, "mixed", seed=40)

    def run(max_tokens: int) -> list[list[int]]:
        config = EngineConfig(
            model_dir=str(tiny_llama_dir), device="cuda", dtype="float32", num_kv_slots=4096, adapters=adapters,
            work_dir=str(tmp_path / str(max_tokens)), cuda_graph_max_batch=0, cuda_graph_max_tokens=max_tokens,
            max_batch_tokens=24, max_running_requests=8, max_loras_per_batch=2, lora_backend=lora_backend,
        )  # fmt: skip
        core = EngineCore.build(config)
        tokens = generate_all(core, 10, [None, *(core.resolve_adapter(name) for name, _ in adapters)], rounds=2)
        graphs = core.workers.local.runner.step_graphs
        assert (graphs is not None and graphs.num_replays > 0) == (max_tokens > 0)
        return tokens

    assert run(24) == run(0)
