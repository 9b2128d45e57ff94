"""engine/carved_gemms.py: which decode GEMMs run a tuned cuBLASLt algorithm (the dispatch, on any device),
and on a GPU that the tuned algorithms compute the projection, in CUDA graphs and in the engine."""

import pytest
import torch

from engine import carved_gemms
from engine.carved_gemms import CarvedGemms, in_out_weight
from engine.parallel import ColumnParallelLinear, RowParallelLinear, TensorParallel
from lorakernels import cublaslt

CUDA = torch.cuda.is_available()


def _aligned(rows, cols, offset=0, dtype=torch.bfloat16, device="cpu"):
    """A [rows, cols] tensor of random values whose data starts `offset` elements past a 256-byte
    boundary (what cuBLASLt's heuristic assumed: 0)."""
    buf = torch.empty(rows * cols + 256, dtype=dtype, device=device)
    start = (-buf.data_ptr()) % 256 // buf.element_size() + offset
    out = buf[start : start + rows * cols].view(rows, cols)
    out.copy_(torch.randn(rows, cols))
    return out


def _in_out(module):
    """module with its weight stored `in_out`, as engine/weights.py stores it, 256-byte aligned (CPU
    tensors are only 64-byte aligned; CUDA ones always are)."""
    weight = module.weight.detach()
    stored = _aligned(weight.shape[1], weight.shape[0], dtype=weight.dtype, device=weight.device)
    stored.copy_(weight.t())
    module.weight = torch.nn.Parameter(stored.t())
    return module


def _linear(in_dim=64, out_parts=(96,), bias=False, dtype=torch.bfloat16, device="cpu", in_out=True):
    module = ColumnParallelLinear(in_dim, out_parts, bias, device=device, dtype=dtype)
    with torch.no_grad():
        module.weight.normal_(0.0, in_dim**-0.5)
        if module.bias is not None:
            module.bias.zero_()
    return _in_out(module) if in_out else module


def test_only_plain_decode_gemms_stored_in_out_expose_their_weight():
    linear = _linear()
    w = in_out_weight(linear)
    assert w is not None and w.shape == (64, 96) and w.is_contiguous() and w.data_ptr() == linear.weight.data_ptr()
    assert in_out_weight(_linear(in_out=False)) is None  # [out, in] storage
    assert in_out_weight(_linear(bias=True)) is None
    assert in_out_weight(_linear(dtype=torch.float32)) is None
    row = _in_out(RowParallelLinear(128, 64, False, TensorParallel(0, 2), dtype=torch.bfloat16))
    assert in_out_weight(row) is None  # a rank's partial sum goes into the all-reduce's buffer
    assert in_out_weight(_in_out(RowParallelLinear(128, 64, False, dtype=torch.bfloat16))) is not None


class _Runner:
    """Stands in for an LtGemm on the CPU: LtGemm's own operand check, and calls recorded that compute
    x @ w."""

    refusal = cublaslt.LtGemm.refusal

    def __init__(self, rows, in_dim, out_dim):
        self.rows, self.in_dim, self.out_dim, self.calls = rows, in_dim, out_dim, []
        self.dtype, self.device = torch.bfloat16, torch.device("cpu")

    def __call__(self, x, w, out, algo):
        self.calls.append(algo)
        return x @ w


def _carved(plans):
    carved = CarvedGemms.__new__(CarvedGemms)
    carved._plans, carved.report = plans, []
    return carved


def test_project_runs_the_plan_of_its_target_rows_and_carveout_else_the_linear():
    linear = _linear()
    runner = _Runner(8, 64, 96)
    carved = _carved({("qkv", 8, 48): (runner, b"algo")})
    x = _aligned(8, 64)
    want = linear(x)
    assert torch.equal(carved.project(linear, "qkv", x, 48), want) and runner.calls == [b"algo"]
    others = [("o", x, 48), ("qkv", x[:4], 48), ("qkv", x, 32), ("qkv", _aligned(16, 64)[::2], 48), ("qkv", _aligned(8, 64, offset=8), 48)]
    for target, xx, carveout in others:
        assert torch.equal(carved.project(linear, target, xx, carveout), linear(xx))
    assert runner.calls == [b"algo"]  # none of those: another target, row count, carve-out, a strided or unaligned x
    out_in = _linear(in_out=False)
    carved.project(out_in, "qkv", x, 48)
    assert runner.calls == [b"algo"]  # the weight no longer stored in_out: torch.mm
    wider = _linear(out_parts=(128,))
    carved.project(wider, "qkv", x, 48)
    assert runner.calls == [b"algo"]  # a weight of another shape than the plan's


def test_projections_without_lora_work_take_the_plans_on_every_sm():
    """tuned_gemm (base steps, targets idle in a LoRA step) runs the linear's plan for its rows with no
    carve-out, never a carved one; a linear the runner gave no plans runs linear(x)."""
    from engine.lora_inputs import tuned_gemm

    linear, runner, carved_runner = _linear(), _Runner(8, 64, 96), _Runner(8, 64, 96)
    x = _aligned(8, 64)
    assert torch.equal(tuned_gemm(linear, "qkv", x), linear(x)) and linear.tuned_gemms is None
    linear.tuned_gemms = _carved({("qkv", 8, 48): (carved_runner, b"carved")})
    tuned_gemm(linear, "qkv", x)
    assert carved_runner.calls == []
    linear.tuned_gemms = _carved({("qkv", 8, 0): (runner, b"every-sm"), ("qkv", 8, 48): (carved_runner, b"carved")})
    assert torch.equal(tuned_gemm(linear, "qkv", x), linear(x))
    tuned_gemm(linear, "gate_up", x)
    assert runner.calls == [b"every-sm"] and carved_runner.calls == []


def test_base_projections_of_the_blocks_go_through_tuned_gemm(monkeypatch):
    """Without LoRA inputs each of the four fused projections of a layer is run by tuned_gemm, so the
    plans reach base steps."""
    from engine.models import blocks
    from engine.named_shapes import NAMED_SHAPES

    config = NAMED_SHAPES["tiny"]
    attn, mlp = blocks.Attention(config, 0), blocks.MLP(config, 0)
    seen = []
    monkeypatch.setattr(blocks, "tuned_gemm", lambda linear, target, x: seen.append(target) or linear(x))
    hidden = torch.zeros(3, config.hidden_size)
    attn.project_qkv(hidden, None)
    attn.project_o(torch.zeros(3, config.q_size), None)
    mlp.project_gate_up(hidden, None)
    mlp.project_down(torch.zeros(3, config.intermediate_size), None)
    assert seen == ["qkv", "o", "gate_up", "down"]


needs_cuda = pytest.mark.skipif(not CUDA, reason="cuBLASLt runs on CUDA devices")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tuned_plans_compute_the_projection_in_a_replayed_graph(monkeypatch, dtype):
    monkeypatch.setattr(carved_gemms, "MIN_GAIN", -1e9)  # keep the fastest candidate even where torch.mm is faster
    device = torch.device("cuda", torch.cuda.current_device())
    linears = {"qkv": _linear(512, (512, 128, 128), dtype=dtype, device=device), "down": _in_out(RowParallelLinear(1024, 512, False, dtype=dtype, device=device))}
    with torch.no_grad():
        linears["down"].weight.normal_(0.0, 1024**-0.5)
    carved = CarvedGemms(device)
    carved.tune({t: [linear] for t, linear in linears.items()}, [4, 16], {"qkv": 24, "down": 24})
    assert len(carved) == 4 and {(r["target"], r["rows"]) for r in carved.report} == {(t, n) for t in linears for n in (4, 16)}
    assert all(r["candidates"] >= 1 and r["chosen"] for r in carved.report)
    for target, linear in linears.items():
        x = torch.randn(16, linear.weight.shape[1], dtype=dtype, device=device)
        carved.project(linear, target, x, 24)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = carved.project(linear, target, x, 24)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            want = linear(x).float()
            assert torch.allclose(y.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@needs_cuda
def test_the_engine_with_tuned_decode_gemms_gives_the_tokens_of_torch_mm(tiny_llama_dir, make_adapter, tmp_path, monkeypatch):
    """bf16 decode graphs with three adapters, every (target, batch size) forced onto a tuned cuBLASLt
    algorithm: every decode graph captured them, the engine without the option never calls them, and
    every greedy token of the tuned engine is within bf16's slack of the best fp32 logit of peft (ties
    aware: another algorithm rounds differently, so a near tie may go the other way than torch.mm's)."""
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from lorakernels import cublaslt
    from loramux.testing.peft_adapters import load_peft_model
    from tests.engine.test_engine_backends import BF16_LOGIT_SLACK
    from tests.engine.test_gpu import PROMPTS, generate_all, three_adapters

    adapters = three_adapters(make_adapter, "carved-gemms", seed=150)
    calls, real = [], cublaslt.LtGemm.__call__
    monkeypatch.setattr(cublaslt.LtGemm, "__call__", lambda self, *a, **k: calls.append((self.rows, self.sm_count)) or real(self, *a, **k))
    monkeypatch.setattr(carved_gemms, "MIN_GAIN", -1e9)
    real_tune = CarvedGemms.tune
    monkeypatch.setattr(CarvedGemms, "tune", lambda self, *a: (real_tune(self, *a), calls.clear()))  # keep the calls after tuning

    def run(tune: bool) -> tuple[list[list[int]], list[list[int]]]:
        config = EngineConfig(
            model_dir=str(tiny_llama_dir), device="cuda", dtype="bfloat16", num_kv_slots=4096, adapters=adapters,
            work_dir=str(tmp_path / str(tune)), max_loras_per_batch=3, lora_backend="splitk", cuda_graph_max_batch=16,
            cuda_graph_max_tokens=1024, tune_decode_gemms=tune,
        )  # fmt: skip
        core = EngineCore.build(config)
        try:
            runner = core.loop.workers.local.runner
            assert (runner.carved_gemms is not None) == tune
            if tune:
                assert len(runner.carved_gemms) == 8 * len(runner.graphs.buckets)  # with and without the carve-out
                num_sms = torch.cuda.get_device_properties(0).multi_processor_count
                carved = num_sms - runner.lora_sm_carveout
                # every decode graph captured the tuned algorithms, the LoRA graphs' and the base graphs'
                assert {(rows, sms) for rows, sms in calls if rows in runner.graphs.buckets} == {
                    (rows, sms) for rows in runner.graphs.buckets for sms in (carved, num_sms)
                }
            prompts = [core.prompt_ids(prompt, None) for prompt in PROMPTS]
            return prompts, generate_all(core, 8, [None, *(core.resolve_adapter(name) for name, _ in adapters)])
        finally:
            core.close()

    run(False)
    assert not calls
    prompts, tuned = run(True)
    model = load_peft_model(tiny_llama_dir, dict(adapters))
    jobs = [(prompt_ids, name) for prompt_ids in prompts for name in [None, *(name for name, _ in adapters)]]
    for (prompt_ids, name), generated in zip(jobs, tuned, strict=True):
        assert len(generated) == 8
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt_ids + generated]), adapter_names=[name or "__base__"]).logits[0].float()
        steps = logits[len(prompt_ids) - 1 : -1]  # the logits each token was chosen from
        gaps = steps.max(dim=1).values - steps.gather(1, torch.tensor(generated)[:, None])[:, 0]
        assert (gaps <= BF16_LOGIT_SLACK).all(), (name, gaps.tolist())
