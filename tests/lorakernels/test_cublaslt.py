"""lorakernels/cublaslt.py: cuBLASLt's candidate algorithms for the engine's decode GEMM layout, run through
ctypes, compute what torch.mm computes, eagerly and replayed from CUDA graphs, under any SM-count target;
what they are given is checked first. The checks that need no GPU run everywhere; the rest need CUDA."""

import pytest
import torch

from lorakernels import cublaslt

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="cuBLASLt runs on CUDA devices")


def test_the_shape_dtype_and_device_are_checked_before_the_library_is_touched():
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        cublaslt.LtGemm(4, 64, 64, torch.float32, torch.device("cuda", 0))
    with pytest.raises(ValueError, match="positive sizes"):
        cublaslt.LtGemm(0, 64, 64, torch.bfloat16, torch.device("cuda", 0))
    with pytest.raises(ValueError, match="sm_count"):
        cublaslt.LtGemm(4, 64, 64, torch.bfloat16, torch.device("cuda", 0), sm_count=-1)
    with pytest.raises(ValueError, match="CUDA devices"):
        cublaslt.LtGemm(4, 64, 64, torch.bfloat16, torch.device("cpu"))


class _Query:
    """Stands in for an LtGemm: its heuristic's candidates, and which foreign algorithms its check takes."""

    def __init__(self, sm_count, algos, accepts=()):
        self.sm_count, self.accepts, self.asked = sm_count, set(accepts), []
        self.found = [cublaslt.Candidate(i, algo, 0, 1.0, {"tile": i}) for i, algo in enumerate(algos)]

    def candidates(self, count, max_workspace=None):
        self.asked.append(max_workspace)
        return self.found[:count]

    def adopt(self, algo):
        return cublaslt.Candidate(-1, algo, 64, 0.5, {"tile": 99}) if algo in self.accepts else None


def test_the_runners_candidates_come_first_then_each_other_algorithm_once_that_its_check_accepts():
    runner = _Query(84, [b"a", b"b"], accepts=[b"c", b"d"])
    every_sm = _Query(0, [b"b", b"c", b"e"])
    more = _Query(100, [b"d", b"c"])
    got = cublaslt.pooled_candidates(runner, [every_sm, more], 8)
    assert [(q.sm_count, c.algo) for q, c in got] == [(84, b"a"), (84, b"b"), (0, b"c"), (100, b"d")]
    adopted = dict((c.algo, c) for _, c in got)[b"c"]
    assert adopted.index == 1 and adopted.workspace == 64  # its place in its own heuristic, the runner's check's workspace
    assert [c.algo for _, c in cublaslt.pooled_candidates(runner, [every_sm], 1)] == [b"a"]  # `count` caps each heuristic
    runner.asked.clear()
    cublaslt.pooled_candidates(runner, [], 8, (None, 0))
    assert runner.asked == [None, 0]  # each heuristic asked at each workspace limit


def _operands(rows, in_dim, out_dim, dtype, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(rows, in_dim, generator=gen).to("cuda", dtype)
    w = (torch.randn(in_dim, out_dim, generator=gen) * in_dim**-0.5).to("cuda", dtype)
    return x, w


def _close(got, want):
    scale = want.float().abs().max().item()
    return (got.float() - want.float()).abs().max().item() <= 2e-2 * scale + 1e-6


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, in_dim, out_dim", [(32, 4096, 6144), (64, 4096, 28672), (5, 256, 384), (1, 14336, 4096)])
@pytest.mark.parametrize("sm_fraction", [0.0, 0.6])
def test_every_candidate_computes_what_torch_mm_computes(dtype, rows, in_dim, out_dim, sm_fraction):
    device = torch.device("cuda", torch.cuda.current_device())
    sms = int(torch.cuda.get_device_properties(device).multi_processor_count * sm_fraction)
    gemm = cublaslt.LtGemm(rows, in_dim, out_dim, dtype, device, sm_count=sms)
    x, w = _operands(rows, in_dim, out_dim, dtype)
    want = x @ w
    found = gemm.candidates(8)
    assert found and [c.index for c in found] == sorted(c.index for c in found)
    for cand in found:
        out = torch.full((rows, out_dim), float("nan"), dtype=dtype, device=device)
        assert gemm(x, w, out, cand.algo) is out
        assert _close(out, want), cand.config
    assert _close(gemm(x, w), want)  # the heuristic's first, into a new tensor


@needs_cuda
def test_a_captured_call_reads_its_inputs_at_every_replay():
    device = torch.device("cuda", torch.cuda.current_device())
    rows, in_dim, out_dim = 16, 1024, 2048
    gemm = cublaslt.LtGemm(rows, in_dim, out_dim, torch.bfloat16, device, sm_count=32)
    x, w = _operands(rows, in_dim, out_dim, torch.bfloat16)
    out = torch.empty(rows, out_dim, dtype=torch.bfloat16, device=device)
    for cand in gemm.candidates(4):
        gemm(x, w, out, cand.algo)  # outside the graph first, as the engine warms up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gemm(x, w, out, cand.algo)
        for seed in (1, 2):
            x2, w2 = _operands(rows, in_dim, out_dim, torch.bfloat16, seed)
            x.copy_(x2)
            w.copy_(w2)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert _close(out, x2 @ w2)


@needs_cuda
def test_an_algorithm_from_another_sm_target_is_adopted_only_where_cublaslt_accepts_it():
    device = torch.device("cuda", torch.cuda.current_device())
    rows, in_dim, out_dim = 32, 4096, 4096
    carved = cublaslt.LtGemm(rows, in_dim, out_dim, torch.bfloat16, device, sm_count=84)
    full = cublaslt.LtGemm(rows, in_dim, out_dim, torch.bfloat16, device)
    x, w = _operands(rows, in_dim, out_dim, torch.bfloat16)
    adopted = [carved.adopt(c.algo) for c in full.candidates(8)]
    assert any(a is not None for a in adopted)
    for cand in filter(None, adopted):
        assert _close(carved(x, w, algo=cand.algo), x @ w)
    other = cublaslt.LtGemm(8, 64, 64, torch.bfloat16, device)  # another shape's algorithm: never run unchecked
    with pytest.raises(ValueError, match="not one of this GEMM's candidates"):
        other(x[:8, :64].contiguous(), w[:64, :64].contiguous(), algo=full.candidates(1)[0].algo)
    with pytest.raises(ValueError, match="64 bytes"):
        carved.adopt(b"\0" * 8)


@needs_cuda
def test_operands_of_the_wrong_shape_dtype_layout_or_alignment_are_refused():
    device = torch.device("cuda", torch.cuda.current_device())
    gemm = cublaslt.LtGemm(8, 256, 512, torch.bfloat16, device)
    x, w = _operands(8, 256, 512, torch.bfloat16)
    with pytest.raises(ValueError, match="x: expected"):
        gemm(x[:4], w)
    with pytest.raises(ValueError, match="w: expected"):
        gemm(x, w.half())
    with pytest.raises(ValueError, match="w: expected"):
        gemm(x, w.t().contiguous().t())  # the logical [in, out] weight stored [out, in]
    with pytest.raises(ValueError, match="out: expected"):
        gemm(x, w, torch.empty(8, 256, dtype=torch.bfloat16, device=device))
    flat = torch.empty(8 * 256 + 8, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="aligned"):
        gemm(flat[8:].view(8, 256), w)
