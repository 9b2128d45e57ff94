"""Fused decode kernels (residual add + RMSNorm, SiLU-mul, RoPE + KV write) against their PyTorch
references, and the references against the model's own PyTorch code.

Without CUDA the Triton kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set here before
triton is imported); with CUDA they run natively. The references are what the CPU path computes, so
each is checked bit for bit against engine/models/blocks.py and engine/rope.py; the kernels are checked against
the references over a grid of dtypes, widths that are and are not powers of two, MHA/GQA/MQA heads and
head dims, with outputs poisoned first so an unwritten element fails. Each kernel also takes a LoRA delta
still to add to its input (computed beside the base GEMM in CUDA decode steps): with it, the kernel gives
what it gives for the rounded sum input + delta.
"""

import dataclasses
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from triton import next_power_of_2 as triton_next_power_of_2  # noqa: E402

from engine.rope import apply_rope  # noqa: E402
from lorakernels.rmsnorm import add_rmsnorm, add_rmsnorm_ref  # noqa: E402
from lorakernels.rope_kv import rope_kv_write, rope_kv_write_ref  # noqa: E402
from lorakernels.sgmv_ref import SgmvMeta, sgmv_expand_ref  # noqa: E402
from lorakernels.silu_mul import FUSED_MAX_RANK, silu_mul, silu_mul_expand, silu_mul_ref  # noqa: E402
from tests.lorakernels.test_sgmv import POPULARITY, make_batch  # noqa: E402
from tests.lorakernels.test_sgmv_decode import decode_batch, merged  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# of max(1, |expected|) per element: fp32 to a few ulps; 16-bit types to about two rounding steps. The
# interpreter rounds fp32 -> bf16 toward zero (CUDA to nearest even): up to an ulp more per rounding.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2 if HAS_CUDA else 3.2e-2}
EXACT_ROUNDING = {torch.float32, torch.float16} | ({torch.bfloat16} if HAS_CUDA else set())


def randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def assert_close(actual, expected, dtype, what="", roundings=1):
    """roundings: of a 16-bit type, where the kernel and the reference may each round a step apart (the
    interpreter toward zero), more than one before the result."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    assert torch.isfinite(actual).all(), f"{what}: unwritten or non-finite entries"
    scale = expected.double().abs().clamp(min=1.0)
    err = ((actual.double() - expected.double()).abs() / scale).max().item() if actual.numel() else 0.0
    tolerance = TOLERANCE[dtype] * (roundings if dtype != torch.float32 else 1)
    assert err <= tolerance, f"{what}: max relative error {err:.3g} > {tolerance:.3g}"


# -- residual add + RMSNorm ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 96, 1000])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm_matches_reference(dtype, hidden, with_residual):
    x = randn(7, hidden, dtype=dtype, seed=hidden, scale=2.0)
    residual = randn(7, hidden, dtype=dtype, seed=hidden + 1, scale=3.0) if with_residual else None
    weight = randn(hidden, dtype=dtype, seed=hidden + 2) + 1.0
    out, res = add_rmsnorm(x, residual, weight, 1e-5)
    ref_out, ref_res = add_rmsnorm_ref(x, residual, weight, 1e-5)
    assert_close(out, ref_out, dtype, "normed")
    if with_residual:
        assert_close(res, ref_res, dtype, "residual")
        assert torch.equal(res, ref_res) or dtype not in EXACT_ROUNDING  # one fp32 add rounded once
        assert not torch.equal(res, x)
    else:
        assert res is x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm_adds_a_pending_delta_first(dtype, with_residual):
    x = randn(5, 96, dtype=dtype, seed=11, scale=2.0)
    delta = randn(5, 96, dtype=dtype, seed=12, scale=0.5)
    residual = randn(5, 96, dtype=dtype, seed=13, scale=3.0) if with_residual else None
    weight = randn(96, dtype=dtype, seed=14) + 1.0
    out, res = add_rmsnorm(x, residual, weight, 1e-5, delta)
    ref_out, ref_res = add_rmsnorm_ref(x, residual, weight, 1e-5, delta)
    assert_close(out, ref_out, dtype, "normed")
    assert_close(res, ref_res, dtype, "residual")
    if dtype in EXACT_ROUNDING:  # the same bits as adding the delta first in PyTorch
        sum_out, sum_res = add_rmsnorm(x + delta, residual, weight, 1e-5)
        assert torch.equal(res, sum_res) and torch.equal(out, sum_out)
    assert res is not x and not torch.equal(out, add_rmsnorm(x, residual, weight, 1e-5)[0])
    with pytest.raises(ValueError, match="delta"):
        add_rmsnorm(x, residual, weight, 1e-5, delta[:, :64])


def test_add_rmsnorm_handles_strided_rows_and_empty_batches():
    x = randn(5, 128, dtype=torch.float32, seed=3)[:, :64]  # row stride 128, width 64
    weight = randn(64, dtype=torch.float32, seed=4)
    out, _ = add_rmsnorm(x, None, weight, 1e-6)
    assert_close(out, add_rmsnorm_ref(x.contiguous(), None, weight, 1e-6)[0], torch.float32)
    empty, _ = add_rmsnorm(x[:0], None, weight, 1e-6)
    assert empty.shape == (0, 64)
    with pytest.raises(ValueError, match="weight"):
        add_rmsnorm(x, None, weight[:32], 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_add_rmsnorm_ref_is_the_model_layer_residual_and_norm(dtype):
    """The reference (the CPU path) rounds as `x = x + sublayer; norm(x)` in engine/models/blocks.py does."""
    from engine.models.blocks import RMSNorm

    norm = RMSNorm(96, 1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96) + 0.5)
    x, delta = torch.randn(9, 96).to(dtype) * 3, torch.randn(9, 96).to(dtype)
    out, res = add_rmsnorm_ref(delta, x, norm.weight.detach(), 1e-5)
    assert torch.equal(res, x + delta)
    assert torch.equal(out, norm(x + delta).detach())


# -- SiLU-mul -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [16, 176, 1500])  # 1500: two BLOCK tiles, the second partial
def test_silu_mul_matches_reference(dtype, inter):
    gate_up = randn(6, 2 * inter, dtype=dtype, seed=inter, scale=3.0)
    assert_close(silu_mul(gate_up), silu_mul_ref(gate_up), dtype)
    assert silu_mul(gate_up[:0]).shape == (0, inter)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_adds_a_pending_delta_first(dtype):
    gate_up = randn(6, 2 * 176, dtype=dtype, seed=21, scale=3.0)
    delta = randn(6, 2 * 176, dtype=dtype, seed=22, scale=0.5)
    out = silu_mul(gate_up, delta)
    assert_close(out, silu_mul_ref(gate_up, delta), dtype)
    if dtype in EXACT_ROUNDING:
        assert torch.equal(out, silu_mul(gate_up + delta))
    assert not torch.equal(out, silu_mul(gate_up))
    with pytest.raises(ValueError, match="delta"):
        silu_mul(gate_up, delta.float() if dtype != torch.float32 else delta.half())


# (seg_lens, slots, padding rows past the last segment): slot 0 is the base model (rank 0), slot 3 an
# adapter of rank 5 < R, slot 4 an empty slot; long segments span several row blocks, 1-token ones
# are decodes beside them, an empty segment sits in between.
EXPAND_CASES = {
    "one_long": ([70], [1], 0),
    "mixed": ([1, 1, 0, 37, 1, 90, 2], [2, 3, 1, 1, 0, 3, 4], 0),
    "padded": ([5, 20], [2, 0], 11),
    "base_only": ([9], [0], 3),
}


CASE_RANKS, CASE_SCALINGS = [0, 8, 8, 5, 0], [0.0, 0.5, 1.75, 2.0, 3.0]  # EXPAND_CASES' slots
EXPAND_MAX_RANK = 8


def popularity_batch(popularity):
    """test_sgmv's batch of 6 requests, 48 tokens in all (a base, an empty and a rank-0 slot's segment among
    them, in any order), its ranks capped at the expand tests' capacity: (seg_lens, slots, ranks, scalings)."""
    seg_lens, slots, ranks, scalings = make_batch(popularity, 6, 48, seed=len(popularity))
    return seg_lens, slots, [min(r, EXPAND_MAX_RANK) for r in ranks], scalings


def adapted_rows(seg_lens, slots, ranks, num_rows, device):
    """Which of num_rows rows lie in a segment whose slot holds an adapter (rank > 0); rows past the last
    segment (a graph's padding) do not."""
    adapted = torch.zeros(num_rows, dtype=torch.bool, device=device)
    start = 0
    for n, w in zip(seg_lens, slots, strict=True):
        adapted[start : start + n] = ranks[w] > 0
        start += n
    return adapted


def expand_case(dtype, seg_lens, slots, padding, inter=80, seed=0, ranks=CASE_RANKS, scalings=CASE_SCALINGS):
    max_rank = EXPAND_MAX_RANK
    num_tokens = sum(seg_lens) + padding
    gate_up = randn(num_tokens, 2 * inter, dtype=dtype, seed=seed, scale=3.0)
    v = randn(num_tokens, 2 * max_rank, dtype=dtype, seed=seed + 1)
    B = randn(len(ranks), 2 * inter, max_rank, dtype=dtype, seed=seed + 2, scale=0.5)
    start = 0
    for n, w in zip(seg_lens, slots, strict=True):  # what the shrink does not write: NaN, never read
        v[start : start + n, ranks[w] : max_rank] = float("nan")
        v[start : start + n, max_rank + ranks[w] :] = float("nan")
        start += n
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)
    return gate_up, v, B, meta


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(EXPAND_CASES))
def test_silu_mul_expand_is_the_expand_then_silu_mul(dtype, case):
    """silu_mul_expand(gate_up, v, B, meta) = silu_mul(gate_up after the gate/up expand), with gate_up
    left as it was: every segmentation, ranks below R (v past the rank unread), base and empty slots,
    and rows past the last segment (a CUDA graph's padding) that get the SiLU-mul alone."""
    seg_lens, slots, padding = EXPAND_CASES[case]
    check_silu_mul_expand(dtype, seg_lens, slots, padding, CASE_RANKS, CASE_SCALINGS, case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("popularity", POPULARITY)
def test_silu_mul_expand_over_adapter_popularity(dtype, popularity):
    seg_lens, slots, ranks, scalings = popularity_batch(popularity)
    check_silu_mul_expand(dtype, seg_lens, slots, 5, ranks, scalings, popularity)


def check_silu_mul_expand(dtype, seg_lens, slots, padding, ranks, scalings, what):
    gate_up, v, B, meta = expand_case(dtype, seg_lens, slots, padding, ranks=ranks, scalings=scalings)
    inter = gate_up.shape[1] // 2
    before = gate_up.clone()
    expanded = gate_up.clone()
    sgmv_expand_ref(torch.nan_to_num(v), B, meta, expanded, output_slices=((0, inter), (inter, inter)))
    out = silu_mul_expand(gate_up, v, B, meta)
    assert_close(out, silu_mul_ref(expanded), dtype, what)
    assert torch.equal(gate_up, before)
    adapted = adapted_rows(seg_lens, slots, ranks, out.shape[0], out.device)
    plain = silu_mul_ref(before)
    assert torch.equal(out[~adapted], silu_mul(before)[~adapted])
    if adapted.any():
        assert not torch.allclose(out[adapted].float(), plain[adapted].float())


def test_silu_mul_expand_replays_any_segmentation_from_one_launch_size():
    """A CUDA graph's meta: max_seg_len and the segment count as captured, segments refilled on the
    device. The same launch gives each new segmentation's result."""
    gate_up, v, B, _ = expand_case(torch.float32, [40, 10], [1, 2], 14)
    inter = gate_up.shape[1] // 2
    ranks, scalings = [0, 8, 8, 5, 0], [0.0, 0.5, 1.75, 2.0, 3.0]
    for seg_lens, slots in (([40, 10, 0, 0], [1, 2, 0, 0]), ([1, 1, 1, 61], [3, 0, 2, 1]), ([0, 0, 0, 0], [0, 0, 0, 0])):
        meta = dataclasses.replace(SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE), max_seg_len=64)
        expanded = gate_up.clone()
        sgmv_expand_ref(torch.nan_to_num(v), B, meta, expanded, output_slices=((0, inter), (inter, inter)))
        assert_close(silu_mul_expand(gate_up, torch.nan_to_num(v), B, meta), silu_mul_ref(expanded), torch.float32, str(seg_lens))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_expand_takes_a_decode_graphs_segments(dtype):
    """--lora-decode-fused-expand: a decode graph (engine/cuda_graphs.py) is captured with one segment
    slot a row, every row on the base slot and max_seg_len min(batch, DECODE_RUN); its launch keeps
    those host facts. Each replay refills the device metadata: rows merged per adapter into runs of at
    most DECODE_RUN, padded rows on the base slot (rank 0), the other segments empty. Every replay's
    result is the expand-then-SiLU-mul one, v past each row's rank unread (NaN), and in fp32 what the
    unfused decode path gives (silu_mul of gate/up and the delta computed apart)."""
    from engine.lora_inputs import DECODE_RUN, lora_segments

    batch, base, max_rank = 24, 4, 8
    gate_up, v0, B, _ = expand_case(dtype, [batch], [1], 0)
    v0 = torch.nan_to_num(v0)
    inter = gate_up.shape[1] // 2
    ranks, scalings = [0, 8, 8, 5, 0], [0.0, 0.5, 1.75, 2.0, 3.0]
    captured = SgmvMeta.from_lists([1] * batch, [base] * batch, ranks, scalings, DEVICE)
    captured = dataclasses.replace(captured, max_seg_len=min(batch, DECODE_RUN))
    for slots in ([1] * 18 + [2] * 3 + [3] + [base] * 2, [3, 2] + [base] * 22, [1] * batch):
        slots = sorted(slots)
        seg_lens, seg_slots = lora_segments([1] * batch, slots, DECODE_RUN)
        pad = batch - len(seg_lens)
        refilled = SgmvMeta.from_lists(seg_lens + [0] * pad, seg_slots + [0] * pad, ranks, scalings, DEVICE)
        meta = dataclasses.replace(captured, seg_indptr=refilled.seg_indptr, weight_indices=refilled.weight_indices)
        v = v0.clone()
        for row, w in enumerate(slots):  # what the decode shrink leaves unwritten past the rank
            v[row, ranks[w] : max_rank] = float("nan")
            v[row, max_rank + ranks[w] :] = float("nan")
        expanded = gate_up.clone()
        sgmv_expand_ref(v0, B, meta, expanded, output_slices=((0, inter), (inter, inter)))
        out = silu_mul_expand(gate_up, v, B, meta)
        assert_close(out, silu_mul_ref(expanded), dtype, str(slots))
        if dtype == torch.float32:  # in 16 bits the unfused path rounds the delta and the sum apart
            delta = torch.zeros_like(gate_up)
            sgmv_expand_ref(v0, B, meta, delta, output_slices=((0, inter), (inter, inter)))
            assert_close(out, silu_mul_ref(gate_up, delta), dtype, "unfused")
        assert not torch.allclose(out.float(), silu_mul_ref(gate_up).float())  # the adapters did change it


def test_silu_mul_expand_launches_its_kernel_once(kernel_launches):
    """One launch a call: 32ac0d4 left a second, identical launch behind the first, which gave the same
    output (the kernel leaves gate_up as it was) at twice the time, so only a count shows it."""
    import lorakernels.silu_mul

    grids = kernel_launches(lorakernels.silu_mul, "_silu_mul_expand_kernel")
    gate_up, v, B, meta = expand_case(torch.float32, [5, 20], [2, 0], 11)
    silu_mul_expand(gate_up, torch.nan_to_num(v), B, meta)
    assert len(grids) == 1


def test_silu_mul_expand_refuses_mismatched_inputs():
    gate_up, v, B, meta = expand_case(torch.float32, [6], [1], 0)
    with pytest.raises(ValueError, match="columns"):
        silu_mul_expand(gate_up, v[:, :8], B, meta)
    with pytest.raises(ValueError, match="out_dim"):
        silu_mul_expand(gate_up[:, :-2], v, B, meta)
    with pytest.raises(ValueError, match="2 \\* I"):
        silu_mul_expand(gate_up[:, :-1], v, B, meta)
    with pytest.raises(ValueError, match="not gate's then up's halves"):
        silu_mul_expand(gate_up, v, B, meta, output_slices=((0, 40), (40, 40)))
    wide = torch.zeros(B.shape[0], B.shape[1], 2 * FUSED_MAX_RANK, dtype=B.dtype, device=B.device)
    with pytest.raises(ValueError, match="rank capacity 128 > 64"):
        silu_mul_expand(gate_up, torch.zeros(v.shape[0], 4 * FUSED_MAX_RANK, device=v.device), wide, meta)


def test_only_prefill_sized_steps_within_the_rank_capacity_fuse_the_expand():
    """engine/lora_inputs.py leaves gate/up's expand to silu_mul_expand only in steps the decode
    kernels would not take, and only for pools whose rank capacity the kernel loads whole."""
    from engine.lora_inputs import _fuses_expand

    prefill = SgmvMeta.from_lists([300, 2], [1, 2], [0, 8, 8], [0.0, 1.0, 1.0], DEVICE)
    decode = SgmvMeta.from_lists([1] * 32, [1, 2] * 16, [0, 8, 8], [0.0, 1.0, 1.0], DEVICE)
    assert _fuses_expand(prefill, 302, FUSED_MAX_RANK)
    assert not _fuses_expand(prefill, 302, 2 * FUSED_MAX_RANK)
    assert not _fuses_expand(decode, 32, 16)


def norm_expand_case(dtype, seg_lens, slots, padding, hidden=600, seed=0, ranks=CASE_RANKS, scalings=CASE_SCALINGS):
    """x, a residual, a norm weight and o's (or down's) shrink and B: one target, max rank 8."""
    max_rank, num_tokens = EXPAND_MAX_RANK, sum(seg_lens) + padding
    x = randn(num_tokens, hidden, dtype=dtype, seed=seed, scale=2.0)
    residual = randn(num_tokens, hidden, dtype=dtype, seed=seed + 1, scale=3.0)
    weight = randn(hidden, dtype=dtype, seed=seed + 2)
    v = randn(num_tokens, max_rank, dtype=dtype, seed=seed + 3)
    B = randn(len(ranks), hidden, max_rank, dtype=dtype, seed=seed + 4, scale=0.5)
    start = 0
    for n, w in zip(seg_lens, slots, strict=True):  # what the shrink does not write: NaN, never read
        v[start : start + n, ranks[w] :] = float("nan")
        start += n
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)
    return x, residual, weight, v, B, meta


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(EXPAND_CASES))
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first"])
def test_add_rmsnorm_expand_is_the_expand_then_add_rmsnorm(dtype, case, with_residual):
    """add_rmsnorm_expand(x, residual, w, eps, v, B, meta) = add_rmsnorm(x after o's or down's expand,
    residual, w, eps), x left as it was: every segmentation, ranks below R (v past the rank unread), base
    and empty slots, rows past the last segment (a graph's padding) normalised without LoRA, and a width
    that is no multiple of the column block."""
    seg_lens, slots, padding = EXPAND_CASES[case]
    check_add_rmsnorm_expand(dtype, seg_lens, slots, padding, CASE_RANKS, CASE_SCALINGS, with_residual, case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("popularity", POPULARITY)
def test_add_rmsnorm_expand_over_adapter_popularity(dtype, popularity):
    seg_lens, slots, ranks, scalings = popularity_batch(popularity)
    check_add_rmsnorm_expand(dtype, seg_lens, slots, 5, ranks, scalings, True, popularity)


def check_add_rmsnorm_expand(dtype, seg_lens, slots, padding, ranks, scalings, with_residual, case):
    from lorakernels.rmsnorm import add_rmsnorm_expand

    x, residual, weight, v, B, meta = norm_expand_case(dtype, seg_lens, slots, padding, ranks=ranks, scalings=scalings)
    residual = residual if with_residual else None
    before = x.clone()
    expanded = x.clone()
    sgmv_expand_ref(torch.nan_to_num(v), B, meta, expanded, output_slices=((0, x.shape[1]),))
    want_out, want_sum = add_rmsnorm_ref(expanded, residual, weight, 1e-5)
    out, summed = add_rmsnorm_expand(x, residual, weight, 1e-5, v, B, meta)
    # x + its expand is rounded before the residual is added, at that sum's magnitude: where the residual
    # then cancels it, one rounding step apart (the interpreter rounds bf16 toward zero) is relative to it
    magnitude = expanded if residual is None else expanded.abs() + residual.abs()
    err = ((summed.double() - want_sum.double()).abs() / magnitude.double().abs().clamp(min=1.0)).max().item()
    assert torch.isfinite(summed).all() and err <= 2 * TOLERANCE[dtype], f"{case} sum: {err:.3g}"
    assert_close(out, add_rmsnorm_ref(summed, None, weight, 1e-5)[0], dtype, f"{case} out")  # the norm of that sum
    if dtype == torch.float32:  # in 16 bits the dot's fp32 sum order may move x + d a rounding step
        assert_close(out, want_out, dtype, f"{case} out")
    assert torch.equal(x, before)
    plain, _ = add_rmsnorm_ref(before, residual, weight, 1e-5)
    adapted = adapted_rows(seg_lens, slots, ranks, x.shape[0], x.device)
    assert_close(out[~adapted], plain[~adapted], dtype, f"{case} rows without LoRA", roundings=2)
    if adapted.any():
        assert not torch.allclose(out[adapted].float(), plain[adapted].float())


def test_add_rmsnorm_expand_replays_any_segmentation_from_one_launch_size():
    """A step graph's meta (max_seg_len and the segment count as captured, the segments refilled on the
    device; no host lengths): one launch size gives each segmentation's result, every row normalised."""
    from lorakernels.rmsnorm import add_rmsnorm_expand

    x, residual, weight, v, B, _ = norm_expand_case(torch.float32, [40, 10], [1, 2], 14, hidden=300)
    v = torch.nan_to_num(v)
    ranks, scalings = [0, 8, 8, 5, 0], [0.0, 0.5, 1.75, 2.0, 3.0]
    for seg_lens, slots in (([40, 10, 0, 0], [1, 2, 0, 0]), ([1, 1, 1, 61], [3, 0, 2, 1]), ([0, 0, 0, 0], [0, 0, 0, 0])):
        meta = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)
        meta = dataclasses.replace(meta, max_seg_len=64, host_seg_lens=None)
        expanded = x.clone()
        sgmv_expand_ref(v, B, meta, expanded, output_slices=((0, x.shape[1]),))
        want_out, want_sum = add_rmsnorm_ref(expanded, residual, weight, 1e-5)
        out, summed = add_rmsnorm_expand(x, residual, weight, 1e-5, v, B, meta)
        assert_close(summed, want_sum, torch.float32, str(seg_lens))
        assert_close(out, want_out, torch.float32, str(seg_lens))


def test_add_rmsnorm_expand_refuses_mismatched_inputs():
    from lorakernels.rmsnorm import add_rmsnorm_expand

    x, residual, weight, v, B, meta = norm_expand_case(torch.float32, [6], [1], 0, hidden=64)
    with pytest.raises(ValueError, match="columns"):
        add_rmsnorm_expand(x, residual, weight, 1e-5, v[:, :4], B, meta)
    with pytest.raises(ValueError, match="out_dim"):
        add_rmsnorm_expand(x[:, :-2], residual[:, :-2], weight[:-2], 1e-5, v, B, meta)
    with pytest.raises(ValueError, match="residual"):
        add_rmsnorm_expand(x, residual[:, :-2], weight, 1e-5, v, B, meta)
    wide = torch.zeros(B.shape[0], B.shape[1], 2 * FUSED_MAX_RANK, dtype=B.dtype, device=B.device)
    with pytest.raises(ValueError, match="rank capacity 128 > 64"):
        add_rmsnorm_expand(x, residual, weight, 1e-5, torch.zeros(v.shape[0], 2 * FUSED_MAX_RANK, device=v.device), wide, meta)


def test_silu_mul_ref_is_the_model_mlp_activation():
    gate_up = torch.randn(5, 64).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(silu_mul_ref(gate_up), torch.nn.functional.silu(gate) * up)
    with pytest.raises(ValueError, match="2 \\* I"):
        silu_mul(gate_up[:, :63])


# -- RoPE + KV write ---------------------------------------------------------------------------------------

HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}  # name -> (H, Hkv)


def rope_case(dtype, num_heads, num_kv_heads, head_dim, num_tokens=6, seed=0, num_slots=20):
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.arange(512).float()[:, None] * inv_freq[None, :]  # [512, D/2]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)  # the layout of engine/rope.py
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=seed, scale=2.0)
    gen = torch.Generator().manual_seed(seed + 1)
    positions = torch.randint(0, 512, (num_tokens,), generator=gen).to(DEVICE)
    out_cache_loc = torch.randperm(num_slots, generator=gen)[:num_tokens].to(DEVICE)
    return cos_sin, qkv, positions, out_cache_loc


def caches(num_kv_heads, head_dim, dtype, num_slots=20):
    nan = torch.full((num_slots, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    return nan.clone(), nan.clone()


# one head a program (decode steps), or 4 / 8 heads (prefill steps): query and key heads then share programs
PER_PROGRAM = [1, 4, 8]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("head_dim", [16, 64, 96])  # 96: half of 48 is not a power of two
@pytest.mark.parametrize("per_program", PER_PROGRAM)
def test_rope_kv_write_matches_reference(dtype, heads, head_dim, per_program):
    num_heads, num_kv_heads = HEADS[heads]
    cos_sin, qkv, positions, loc = rope_case(dtype, num_heads, num_kv_heads, head_dim, seed=head_dim)
    kw = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    k_cache, v_cache = caches(num_kv_heads, head_dim, dtype)
    k_ref, v_ref = caches(num_kv_heads, head_dim, dtype)
    q = rope_kv_write(qkv, positions, cos_sin, k_cache, v_cache, loc, heads_per_program=per_program, **kw)
    q_ref = rope_kv_write_ref(qkv, positions, cos_sin, k_ref, v_ref, loc, **kw)
    assert_close(q, q_ref, dtype, "q")
    assert_close(k_cache[loc], k_ref[loc], dtype, "k")
    assert torch.equal(v_cache[loc], v_ref[loc])  # a copy: no rounding
    untouched = torch.ones(20, dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert torch.isnan(k_cache[untouched]).all() and torch.isnan(v_cache[untouched]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", ["gqa", "mqa"])
@pytest.mark.parametrize("per_program", PER_PROGRAM)
def test_rope_kv_write_adds_a_pending_delta_first(dtype, heads, per_program):
    num_heads, num_kv_heads = HEADS[heads]
    cos_sin, qkv, positions, loc = rope_case(dtype, num_heads, num_kv_heads, 64, seed=5)
    delta = randn(*qkv.shape, dtype=dtype, seed=6, scale=0.5)
    kw = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": 64, "heads_per_program": per_program}
    k_cache, v_cache = caches(num_kv_heads, 64, dtype)
    k_ref, v_ref = caches(num_kv_heads, 64, dtype)
    q = rope_kv_write(qkv, positions, cos_sin, k_cache, v_cache, loc, delta=delta, **kw)
    kw_ref = {name: value for name, value in kw.items() if name != "heads_per_program"}
    q_ref = rope_kv_write_ref(qkv, positions, cos_sin, k_ref, v_ref, loc, delta=delta, **kw_ref)
    assert_close(q, q_ref, dtype, "q")
    assert_close(k_cache[loc], k_ref[loc], dtype, "k")
    assert_close(v_cache[loc], v_ref[loc], dtype, "v")
    if dtype in EXACT_ROUNDING:  # the same bits as adding the delta first in PyTorch
        k_sum, v_sum = caches(num_kv_heads, 64, dtype)
        q_sum = rope_kv_write(qkv + delta, positions, cos_sin, k_sum, v_sum, loc, **kw)
        assert torch.equal(q, q_sum) and torch.equal(k_cache[loc], k_sum[loc]) and torch.equal(v_cache[loc], v_sum[loc])
    q_plain = rope_kv_write(qkv, positions, cos_sin, *caches(num_kv_heads, 64, dtype), loc, **kw)
    assert not torch.equal(q, q_plain)
    with pytest.raises(ValueError, match="delta"):
        rope_kv_write(qkv, positions, cos_sin, k_cache, v_cache, loc, delta=delta[:3], **kw)


def test_rope_kv_write_rotates_several_heads_a_program_in_prompt_sized_steps(kernel_launches):
    """From GROUP_MIN_TOKENS tokens on (without an expand) one program takes HEADS_PER_PROGRAM heads of
    its token, query and key heads alike; shorter steps one head a program. Both give the reference."""
    import lorakernels.rope_kv as rope_kv

    grouped = kernel_launches(rope_kv, "_rope_kv_heads_kernel")
    single = kernel_launches(rope_kv, "_rope_kv_kernel")
    num_heads, num_kv_heads = HEADS["gqa"]
    kw = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": 16}
    for num_tokens in (rope_kv.GROUP_MIN_TOKENS, 6):
        cos_sin, qkv, positions, loc = rope_case(torch.float32, num_heads, num_kv_heads, 16, num_tokens=num_tokens, num_slots=300)
        k_cache, v_cache = caches(num_kv_heads, 16, torch.float32, num_slots=300)
        k_ref, v_ref = caches(num_kv_heads, 16, torch.float32, num_slots=300)
        q = rope_kv_write(qkv, positions, cos_sin, k_cache, v_cache, loc, **kw)
        assert_close(q, rope_kv_write_ref(qkv, positions, cos_sin, k_ref, v_ref, loc, **kw), torch.float32, "q")
        assert_close(k_cache[loc], k_ref[loc], torch.float32, "k")
        assert torch.equal(v_cache[loc], v_ref[loc])
    heads = triton_next_power_of_2(rope_kv.HEADS_PER_PROGRAM)
    assert grouped == [(rope_kv.GROUP_MIN_TOKENS, -(-(num_heads + num_kv_heads) // heads))]
    assert single == [(6, num_heads + num_kv_heads)]


ROPE_SEGMENTS = {  # (segment lengths, slots, rows); slot 4 is the base slot (rank 0)
    "graph": ([5, 3, 1, 3] + [0] * 8, [1, 2, 3, 4] + [0] * 8, 12),  # a decode graph's replay: every row covered
    "runs": ([2, 0, 2, 1, 7], [1, 2, 1, 3, 2], 12),  # an adapter's rows split into runs, an empty segment between
    "uncovered": ([4, 5], [2, 3], 12),  # rows past the last segment: no LoRA
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("case", sorted(ROPE_SEGMENTS))
def test_rope_kv_write_does_a_decode_steps_qkv_expand(dtype, heads, case):
    """--lora-decode-fused-expand: rope_kv_write given (v, B, meta) computes the q/k/v LoRA delta of
    each row's adapter itself, each target from its own columns of v, ranks below the capacity (v and B
    past a row's rank unread: NaN), scalings per slot; the reference's result, and in fp32 the delta
    path's."""
    check_rope_expand(dtype, heads, *ROPE_SEGMENTS[case])


def test_rope_kv_write_finds_a_rows_segment_among_many():
    """More segments than one step of the kernel's segment search reads (64): a batch-70 decode graph."""
    check_rope_expand(torch.float32, "gqa", [1] * 70, [1 + i % 4 for i in range(70)], 70)


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize(
    "grouped, dtype", [(False, torch.float32), (True, torch.bfloat16)], ids=["row_segments-fp32", "merged_runs-bf16"]
)
def test_rope_kv_write_expands_decode_batches_over_adapter_popularity(popularity, grouped, dtype):
    """test_sgmv_decode's decode batches (12 rows over 4 adapters, some base-model rows), as one-row
    segments or as the runs a decode step merges them into, ranks capped at the capacity 8."""
    seg_lens, slots, ranks = decode_batch(popularity, batch=12, num_adapters=4, seed=len(popularity))
    if grouped:
        seg_lens, slots = merged(seg_lens, slots)
    ranks = [min(r, EXPAND_MAX_RANK) for r in ranks]
    scalings = [0.0] + [0.25 * (1 + i % 7) for i in range(len(ranks) - 1)]
    check_rope_expand(dtype, "gqa", seg_lens, slots, 12, ranks=ranks, scalings=scalings)


def check_rope_expand(dtype, heads, seg_lens, slots, rows, ranks=CASE_RANKS, scalings=CASE_SCALINGS):
    num_heads, num_kv_heads = HEADS[heads]
    head_dim, max_rank = 64, EXPAND_MAX_RANK
    cos_sin, qkv, positions, loc = rope_case(dtype, num_heads, num_kv_heads, head_dim, num_tokens=rows, seed=7, num_slots=80)
    kw = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    v = randn(rows, 3 * max_rank, dtype=dtype, seed=8)
    B = randn(len(ranks), qkv.shape[1], max_rank, dtype=dtype, seed=9, scale=0.5)
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)
    poisoned_b = B.clone()
    for w, r in enumerate(ranks):  # B past a slot's rank: never read
        poisoned_b[w, :, r:] = float("nan")
    poisoned, start = v.clone(), 0
    for n, w in zip(seg_lens, slots, strict=True):  # what the decode shrink leaves unwritten
        for k in range(3):
            poisoned[start : start + n, k * max_rank + ranks[w] : (k + 1) * max_rank] = float("nan")
        start += n
    k_cache, v_cache = caches(num_kv_heads, head_dim, dtype, num_slots=80)
    k_ref, v_ref = caches(num_kv_heads, head_dim, dtype, num_slots=80)
    q = rope_kv_write(qkv, positions, cos_sin, k_cache, v_cache, loc, expand=(poisoned, poisoned_b, meta), **kw)
    q_ref = rope_kv_write_ref(qkv, positions, cos_sin, k_ref, v_ref, loc, expand=(v, B, meta), **kw)
    assert_close(q, q_ref, dtype, "q", roundings=3)  # the delta's, the sum's, RoPE's
    assert_close(k_cache[loc], k_ref[loc], dtype, "k", roundings=3)
    assert_close(v_cache[loc], v_ref[loc], dtype, "v", roundings=2)
    if dtype == torch.float32:  # the delta path: the decode expand's delta, then rope_kv_write with it
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        delta = torch.zeros_like(qkv)
        sgmv_expand_ref(v, B, meta, delta, output_slices=((0, q_size), (q_size, kv_size), (q_size + kv_size, kv_size)))
        k_d, v_d = caches(num_kv_heads, head_dim, dtype, num_slots=80)
        assert_close(q, rope_kv_write(qkv, positions, cos_sin, k_d, v_d, loc, delta=delta, **kw), dtype, "delta path")
        assert_close(k_cache[loc], k_d[loc], dtype, "delta path k")
        assert_close(v_cache[loc], v_d[loc], dtype, "delta path v")
    k_plain, v_plain = caches(num_kv_heads, head_dim, dtype, num_slots=80)
    q_plain = rope_kv_write(qkv, positions, cos_sin, k_plain, v_plain, loc, **kw)
    adapted = adapted_rows(seg_lens, slots, ranks, rows, DEVICE)
    assert torch.equal(q[~adapted], q_plain[~adapted]) and torch.equal(v_cache[loc][~adapted], v_plain[loc][~adapted])
    assert not torch.allclose(q[adapted].float(), q_plain[adapted].float())
    assert not torch.allclose(v_cache[loc][adapted].float(), v_plain[loc][adapted].float())


def test_rope_kv_write_refuses_a_bad_expand():
    cos_sin, qkv, positions, loc = rope_case(torch.float32, 4, 2, 64, num_tokens=3)
    kw = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 64}
    meta = SgmvMeta.from_lists([3], [1], [0, 8], [0.0, 1.0], DEVICE)
    v, B = torch.zeros(3, 24, device=DEVICE), torch.zeros(2, qkv.shape[1], 8, device=DEVICE)
    k_cache, v_cache = caches(2, 64, torch.float32)
    with pytest.raises(ValueError, match="not both"):
        rope_kv_write(qkv, positions, cos_sin, k_cache, v_cache, loc, delta=qkv, expand=(v, B, meta), **kw)
    with pytest.raises(ValueError, match="B "):
        rope_kv_write(qkv, positions, cos_sin, k_cache, v_cache, loc, expand=(v, B[:, :-1], meta), **kw)
    with pytest.raises(ValueError, match="v "):
        rope_kv_write(qkv, positions, cos_sin, k_cache, v_cache, loc, expand=(v[:, :16], B, meta), **kw)
    with pytest.raises(ValueError, match="slots"):
        rope_kv_write(qkv, positions, cos_sin, k_cache, v_cache, loc, expand=(v, B[:1], meta), **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_kv_write_ref_is_the_model_rope_and_cache_write(dtype):
    """The reference (the CPU path) rounds as engine/rope.py's apply_rope and the cache write do."""
    cos_sin, qkv, positions, loc = rope_case(dtype, 8, 2, 64)
    k_cache, v_cache = caches(2, 64, dtype)
    q = rope_kv_write_ref(
        qkv, positions, cos_sin, k_cache, v_cache, loc, num_heads=8, num_kv_heads=2, head_dim=64
    )
    q0, k0, v0 = qkv.split([8 * 64, 2 * 64, 2 * 64], dim=-1)
    q_model, k_model = apply_rope(q0.view(-1, 8, 64), k0.view(-1, 2, 64), positions, cos_sin)
    assert torch.equal(q, q_model)
    assert torch.equal(k_cache[loc], k_model) and torch.equal(v_cache[loc], v0.view(-1, 2, 64))


def test_rope_kv_write_refuses_mismatched_shapes():
    cos_sin, qkv, positions, loc = rope_case(torch.float32, 4, 2, 16)
    k_cache, v_cache = caches(2, 16, torch.float32)
    with pytest.raises(ValueError, match="qkv"):
        rope_kv_write(
            qkv, positions, cos_sin, k_cache, v_cache, loc, num_heads=4, num_kv_heads=1, head_dim=16
        )
    with pytest.raises(ValueError, match="k_cache"):
        rope_kv_write(
            qkv, positions, cos_sin, k_cache[:, :1], v_cache, loc, num_heads=4, num_kv_heads=2, head_dim=16
        )
