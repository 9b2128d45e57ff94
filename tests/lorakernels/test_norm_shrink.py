"""The residual add + RMSNorm with the next projection's LoRA shrink (lorakernels/norm_shrink.py) against
its PyTorch reference and against add_rmsnorm then the decode shrink: over adapter popularity (one-row
segments and merged runs, base-model rows, a graph's padding rows), dtypes, stacked targets, split
counts, with and without the residual and the pending delta; the per-row counts back at zero after
every launch; what it refuses.

Without CUDA the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is
imported).
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from lorakernels.norm_shrink import add_rmsnorm_shrink, add_rmsnorm_shrink_ref, shrink_counters  # noqa: E402
from lorakernels.rmsnorm import add_rmsnorm  # noqa: E402
from lorakernels.sgmv_decode import sgmv_shrink_decode  # noqa: E402
from lorakernels.sgmv_ref import SgmvMeta  # noqa: E402
from tests.lorakernels.test_fused_ops import adapted_rows  # noqa: E402
from tests.lorakernels.test_sgmv_decode import POPULARITY, decode_batch, merged  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
MAX_RANK = 16
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3.2e-2}  # of max(1, |ref|)


def case(popularity, dtype, hidden, num_stack, grouped, padding=0, seed=0, num_adapters=5):
    """x, residual, delta, weight, A and the metadata of a decode batch; ranks up to MAX_RANK (some below)."""
    seg_lens, slots, _ = decode_batch(popularity, 12, num_adapters, seed)
    ranks = [0] + [(4, 16, 8, 1)[i % 4] for i in range(num_adapters)]
    if grouped:
        seg_lens, slots = merged(seg_lens, slots)
    gen = torch.Generator().manual_seed(seed)
    num_rows = sum(seg_lens) + padding

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)

    x, residual, delta = randn(num_rows, hidden), randn(num_rows, hidden, scale=2.0), randn(num_rows, hidden, scale=0.1)
    weight = randn(hidden, scale=0.5)
    A = randn(len(ranks), num_stack * MAX_RANK, hidden, scale=hidden**-0.5)
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, [1.0] * len(ranks), DEVICE)
    return x, residual, delta, weight, A, meta, (seg_lens, slots, ranks)


def written_entries(seg_lens, slots, ranks, num_rows, num_stack):
    """[num_rows, num_stack * R] bool: the entries of v the shrink's contract defines (rows with an adapter,
    columns below each target's rank)."""
    mask = torch.zeros(num_rows, num_stack * MAX_RANK, dtype=torch.bool)
    start = 0
    for n, w in zip(seg_lens, slots, strict=True):
        for k in range(num_stack):
            mask[start : start + n, k * MAX_RANK : k * MAX_RANK + ranks[w]] = True
        start += n
    return mask


def assert_norm_close(got, want):
    """Normed rows alike up to one rounding of their fp32 scale (bit for bit in the interpreter)."""
    if not HAS_CUDA:
        assert torch.equal(got, want)
    tol = {torch.float32: 1e-6, torch.bfloat16: 2**-7}[got.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def check(x, residual, delta, weight, A, meta, lists, num_stack, chunk):
    counters = shrink_counters(DEVICE)
    out, res, v = add_rmsnorm_shrink(x, residual, weight, 1e-5, A, meta, num_stack=num_stack, counters=counters, delta=delta, chunk=chunk)
    want_out, want_res, want_v = add_rmsnorm_shrink_ref(x, residual, weight, 1e-5, A, meta, num_stack=num_stack, delta=delta)
    dtype = x.dtype
    # the norm's two outputs: add_rmsnorm's and the reference's within rounding (the fp32 mean of a row
    # may differ by an ulp where the GPU sums it in another order)
    plain_out, plain_res = add_rmsnorm(x, residual, weight, 1e-5, delta)
    assert torch.equal(res, plain_res)
    assert_norm_close(out, plain_out)
    for got, want in ((out, want_out), (res, want_res)):
        err = (got.float() - want.float()).abs().max().item()
        assert err <= TOLERANCE[dtype] * max(1.0, want.float().abs().max().item()), err
    # v: the decode shrink of the norm's output where the contract defines it, zeros past each rank
    mask = written_entries(*lists, x.shape[0], num_stack).to(DEVICE)
    shrunk = sgmv_shrink_decode(plain_out, A, meta, num_stack=num_stack)
    tol = TOLERANCE[dtype] * max(1.0, want_v[mask].float().abs().max().item()) if mask.any() else 0
    assert (v[mask].float() - want_v[mask].float()).abs().max().item() <= tol if mask.any() else True
    assert (v[mask].float() - shrunk[mask].float()).abs().max().item() <= tol if mask.any() else True
    adapted = adapted_rows(*lists, x.shape[0], DEVICE)
    past_rank = adapted[:, None] & ~mask
    assert torch.all(v[past_rank] == 0), "entries past a rank in a row with an adapter are zeros"
    assert torch.all(counters == 0), "every row's count is back at zero for the next launch"
    return int(mask.sum())


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_stack, hidden, chunk", [(3, 640, 128), (2, 300, 256), (1, 200, 512)])
@pytest.mark.parametrize("grouped", [False, True], ids=["row_segments", "merged_runs"])
def test_matches_the_norm_then_the_decode_shrink(popularity, dtype, num_stack, hidden, chunk, grouped):
    """Five splits (640 / 128), two with a partial one (300 / 256), one split (200 / 512)."""
    x, residual, delta, weight, A, meta, lists = case(popularity, dtype, hidden, num_stack, grouped)
    assert check(x, residual, delta, weight, A, meta, lists, num_stack, chunk) > 0


@pytest.mark.parametrize("with_residual, with_delta", [(False, False), (True, False), (False, True)])
def test_the_first_layer_and_no_pending_delta(with_residual, with_delta):
    x, residual, delta, weight, A, meta, lists = case("uniform", torch.float32, 384, 3, True, seed=3)
    check(x, residual if with_residual else None, delta if with_delta else None, weight, A, meta, lists, 3, 128)


def test_a_graphs_padding_rows_get_the_norm_and_no_shrink():
    """Rows past the last segment (a decode graph's padding) are normalised, and their v rows not written."""
    x, residual, delta, weight, A, meta, lists = case("zipf", torch.float32, 256, 2, True, padding=3, seed=5)
    counters = shrink_counters(DEVICE)
    out, _, v = add_rmsnorm_shrink(x, residual, weight, 1e-5, A, meta, num_stack=2, counters=counters, delta=delta, chunk=128)
    v_marked = v.clone()
    v.fill_(float("nan"))
    out2, _, v2 = add_rmsnorm_shrink(x, residual, weight, 1e-5, A, meta, num_stack=2, counters=counters, delta=delta, chunk=128)
    assert torch.equal(out, out2)
    assert_norm_close(out[-3:], add_rmsnorm(x, residual, weight, 1e-5, delta)[0][-3:])
    assert check(x, residual, delta, weight, A, meta, lists, 2, 128) > 0
    adapted = adapted_rows(*lists, x.shape[0], DEVICE)
    assert not adapted[-3:].any()
    assert torch.equal(v2[adapted], v_marked[adapted]), "the same launch twice gives the same v (the counts were reset)"


def test_out_may_be_a_view_into_a_wider_tensor():
    x, residual, _, weight, A, meta, _ = case("distinct", torch.float32, 256, 1, False, seed=7)
    wide = torch.full((x.shape[0], 300), float("nan"), device=DEVICE)
    out, _, _ = add_rmsnorm_shrink(x, residual, weight, 1e-5, A, meta, num_stack=1, counters=shrink_counters(DEVICE), out=wide[:, :256])
    assert out.data_ptr() == wide.data_ptr()
    assert_norm_close(wide[:, :256], add_rmsnorm(x, residual, weight, 1e-5)[0])
    assert wide[:, 256:].isnan().all()


def test_refuses_what_it_cannot_do():
    x, residual, _, weight, A, meta, _ = case("uniform", torch.float32, 256, 2, False)
    counters = shrink_counters(DEVICE)
    with pytest.raises(ValueError, match="want A"):
        add_rmsnorm_shrink(x, residual, weight, 1e-5, A[:, :, :128], meta, num_stack=2, counters=counters)
    with pytest.raises(ValueError, match="want A"):
        add_rmsnorm_shrink(x, residual, weight, 1e-5, A[:, :31], meta, num_stack=2, counters=counters)
    with pytest.raises(ValueError, match="counters"):
        add_rmsnorm_shrink(x, residual, weight, 1e-5, A, meta, num_stack=2, counters=counters[: x.shape[0] - 1])
    with pytest.raises(ValueError, match="counters"):
        add_rmsnorm_shrink(x, residual, weight, 1e-5, A, meta, num_stack=2, counters=counters.long())
    with pytest.raises(ValueError, match="chunk"):
        add_rmsnorm_shrink(x, residual, weight, 1e-5, A, meta, num_stack=2, counters=counters, chunk=192)


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs")
def test_cuda_graph_replay_follows_refilled_segments():
    """One captured launch replayed over regrouped segments and new inputs: each replay's v is the
    shrink of that replay's norm (the counts reset inside the graph)."""
    x, residual, delta, weight, A, meta, _ = case("distinct", torch.bfloat16, 4096, 3, False, seed=11)
    counters = shrink_counters(DEVICE)
    add_rmsnorm_shrink(x, residual, weight, 1e-5, A, meta, num_stack=3, counters=counters, delta=delta)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _, v = add_rmsnorm_shrink(x, residual, weight, 1e-5, A, meta, num_stack=3, counters=counters, delta=delta)
    for popularity in ("identical", "zipf", "skewed"):
        x2, residual2, delta2, _, _, meta2, lists2 = case(popularity, torch.bfloat16, 4096, 3, True, seed=12)
        rows = x2.shape[0]
        for dst, src in ((x, x2), (residual, residual2), (delta, delta2)):
            dst[:rows].copy_(src)
        meta.seg_indptr.fill_(rows)
        meta.seg_indptr[: meta2.seg_indptr.numel()].copy_(meta2.seg_indptr)
        meta.weight_indices.zero_()
        meta.weight_indices[: meta2.weight_indices.numel()].copy_(meta2.weight_indices)
        graph.replay()
        torch.cuda.synchronize()
        plain_out = add_rmsnorm(x, residual, weight, 1e-5, delta)[0]
        assert_norm_close(out, plain_out)
        mask = written_entries(*lists2, rows, 3).to(DEVICE)
        want = sgmv_shrink_decode(plain_out[:rows], A, meta2, num_stack=3)
        assert (v[:rows][mask].float() - want[mask].float()).abs().max().item() <= 3.2e-2
        assert torch.all(counters == 0)
