"""The split-K decode shrink, the decode expand and the delta on decode-shaped batches (one token per
request, in segments of one request or merged per adapter as a decode step and its CUDA graph build
them, with a graph's empty trailing segments) against fp64 loops, over adapter popularity, batch sizes,
ranks below the slot capacity, stacked targets and program counts; and the auto dispatch between them
and `sgmv_shrink` / `sgmv_expand`.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is
imported). The general-segment grid (long, empty, base-model segments) is in test_sgmv.py's "decode"
backend.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import functools  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton")

from engine.lora_inputs import lora_segments  # noqa: E402
from lorakernels import sgmv_decode  # noqa: E402
from lorakernels.sgmv import sgmv_expand  # noqa: E402
from lorakernels.sgmv_decode import (  # noqa: E402
    decode_config,
    sgmv_delta_auto,
    sgmv_expand_auto,
    sgmv_expand_decode,
    sgmv_lora_delta_auto,
    sgmv_lora_delta_decode,
    sgmv_shrink_auto,
    sgmv_shrink_decode,
)
from lorakernels.sgmv_ref import SgmvMeta  # noqa: E402
from lorakernels.tuned import ExpandTile  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
MAX_RANK = 64
POPULARITY = ("distinct", "uniform", "zipf", "identical", "skewed")
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4e-2}  # of max(1, |ref|)


def decode_batch(popularity: str, batch: int, num_adapters: int, seed: int):
    """One segment of one token per request; slot 0 is the base model, and some requests use it."""
    rng = np.random.default_rng(seed)
    ranks = [0] + [(4, 16, 64, 8)[i % 4] for i in range(num_adapters)]  # mostly below the capacity 64
    lora = np.arange(1, num_adapters + 1)
    if popularity == "distinct":
        slots = [int(lora[i % num_adapters]) for i in range(batch)]
    elif popularity == "uniform":
        slots = [int(w) for w in rng.choice(lora, batch)]
    elif popularity == "zipf":
        weights = 1.0 / np.arange(1, num_adapters + 1)
        slots = [int(w) for w in rng.choice(lora, batch, p=weights / weights.sum())]
    elif popularity == "identical":
        slots = [1] * batch
    else:  # skewed: nearly all on one adapter, a few on others, some base-model rows
        slots = [1 if i % 5 else int(lora[-1]) for i in range(batch)]
    slots = [0 if i % 7 == 3 else w for i, w in enumerate(slots)]
    return [1] * batch, slots, ranks


def fp64_shrink(x, A, seg_lens, slots, ranks, num_stack):
    """{(row, col): value} of every entry the shrink must write, in fp64."""
    x, A = x.double().cpu(), A.double().cpu()
    expected, start = {}, 0
    for seg_len, w in zip(seg_lens, slots, strict=True):
        for row in range(start, start + seg_len):
            for k in range(num_stack):
                cols = range(k * MAX_RANK, k * MAX_RANK + ranks[w])
                values = A[w, cols.start : cols.stop] @ x[row]
                expected.update({(row, c): values[i].item() for i, c in enumerate(cols)})
        start += seg_len
    return expected


def check_shrink(shrink, dtype, in_dim, num_stack, seg_lens, slots, ranks, seed=0):
    gen = torch.Generator().manual_seed(seed)
    A = (torch.randn(len(ranks), num_stack * MAX_RANK, in_dim, generator=gen) / in_dim**0.5).to(DEVICE, dtype)
    x = torch.randn(sum(seg_lens), in_dim, generator=gen).to(DEVICE, dtype)
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, [1.0] * len(ranks), DEVICE)
    v = torch.full((x.shape[0], num_stack * MAX_RANK), float("nan"), dtype=dtype, device=DEVICE)
    assert shrink(x, A, meta, num_stack=num_stack, out=v) is v
    expected = fp64_shrink(x, A, seg_lens, slots, ranks, num_stack)
    written = torch.zeros(v.shape, dtype=torch.bool)
    for row, col in expected:
        written[row, col] = True
    v = v.double().cpu()
    assert torch.isnan(v[~written]).all(), "entries outside the LoRA rows and ranks were written"
    want = torch.tensor([expected[rc] for rc in sorted(expected)], dtype=torch.float64)
    got = torch.stack([v[r, c] for r, c in sorted(expected)]) if expected else want
    assert (got - want).abs().max().item() <= TOLERANCE[dtype] * max(1.0, want.abs().max().item())
    return len(expected)


def merged(seg_lens, slots, max_len=0):
    """The segments a decode step builds after the scheduler sorted its rows by slot (`lora_segments`)."""
    order = sorted(range(len(slots)), key=lambda i: slots[i])
    return lora_segments([seg_lens[i] for i in order], [slots[i] for i in order], max_len)


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("dtype", sorted(TOLERANCE, key=str), ids=str)
@pytest.mark.parametrize("num_stack, in_dim", [(3, 200), (1, 700)])
@pytest.mark.parametrize("grouped", [False, True], ids=["row_segments", "merged_runs"])
def test_decode_batches_match_fp64(popularity, dtype, num_stack, in_dim, grouped):
    seg_lens, slots, ranks = decode_batch(popularity, batch=24, num_adapters=6, seed=len(popularity))
    if grouped:
        seg_lens, slots = merged(seg_lens, slots)
    # 48 programs: each segment gets 2+ splits of in_dim, so the split sums run
    shrink = functools.partial(sgmv_shrink_decode, num_programs=48)
    assert check_shrink(shrink, dtype, in_dim, num_stack, seg_lens, slots, ranks) > 0


@pytest.mark.parametrize("num_programs", [1, 5, 0])
@pytest.mark.parametrize("batch", [1, 2, 9, 33, 64])
def test_batch_sizes(batch, num_programs):
    """One program for everything, fewer programs than segments, the device's count; one segment
    alone; a graph-sized batch; runs merged up to the decode limit and over a 16-row tile."""
    seg_lens, slots, ranks = decode_batch("uniform", batch, num_adapters=min(batch, 3), seed=batch)
    shrink = functools.partial(sgmv_shrink_decode, num_programs=num_programs)
    check_shrink(shrink, torch.bfloat16, 300, 3, *merged(seg_lens, slots), ranks, seed=batch)


def test_splits_follow_the_live_segments():
    """The workspace holds every split in_dim allows; a 40-row segment beside short ones and a graph's
    trailing empty segments (stale slots) over 6 programs; a 40-row segment alone over the device's
    programs (many splits). Results only: how the splits fall is not observable from outside."""
    device = torch.device(DEVICE)
    config = decode_config(4096, 3, device)
    assert config["max_splits"] == min(config["num_programs"], 32)
    seg_lens, slots, ranks = [40, 1, 3, 0, 0, 0], [1, 2, 3, 2, 1, 1], [0, 16, 64, 1]
    check_shrink(
        functools.partial(sgmv_shrink_decode, num_programs=6), torch.float32, 520, 2, seg_lens, slots, ranks
    )
    check_shrink(sgmv_shrink_decode, torch.float32, 520, 2, [40], [2], ranks)


def test_padding_rows_of_a_graph_and_multi_token_segments():
    """Trailing base-slot rows (graph padding) stay untouched; segments of 2-4 tokens still sum right."""
    seg_lens, slots, ranks = [1, 3, 2, 4, 1, 1, 1], [1, 2, 1, 3, 0, 0, 0], [0, 16, 64, 1]
    check_shrink(sgmv_shrink_decode, torch.float32, 520, 2, seg_lens, slots, ranks)


def test_auto_sends_decode_steps_to_the_split_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(sgmv_decode, "sgmv_shrink_decode", lambda *a, **k: calls.append("decode"))
    monkeypatch.setattr(sgmv_decode, "sgmv_shrink", lambda *a, **k: calls.append("sgmv"))
    A = torch.zeros(2, 4, 8)
    for seg_lens in ([1] * 70, [64, 6], [65, 5], [1] * 512, [1] * 513):  # 513 tokens: prefill-sized
        meta = SgmvMeta.from_lists(seg_lens, [1] * len(seg_lens), [0, 4], [0.0, 1.0])
        sgmv_shrink_auto(torch.zeros(sum(seg_lens), 8), A, meta, num_stack=1)
    assert calls == ["decode", "decode", "sgmv", "decode", "sgmv"]


def test_decode_shrink_with_expand_is_the_lora_delta():
    """The pair the engine's backend runs: decode shrink then the usual expand, against fp64."""
    seg_lens, slots, ranks = decode_batch("zipf", 16, 4, seed=5)
    gen = torch.Generator().manual_seed(5)
    in_dim, out_dim = 160, 96
    A = torch.randn(len(ranks), MAX_RANK, in_dim, generator=gen).to(DEVICE)
    B = torch.randn(len(ranks), out_dim, MAX_RANK, generator=gen).to(DEVICE)
    x, y = (
        torch.randn(16, in_dim, generator=gen).to(DEVICE),
        torch.randn(16, out_dim, generator=gen).to(DEVICE),
    )
    scalings = [0.0] + [0.5 * (i + 1) for i in range(len(ranks) - 1)]
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)
    y_before = y.double().cpu()
    expected = y_before.clone()
    for row, w in enumerate(slots):
        r = ranks[w]
        expected[row] += scalings[w] * (
            B[w, :, :r].double().cpu() @ (A[w, :r].double().cpu() @ x[row].double().cpu())
        )
    v = sgmv_shrink_auto(x, A, meta, num_stack=1)
    y2 = y.clone()
    sgmv_expand(v, B, meta, y, output_slices=((0, out_dim),))
    sgmv_expand_auto(v, B, meta, y2, output_slices=((0, out_dim),))  # the splitk backend's pair
    for got in (y, y2):
        assert (got.double().cpu() - expected).abs().max().item() <= 1e-3 * expected.abs().max().item()
    assert (expected - y_before).abs().max().item() > 0.1  # a no-op shrink would fail above


def fp64_expand(y, v, B, seg_lens, slots, ranks, scalings, output_slices):
    """y after the LoRA expand, in fp64: y[row, o_k + n] += scaling * v[row, k*R : k*R + r] . B[w, o_k + n, :r]."""
    expected, v, B = y.double().cpu().clone(), v.double().cpu(), B.double().cpu()
    start = 0
    for seg_len, w in zip(seg_lens, slots, strict=True):
        r = ranks[w]
        for row in range(start, start + seg_len):
            for k, (offset, size) in enumerate(output_slices):
                if r:
                    delta = B[w, offset : offset + size, :r] @ v[row, k * MAX_RANK : k * MAX_RANK + r]
                    expected[row, offset : offset + size] += scalings[w] * delta
        start += seg_len
    return expected


def check_expand(expand, dtype, seg_lens, slots, ranks, output_slices, out_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_stack, total = len(output_slices), sum(seg_lens)
    B = (torch.randn(len(ranks), out_dim, MAX_RANK, generator=gen) / 4).to(DEVICE, dtype)
    v = torch.randn(total, num_stack * MAX_RANK, generator=gen).to(DEVICE, dtype)
    y = torch.randn(total, out_dim, generator=gen).to(DEVICE, dtype)
    scalings = [0.0] + [0.25 * (i + 1) for i in range(len(ranks) - 1)]
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)
    expected = fp64_expand(y, v, B, seg_lens, slots, ranks, scalings, output_slices)
    before = y.double().cpu().clone()
    expand(v, B, meta, y, output_slices=output_slices)
    got = y.double().cpu()
    covered = torch.zeros(out_dim, dtype=torch.bool)
    for offset, size in output_slices:
        covered[offset : offset + size] = True
    assert torch.equal(got[:, ~covered], before[:, ~covered]), "columns outside the output slices were written"
    base_rows = [row for row, w in enumerate(w for n, w in zip(seg_lens, slots, strict=True) for _ in range(n)) if ranks[w] == 0]
    assert torch.equal(got[base_rows], before[base_rows]), "rows without a LoRA were written"
    tolerance = TOLERANCE[dtype] * max(1.0, expected.abs().max().item())
    assert (got - expected).abs().max().item() <= tolerance
    assert (expected - before).abs().max().item() > tolerance  # a no-op expand would fail the check above
    return meta


# (output_slices, out_dim): q/k/v (stacked, unequal widths), gate/up, one target, a gap left untouched
SLICES = [(((0, 96), (96, 32), (128, 32)), 160), (((0, 300), (300, 300)), 600), (((0, 520),), 520), (((8, 40),), 64)]


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("dtype", sorted(TOLERANCE, key=str), ids=str)
@pytest.mark.parametrize("output_slices, out_dim", SLICES)
def test_decode_expand_matches_fp64(popularity, dtype, output_slices, out_dim):
    seg_lens, slots, ranks = decode_batch(popularity, batch=20, num_adapters=6, seed=len(popularity) + out_dim)
    check_expand(sgmv_expand_decode, dtype, seg_lens, slots, ranks, output_slices, out_dim, seed=out_dim)


@pytest.mark.parametrize("batch", [1, 2, 33, 64])
@pytest.mark.parametrize("block_n", [16, 128])
def test_decode_expand_batch_sizes_and_column_blocks(batch, block_n):
    """Column blocks that do and do not divide the widths; one segment alone; a graph-sized batch."""
    seg_lens, slots, ranks = decode_batch("uniform", batch, num_adapters=min(batch, 8), seed=batch)
    expand = functools.partial(sgmv_expand_decode, tile=ExpandTile(block_n, 4))
    check_expand(expand, torch.bfloat16, seg_lens, slots, ranks, ((0, 200), (200, 72), (272, 72)), 344, seed=batch)


def test_decode_expand_multi_token_segments_and_graph_padding():
    """Segments of 2-4 tokens reuse their B tile for every row; trailing base-slot rows stay untouched."""
    seg_lens, slots, ranks = [1, 3, 2, 4, 1, 1, 1], [1, 2, 1, 3, 0, 0, 0], [0, 16, 64, 1]
    check_expand(sgmv_expand_decode, torch.float32, seg_lens, slots, ranks, ((0, 70), (70, 70)), 140)


@pytest.mark.parametrize("popularity", POPULARITY)
def test_decode_expand_merged_runs(popularity):
    """Each adapter's rows in one segment (up to 64 rows: several 16-row tiles), trailing empty segments."""
    seg_lens, slots, ranks = decode_batch(popularity, batch=40, num_adapters=5, seed=3)
    seg_lens, slots = merged(seg_lens, slots)
    seg_lens, slots = [*seg_lens, 0, 0], [*slots, 2, 1]  # a graph's padding segments: empty, stale slots
    check_expand(
        sgmv_expand_decode, torch.bfloat16, seg_lens, slots, ranks, ((0, 96), (96, 32), (128, 32)), 160
    )


@pytest.mark.parametrize("dtype", sorted(TOLERANCE, key=str), ids=str)
def test_delta_writes_every_entry_once(dtype):
    """sgmv_delta_auto over a decode step: the decode expand overwrites an uninitialised tensor (base rows
    get zeros) and equals zeros plus the adding expand; with a gap in the slices it falls back to zeros."""
    seg_lens, slots, ranks = decode_batch("zipf", 30, 4, seed=11)
    seg_lens, slots = merged(seg_lens, slots)
    gen = torch.Generator().manual_seed(2)
    B = (torch.randn(len(ranks), 200, MAX_RANK, generator=gen) / 4).to(DEVICE, dtype)
    v = torch.randn(30, 2 * MAX_RANK, generator=gen).to(DEVICE, dtype)
    scalings = [0.0] + [0.5] * (len(ranks) - 1)
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)
    rows = [i for i, w in enumerate(w for n, w in zip(seg_lens, slots, strict=True) for _ in range(n)) if ranks[w] == 0]
    assert rows
    for output_slices in (((0, 120), (120, 80)), ((0, 100), (120, 80))):
        with torch.device(DEVICE):
            torch.full((30, 200), float("nan"), dtype=dtype)  # leave NaN in the allocator's free memory
        delta = sgmv_delta_auto(v, B, meta, output_slices=output_slices)
        want = torch.zeros(30, 200, dtype=dtype, device=DEVICE)
        sgmv_expand_auto(v, B, meta, want, output_slices=output_slices)
        assert torch.equal(delta, want)
        assert not delta[rows].any() and delta.abs().sum() > 0  # base rows: zeros written, not left
    y = torch.full((30, 200), float("nan"), dtype=dtype, device=DEVICE)
    sgmv_expand_decode(v, B, meta, y, output_slices=((0, 120), (120, 80)), overwrite=True)
    want = torch.zeros(30, 200, dtype=dtype, device=DEVICE)
    sgmv_expand_auto(v, B, meta, want, output_slices=((0, 120), (120, 80)))
    assert torch.equal(y, want)  # every entry written: no NaN left, base rows 0


def test_expand_auto_sends_decode_steps_to_the_decode_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(sgmv_decode, "sgmv_expand_decode", lambda *a, **k: calls.append("decode"))
    monkeypatch.setattr(sgmv_decode, "sgmv_expand", lambda *a, **k: calls.append("sgmv"))
    B = torch.zeros(2, 8, 4)
    for seg_lens in ([1] * 70, [64, 6], [65, 5], [1] * 512, [1] * 513):
        meta = SgmvMeta.from_lists(seg_lens, [1] * len(seg_lens), [0, 4], [0.0, 1.0])
        rows = sum(seg_lens)
        sgmv_expand_auto(torch.zeros(rows, 4), B, meta, torch.zeros(rows, 8), output_slices=((0, 8),))
    assert calls == ["decode", "decode", "sgmv", "decode", "sgmv"]


def test_decode_expand_refuses_what_sgmv_expand_refuses():
    meta = SgmvMeta.from_lists([1], [1], [0, 4], [0.0, 1.0], DEVICE)
    v, B, y = torch.zeros(1, 4, device=DEVICE), torch.zeros(2, 8, 4, device=DEVICE), torch.zeros(1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="fall outside out_dim"):
        sgmv_expand_decode(v, B, meta, y, output_slices=((4, 8),))
    with pytest.raises(ValueError, match="targets x R=4"):
        sgmv_expand_decode(v, B, meta, y, output_slices=((0, 4), (4, 4)))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a CUDA device")
def test_decode_expand_graph_replay_follows_refilled_slots_and_ranks():
    """Captured once, replayed after the metadata was refilled in place with other slots, ranks and scalings."""
    batch, out_dim, num_slots = 12, 900, 5
    output_slices = ((0, 500), (500, 200), (700, 200))
    gen = torch.Generator().manual_seed(9)
    B = (torch.randn(num_slots, out_dim, MAX_RANK, generator=gen) / 4).to(DEVICE, torch.bfloat16)
    v = torch.randn(batch, 3 * MAX_RANK, generator=gen).to(DEVICE, torch.bfloat16)
    y = torch.zeros(batch, out_dim, device=DEVICE, dtype=torch.bfloat16)
    meta = SgmvMeta.from_lists([1] * batch, [0] * batch, [0, 16, 64, 4, 0], [1.0] * num_slots, DEVICE)
    sgmv_expand_decode(v, B, meta, y, output_slices=output_slices)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sgmv_expand_decode(v, B, meta, y, output_slices=output_slices)
    for slots, ranks, scalings in (
        ([1, 2, 3, 0] * 3, [0, 16, 64, 4, 0], [0.0, 1.0, 0.5, 2.0, 1.0]),
        ([4] * 12, [0, 8, 8, 8, 32], [0.0, 1.0, 1.0, 1.0, 0.25]),
    ):
        meta.weight_indices.copy_(torch.tensor(slots, dtype=torch.int32))
        meta.lora_ranks.copy_(torch.tensor(ranks, dtype=torch.int32))
        meta.scalings.copy_(torch.tensor(scalings))
        y.zero_()
        graph.replay()
        expected = fp64_expand(torch.zeros(batch, out_dim), v, B, [1] * batch, slots, ranks, scalings, output_slices)
        assert (y.double().cpu() - expected).abs().max().item() <= 4e-2 * max(1.0, expected.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a CUDA device")
def test_cuda_graph_replay_follows_refilled_slots_and_ranks():
    """Captured once (the engine's decode graphs), replayed after the metadata tensors were refilled
    in place with other slots and ranks: the rank-bounded loops and the split workspace follow."""
    batch, in_dim, num_slots = 12, 1000, 5
    gen = torch.Generator().manual_seed(7)
    A = (torch.randn(num_slots, 2 * MAX_RANK, in_dim, generator=gen) / in_dim**0.5).to(DEVICE, torch.bfloat16)
    x = torch.randn(batch, in_dim, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.zeros(batch, 2 * MAX_RANK, device=DEVICE, dtype=torch.bfloat16)
    meta = SgmvMeta.from_lists([1] * batch, [0] * batch, [0, 16, 64, 4, 0], [1.0] * num_slots, DEVICE)
    sgmv_shrink_decode(x, A, meta, num_stack=2, out=v)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sgmv_shrink_decode(x, A, meta, num_stack=2, out=v)
    for slots, ranks in (
        ([1, 2, 3, 0] * 3, [0, 16, 64, 4, 0]),
        ([4] * 12, [0, 8, 8, 8, 32]),
        ([2] * 12, [0, 1, 64, 1, 1]),
    ):
        meta.weight_indices.copy_(torch.tensor(slots, dtype=torch.int32))
        meta.lora_ranks.copy_(torch.tensor(ranks, dtype=torch.int32))
        v.zero_()
        graph.replay()
        expected = fp64_shrink(x, A, [1] * batch, slots, ranks, 2)
        got = v.double().cpu()
        for (row, col), value in expected.items():
            assert abs(got[row, col].item() - value) <= 4e-2 * max(1.0, abs(value)), (row, col)
        written = torch.zeros(got.shape, dtype=torch.bool)
        for row, col in expected:
            written[row, col] = True
        assert (got[~written] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("fused", [False, True], ids=["shrink-delta", "fused-delta"])
def test_cuda_graph_replay_follows_regrouped_segments(fused):
    """The engine's decode graph: captured with one segment per row, replayed after SgmvMetaBuffers was
    refilled with each adapter's rows merged (fewer, longer segments, empty ones trailing) or one row
    each; shrink and overwriting delta both follow, or the fused delta (its split counts per live
    segment found on the device at each replay) (bf16, q/k/v-shaped, against fp64)."""
    from engine.lora_inputs import SgmvMetaBuffers

    batch, in_dim, output_slices = 48, 512, ((0, 256), (256, 64), (320, 64))
    ranks, scalings = [0, 16, 8, 64, 4], [0.0, 1.0, 0.5, 0.25, 2.0]
    gen = torch.Generator().manual_seed(13)
    A = (torch.randn(len(ranks), 3 * MAX_RANK, in_dim, generator=gen) / in_dim**0.5).to(DEVICE, torch.bfloat16)
    B = (torch.randn(len(ranks), 384, MAX_RANK, generator=gen) / 4).to(DEVICE, torch.bfloat16)
    x = torch.randn(batch, in_dim, generator=gen).to(DEVICE, torch.bfloat16)
    buffers = SgmvMetaBuffers(batch, len(ranks), DEVICE)
    meta = dataclasses.replace(buffers.fill([1] * batch, [0] * batch, ranks, scalings), max_seg_len=16)
    out = {}

    def step():
        if fused:
            out["delta"] = sgmv_lora_delta_decode(x, A, B, meta, num_stack=3, output_slices=output_slices)
            return
        v = sgmv_shrink_decode(x, A, meta, num_stack=3)
        out["delta"] = sgmv_delta_auto(v, B, meta, output_slices=output_slices)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for slots in ([1] * batch, [1] * 20 + [2] * 3 + [0] * 5 + [3] * 20, [(i % 4) for i in range(batch)], [4] * 47 + [0]):
        seg_lens, seg_slots = lora_segments([1] * batch, slots, 16)
        buffers.fill(seg_lens, seg_slots, ranks, scalings)
        graph.replay()
        expected = torch.zeros(batch, 384, dtype=torch.float64)
        for row, w in enumerate(slots):
            r = ranks[w]
            for k, (offset, size) in enumerate(output_slices):
                v = A[w, k * MAX_RANK : k * MAX_RANK + r].double().cpu() @ x[row].double().cpu()
                expected[row, offset : offset + size] = scalings[w] * (B[w, offset : offset + size, :r].double().cpu() @ v)
        got = out["delta"].double().cpu()
        assert (got - expected).abs().max().item() <= 4e-2 * max(1.0, expected.abs().max().item()), slots[:24]
        assert expected.abs().max().item() > 0.5


# ---- the fused delta: split partials summed in the expand ------------------------------------------


def fused_case(popularity, dtype, output_slices, out_dim, batch=24, in_dim=1100, seed=0, padding=0):
    """A decode step's x, A, B and merged segments (padding: a graph's trailing empty segments)."""
    seg_lens, slots, ranks = decode_batch(popularity, batch, num_adapters=6, seed=seed)
    seg_lens, slots = merged(seg_lens, slots)
    seg_lens, slots = [*seg_lens, *[0] * padding], [*slots, *[1] * padding]
    gen = torch.Generator().manual_seed(seed)
    num_stack = len(output_slices)
    A = (torch.randn(len(ranks), num_stack * MAX_RANK, in_dim, generator=gen) / in_dim**0.5).to(DEVICE, dtype)
    B = (torch.randn(len(ranks), out_dim, MAX_RANK, generator=gen) / 4).to(DEVICE, dtype)
    x = torch.randn(batch, in_dim, generator=gen).to(DEVICE, dtype)
    scalings = [0.0] + [0.25 * (i + 1) for i in range(len(ranks) - 1)]
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)
    return x, A, B, meta, (seg_lens, slots, ranks, scalings)


def fp64_delta(x, A, B, seg_lens, slots, ranks, scalings, output_slices):
    v = torch.zeros(x.shape[0], len(output_slices) * MAX_RANK, dtype=torch.float64)
    for (row, col), value in fp64_shrink(x, A, seg_lens, slots, ranks, len(output_slices)).items():
        v[row, col] = value
    zeros = torch.zeros(x.shape[0], B.shape[1], dtype=torch.float64)
    return fp64_expand(zeros, v, B, seg_lens, slots, ranks, scalings, output_slices)


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("dtype", sorted(TOLERANCE, key=str), ids=str)
@pytest.mark.parametrize("num_programs", [48, 0])
def test_fused_delta_matches_fp64_and_the_shrink_then_delta(popularity, dtype, num_programs):
    """48 programs over 1100 columns: few segments (identical, skewed) get 9 splits, more than a load's
    SPLIT_CHUNK of 8, so the expand sums in several chunks; 0: the device's count. The slices turn with
    the popularity: q/k/v (stacked, unequal widths), gate/up, one target."""
    output_slices, out_dim = SLICES[POPULARITY.index(popularity) % 3]
    x, A, B, meta, lists = fused_case(popularity, dtype, output_slices, out_dim, seed=len(popularity) + out_dim)
    num_stack = len(output_slices)
    with torch.device(DEVICE):
        torch.full((24, out_dim), float("nan"), dtype=dtype)  # leave NaN in the allocator's free memory
    got = sgmv_lora_delta_decode(x, A, B, meta, num_stack=num_stack, output_slices=output_slices, num_programs=num_programs)
    expected = fp64_delta(x, A, B, *lists, output_slices)
    tolerance = TOLERANCE[dtype] * max(1.0, expected.abs().max().item())
    assert (got.double().cpu() - expected).abs().max().item() <= tolerance
    assert expected.abs().max().item() > 10 * tolerance  # a zero delta would fail above
    base_rows = [i for i, w in enumerate(w for n, w in zip(lists[0], lists[1], strict=True) for _ in range(n)) if lists[2][w] == 0]
    assert not got[base_rows].any()  # written as zeros, not left as found
    v = sgmv_shrink_decode(x, A, meta, num_stack=num_stack, num_programs=num_programs)
    unfused = sgmv_delta_auto(v, B, meta, output_slices=output_slices)
    # the same rounding of v and the same expand; only the fp32 split sums' order may differ
    assert torch.allclose(got.float(), unfused.float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)


def test_fused_delta_over_many_splits_a_graph_s_padding_and_a_16_row_tile():
    """One adapter's 40 rows (three 16-row tiles) beside a short run, trailing empty segments with stale
    slots, and 64 programs over 2100 columns: 17+ splits a segment, three SPLIT_CHUNK loads."""
    assert sgmv_decode.SPLIT_CHUNK < 17
    seg_lens, slots, ranks = [40, 3, 0, 0], [1, 2, 2, 1], [0, 16, 5]
    gen = torch.Generator().manual_seed(7)
    A = (torch.randn(3, 2 * MAX_RANK, 2100, generator=gen) / 2100**0.5).to(DEVICE)
    B = (torch.randn(3, 90, MAX_RANK, generator=gen) / 4).to(DEVICE)
    x = torch.randn(43, 2100, generator=gen).to(DEVICE)
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, [0.0, 1.5, 0.5], DEVICE)
    slices = ((0, 50), (50, 40))
    got = sgmv_lora_delta_decode(x, A, B, meta, num_stack=2, output_slices=slices, num_programs=64)
    expected = fp64_delta(x, A, B, seg_lens, slots, ranks, [0.0, 1.5, 0.5], slices)
    assert (got.double().cpu() - expected).abs().max().item() <= 1e-4 * max(1.0, expected.abs().max().item())


def test_fused_delta_refuses_what_it_cannot_cover():
    x, A, B, meta, _ = fused_case("uniform", torch.float32, ((0, 96), (96, 32), (128, 32)), 160, batch=8, in_dim=64)
    with pytest.raises(ValueError, match="cover every row"):  # a gap in the slices
        sgmv_lora_delta_decode(x, A, B, meta, num_stack=3, output_slices=((0, 96), (96, 32), (130, 30)))
    with pytest.raises(ValueError, match="cover every row"):  # more rows than the segments hold
        sgmv_lora_delta_decode(torch.cat([x, x]), A, B, meta, num_stack=3, output_slices=((0, 96), (96, 32), (128, 32)))
    with pytest.raises(ValueError, match="want 2 targets"):  # a slice short of the stacked targets
        sgmv_lora_delta_decode(x, A, B, meta, num_stack=3, output_slices=((0, 96), (96, 64)))
    with pytest.raises(ValueError, match="x is"):
        sgmv_lora_delta_decode(x.double(), A, B, meta, num_stack=3, output_slices=((0, 96), (96, 32), (128, 32)))


def test_fused_delta_auto_fuses_decode_steps_and_falls_back_elsewhere(monkeypatch):
    """Decode-sized steps whose segments and slices cover the delta take the fused kernel; a prefill-sized
    segment, rows past the segments or a gap between the slices take the shrink then the delta, whose
    uncovered entries are 0. Every case equals the fp64 delta."""
    fused = []
    real = sgmv_decode.sgmv_lora_delta_decode
    monkeypatch.setattr(sgmv_decode, "sgmv_lora_delta_decode", lambda *a, **k: fused.append(1) or real(*a, **k))
    slices, out_dim = ((0, 40), (40, 24)), 64
    x, A, B, meta, lists = fused_case("zipf", torch.float32, slices, out_dim, batch=20, in_dim=300, seed=3)
    got = sgmv_lora_delta_auto(x, A, B, meta, num_stack=2, output_slices=slices)
    expected = fp64_delta(x, A, B, *lists, slices)
    assert fused == [1] and (got.double().cpu() - expected).abs().max().item() <= 1e-4 * max(1.0, expected.abs().max().item())
    assert expected.abs().max().item() > 0.1
    ranks, scalings = lists[2], lists[3]
    gen = torch.Generator().manual_seed(4)
    cases = [  # (seg_lens, slots, rows, slices)
        ([70, 2], [1, 2], 72, slices),  # a prefill-sized segment
        ([3, 4], [1, 2], 9, slices),  # two rows no segment holds
        ([3, 4], [2, 1], 7, ((0, 30), (40, 24))),  # columns 30-39 in no slice
    ]
    for seg_lens, slots, rows, case_slices in cases:
        x = torch.randn(rows, 300, generator=gen).to(DEVICE)
        meta = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)
        got = sgmv_lora_delta_auto(x, A, B, meta, num_stack=2, output_slices=case_slices)
        expected = fp64_delta(x[: sum(seg_lens)], A, B, seg_lens, slots, ranks, scalings, case_slices)
        expected = torch.cat([expected, torch.zeros(rows - sum(seg_lens), out_dim, dtype=torch.float64)])
        assert got.shape == (rows, out_dim)
        assert (got.double().cpu() - expected).abs().max().item() <= 1e-4 * max(1.0, expected.abs().max().item()), seg_lens
        assert expected.abs().max().item() > 0.1
    assert fused == [1]
