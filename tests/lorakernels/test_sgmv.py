"""SGMV shrink/expand: Triton kernels, chunked backend and PyTorch reference against an fp64 loop.

Without CUDA the Triton kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set here before
triton is imported); with CUDA they run natively and nothing is skipped. Every case checks
y + sum_k s * x @ A_k^T @ B_k^T per segment, computed independently in fp64, over a grid of dtypes,
dims, mixed ranks (1..128, max_rank 128), base-model (rank-0) and empty segments, fused stacks, and
adapter popularity (distinct, uniform, zipf, identical, skewed).
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import functools  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lorakernels.sgmv import _tile_ids, sgmv_expand, sgmv_shrink  # noqa: E402
from lorakernels.sgmv_chunked import sgmv_expand_chunked, sgmv_shrink_chunked  # noqa: E402
from lorakernels.sgmv_decode import sgmv_shrink_decode  # noqa: E402
from lorakernels.sgmv_ref import SgmvMeta, chunk_segments, sgmv_expand_ref, sgmv_shrink_ref  # noqa: E402
from lorakernels.tuned import SgmvTile  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def seeded_torch():
    """Every test draws the same inputs on every run: a tolerance failure must be reproducible."""
    torch.manual_seed(0)
MAX_RANK = 128
RANK_CYCLE = (1, 4, 16, 64, 128)
POPULARITY = ("distinct", "uniform", "zipf", "identical", "skewed")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}  # of max(1, |ref|)
# name -> (in_dim, output_slices, out_dim): unequal q/k/v slices, gate/up, one odd-sized target.
TARGETS = {
    "qkv": (64, ((0, 64), (64, 32), (96, 32)), 128),
    "gate_up": (48, ((0, 176), (176, 176)), 352),
    "single": (176, ((0, 1000),), 1000),
}
BACKENDS = {
    "triton": (sgmv_shrink, sgmv_expand),
    "chunked": (
        functools.partial(sgmv_shrink_chunked, chunk_size=4),
        functools.partial(sgmv_expand_chunked, chunk_size=4),
    ),
    "decode": (sgmv_shrink_decode, sgmv_expand),  # the split-K decode shrink, on any segments
    # the prefill shrink split 3 ways over in_dim's 16-wide K tiles (64: 2 + 2 + none, 48: 1 each, 176:
    # 4 + 4 + 3), its partials summed by the second kernel
    "split": (functools.partial(sgmv_shrink, tile=SgmvTile(16, 64, 16, 4, 2, split_k=3)), sgmv_expand),
    "ref": (sgmv_shrink_ref, sgmv_expand_ref),
}
interpreter_slow = pytest.mark.skipif(
    not HAS_CUDA and not os.environ.get("LORAMUX_SLOW_KERNEL_TESTS"),
    reason="too slow for the Triton interpreter; runs on CUDA or with LORAMUX_SLOW_KERNEL_TESTS=1",
)


# -- batches ---------------------------------------------------------------------------------------


def make_batch(popularity: str, num_reqs: int, num_tokens: int, seed: int):
    """(seg_lens, slots, ranks, scalings): num_reqs LoRA requests plus one base-model segment, one empty
    segment and one segment on an empty (rank-0, non-base) slot. Slot 0 is the base model."""
    rng = np.random.default_rng(seed)
    num_lora_slots = num_reqs if popularity == "distinct" else max(2, num_reqs // 2)
    ranks = [0] + [RANK_CYCLE[i % len(RANK_CYCLE)] for i in range(num_lora_slots)] + [0]
    scalings = [0.0] + [float(rng.uniform(0.25, 2.0)) for _ in range(num_lora_slots)] + [3.0]
    lora = np.arange(1, num_lora_slots + 1)
    if popularity == "distinct":
        slots = list(lora)
    elif popularity == "uniform":
        slots = list(rng.choice(lora, num_reqs))
    elif popularity == "zipf":
        weights = 1.0 / np.arange(1, num_lora_slots + 1) ** 1.5
        slots = list(rng.choice(lora, num_reqs, p=weights / weights.sum()))
    elif popularity == "identical":
        slots = [1] * num_reqs
    else:  # skewed: one long request dominates, the rest are single decode tokens of other adapters
        slots = [int(lora[i % num_lora_slots]) for i in range(num_reqs)]
    num_extra = 3  # base, empty, empty-slot segments
    lora_tokens = max(num_tokens - 2, num_reqs)
    if popularity == "skewed":
        seg_lens = [lora_tokens - (num_reqs - 1)] + [1] * (num_reqs - 1)
    else:
        cuts = np.sort(rng.integers(0, lora_tokens + 1, num_reqs - 1))
        seg_lens = list(np.diff(np.concatenate([[0], cuts, [lora_tokens]])))
    seg_lens = [int(n) for n in seg_lens] + [1, 0, 1]
    slots = [int(w) for w in slots] + [0, 1, len(ranks) - 1]
    order = rng.permutation(num_reqs + num_extra)  # base/empty segments anywhere in the batch
    return [seg_lens[i] for i in order], [slots[i] for i in order], ranks, scalings


def make_weights(num_slots: int, in_dim: int, out_dim: int, num_stack: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(num_slots, num_stack * MAX_RANK, in_dim, generator=gen) / in_dim**0.5
    B = torch.randn(num_slots, out_dim, MAX_RANK, generator=gen) / 4.0
    return A.to(DEVICE, dtype), B.to(DEVICE, dtype)


def loop_reference(x, A, B, y, seg_lens, slots, ranks, scalings, output_slices) -> torch.Tensor:
    """y + per segment, per target k: scaling * x @ A_k^T @ B_k^T, in fp64 (independent of the ops)."""
    out = y.double().cpu().clone()
    x, A, B = x.double().cpu(), A.double().cpu(), B.double().cpu()
    start = 0
    for seg_len, w in zip(seg_lens, slots, strict=True):
        r, rows = ranks[w], slice(start, start + seg_len)
        start += seg_len
        for k, (offset, size) in enumerate(output_slices):
            a = A[w, k * MAX_RANK : k * MAX_RANK + r]  # [r, in_dim]
            b = B[w, offset : offset + size, :r]  # [size, r]
            out[rows, offset : offset + size] += scalings[w] * x[rows] @ a.T @ b.T
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype) -> None:
    err = (actual.double().cpu() - expected).abs().max().item() if expected.numel() else 0.0
    bound = TOLERANCE[dtype] * max(1.0, expected.abs().max().item() if expected.numel() else 0.0)
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


def run_case(backend, dtype, target, popularity, num_reqs, num_tokens, seed=0):
    in_dim, output_slices, out_dim = TARGETS[target]
    seg_lens, slots, ranks, scalings = make_batch(popularity, num_reqs, num_tokens, seed)
    num_tokens = sum(seg_lens)
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)
    A, B = make_weights(len(ranks), in_dim, out_dim, len(output_slices), dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(num_tokens, in_dim, generator=gen).to(DEVICE, dtype)
    y = torch.randn(num_tokens, out_dim, generator=gen).to(DEVICE, dtype)
    expected = loop_reference(x, A, B, y, seg_lens, slots, ranks, scalings, output_slices)
    y_before = y.double().cpu()
    shrink, expand = BACKENDS[backend]
    v = shrink(x, A, meta, num_stack=len(output_slices))
    expand(v, B, meta, y, output_slices=output_slices)
    assert_close(y, expected, dtype)
    return expected - y_before


# -- shrink + expand against the fp64 loop ----------------------------------------------------------


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_lora_delta_matches_fp64_loop(backend, dtype, target, popularity):
    delta = run_case(backend, dtype, target, popularity, num_reqs=6, num_tokens=40)
    assert delta.abs().max() > 0.1  # the LoRA delta is not negligible: a no-op kernel would fail


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 512])
@pytest.mark.parametrize("backend", ["triton", "chunked", "decode", "split"])
def test_token_counts(backend, num_tokens):
    num_reqs = min(num_tokens, 5)
    run_case(backend, torch.bfloat16, "qkv", "uniform", num_reqs, num_tokens, seed=num_tokens)


@pytest.mark.parametrize("segment_chunk", [64, 4])  # 4: the row-block lookup scans the segments in three passes
@pytest.mark.parametrize("split_k", [1, 2])
def test_one_launch_size_serves_any_segmentation(monkeypatch, segment_chunk, split_k):
    """A mixed-step CUDA graph launches with the host ints of its capture (max_seg_len = T rows,
    num_segments = its capacity) and replays other segmentations of the same rows: one long prefill and
    many decode rows, rows in no segment (padding), empty segments between and after live ones. The
    shrink whole or split in two over in_dim (the sum kernel follows the same row blocks)."""
    import lorakernels.sgmv as sgmv

    monkeypatch.setattr(sgmv, "SEGMENT_CHUNK", segment_chunk)
    in_dim, output_slices, out_dim = TARGETS["qkv"]
    ranks, scalings = [0, 16, 4, 64, 0], [0.0, 0.5, 2.0, 1.0, 3.0]
    A, B = make_weights(len(ranks), in_dim, out_dim, len(output_slices), torch.bfloat16, seed=3)
    num_rows, capacity = 150, 12
    layouts = [
        ([1, 1, 1, 1, 2, 100], [1, 1, 2, 0, 3, 2]),  # decode rows, then a prefill chunk; 46 padding rows
        ([70, 0, 1, 1, 0, 33, 45], [3, 1, 2, 1, 4, 1, 2]),  # empty segments between live ones
        ([150], [1]),  # one segment of every row
        ([1] * 12, [1, 2, 3, 0] * 3),  # as many segments as the capacity, rows 12.. in none
        ([65, 65] + [1] * 10, [1, 2] + [3, 1] * 5),  # 14 row blocks of 64: the launch's bound exactly
    ]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(num_rows, in_dim, generator=gen).to(DEVICE, torch.bfloat16)
    for seg_lens, slots in layouts:
        padded_lens = seg_lens + [0] * (capacity - len(seg_lens))
        padded_slots = slots + [0] * (capacity - len(slots))
        meta = SgmvMeta.from_lists(padded_lens, padded_slots, ranks, scalings, DEVICE)
        meta.max_seg_len = num_rows  # the capture's bound, not this layout's
        y = torch.randn(num_rows, out_dim, generator=gen).to(DEVICE, torch.bfloat16)
        expected = loop_reference(x, A, B, y, padded_lens, padded_slots, ranks, scalings, output_slices)
        tile = SgmvTile(64, 64, 32, 4, 2, split_k=split_k) if split_k > 1 else None  # None: the built-in tile
        v = sgmv_shrink(x, A, meta, num_stack=len(output_slices), tile=tile)
        sgmv_expand(v, B, meta, y, output_slices=output_slices)
        assert_close(y, expected, torch.bfloat16)


@pytest.mark.parametrize(
    "in_dim, out_dim, rank, num_tokens",
    [(4096, 16, 16, 33), (1000, 176, 64, 17), pytest.param(4096, 14336, 16, 64, marks=interpreter_slow)],
)
@pytest.mark.parametrize("backend", ["triton", "chunked", "split"])
def test_medium_dims(backend, in_dim, out_dim, rank, num_tokens):
    """in/out dims that are not multiples of any block, including a Llama-like 4096 -> 14336."""
    dtype = torch.bfloat16
    seg_lens, slots = [num_tokens // 3, 0, num_tokens - num_tokens // 3], [1, 2, 2]
    ranks, scalings = [0, rank, rank // 2], [0.0, 0.5, 2.0]
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)
    A, B = make_weights(3, in_dim, out_dim, 1, dtype, seed=1)
    x = torch.randn(num_tokens, in_dim).to(DEVICE, dtype)
    y = torch.randn(num_tokens, out_dim).to(DEVICE, dtype)
    expected = loop_reference(x, A, B, y, seg_lens, slots, ranks, scalings, ((0, out_dim),))
    shrink, expand = BACKENDS[backend]
    expand(shrink(x, A, meta, num_stack=1), B, meta, y, output_slices=((0, out_dim),))
    assert_close(y, expected, dtype)


def test_builtin_split_k_splits_only_steps_whose_row_blocks_leave_most_sms_idle():
    """A 2048-token step's o and down shrinks (32 row blocks of 64) split 4 ways on 132 SMs, as the H100
    tuner chose; q/k/v (3 programs a block) and gate/up (2) stay whole there; short steps, steps of
    enough row blocks (a long step of many short segments too), a device without SMs (the interpreter)
    and an in_dim of few K tiles stay whole."""
    from lorakernels.sgmv import builtin_split_k

    assert [builtin_split_k(2048, 32, 4096, 128, n, 132) for n in (1, 2, 3)] == [4, 1, 1]
    assert builtin_split_k(2048, 32, 14336, 128, 1, 132) == 4
    assert builtin_split_k(1024, 16, 4096, 128, 1, 132) == 8  # 16 blocks: at most 8 ways
    assert builtin_split_k(1024, 16, 4096, 128, 2, 132) == 4
    assert builtin_split_k(1024, 520, 4096, 128, 1, 132) == 1  # a prompt beside 512 decode rows
    assert builtin_split_k(4096, 64, 4096, 128, 1, 132) == 1  # 64 blocks: half the SMs busy already
    assert builtin_split_k(512, 8, 4096, 128, 1, 132) == 1  # short steps are mixed or decode-like
    assert builtin_split_k(2048, 32, 4096, 128, 1, 0) == 1
    assert builtin_split_k(2048, 32, 1024, 128, 1, 132) == 2  # 8 K tiles: each split takes at least 4


def test_the_builtin_shrink_splits_where_builtin_split_k_says(monkeypatch):
    """Without a tuned tile the shrink takes builtin_split_k's split (here on a pretend 132-SM device and
    a lowered length floor), sums the partials and gives the reference's y; a tuned tile keeps its own."""
    import lorakernels.sgmv as sgmv

    monkeypatch.setattr(sgmv, "device_sms", lambda device: 132)
    monkeypatch.setattr(sgmv, "BUILTIN_SPLIT_MIN_TOKENS", 64)
    launched, real = [], sgmv._launch
    monkeypatch.setattr(sgmv, "_launch", lambda *args, **kwargs: (kwargs["is_shrink"] and launched.append(kwargs.get("split_k", 1))) or real(*args, **kwargs))
    in_dim, out_dim, num_tokens = 4096, 96, 128
    seg_lens, slots, ranks, scalings = [40, 88], [1, 2], [0, 16, 8], [0.0, 0.5, 2.0]
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)
    A, B = make_weights(3, in_dim, out_dim, 1, torch.float32, seed=4)
    x = torch.randn(num_tokens, in_dim).to(DEVICE)
    y = torch.randn(num_tokens, out_dim).to(DEVICE)
    expected = loop_reference(x, A, B, y, seg_lens, slots, ranks, scalings, ((0, out_dim),))
    sgmv_expand(sgmv_shrink(x, A, meta, num_stack=1), B, meta, y, output_slices=((0, out_dim),))
    assert launched[0] == 8  # 1 + 2 row blocks x 2 column tiles (max rank 128) on 132 SMs; 32 K tiles
    assert_close(y, expected, torch.float32)
    many = SgmvMeta.from_lists([1] * 64 + [64], [1, 2] * 32 + [1], ranks, scalings, DEVICE)  # 65 blocks of this step
    sgmv_shrink(x, A, many, num_stack=1)
    assert launched[-1] == 1
    sgmv_shrink(x, A, meta, num_stack=1, tile=SgmvTile(64, 16, 128, 4, 3))
    assert launched[-1] == 1


# -- poison: what must be written is, what must not be is not ----------------------------------------


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_shrink_writes_exactly_the_lora_entries(backend):
    seg_lens, slots, ranks, scalings = [3, 0, 2, 5, 4], [1, 2, 0, 2, 3], [0, 4, 16, 0], [0, 1, 1, 1]
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)
    A, _ = make_weights(4, 40, 8, 3, torch.float32, seed=2)
    x = torch.randn(15, 40).to(DEVICE)  # row 14 belongs to no segment
    v = torch.full((15, 3 * MAX_RANK), float("nan"), device=DEVICE)
    out = BACKENDS[backend][0](x, A, meta, num_stack=3, out=v)
    assert out is v
    written = torch.zeros_like(v, dtype=torch.bool)
    expected = torch.zeros(v.shape, dtype=torch.float64)
    start = 0
    for seg_len, w in zip(seg_lens, slots, strict=True):
        rows = slice(start, start + seg_len)
        start += seg_len
        for k in range(3):
            cols = slice(k * MAX_RANK, k * MAX_RANK + ranks[w])
            written[rows, cols] = True
            expected[rows, cols] = x[rows].double().cpu() @ A[w, cols].double().cpu().T
    assert written.any() and torch.isnan(v[~written]).all()
    assert_close(v[written], expected[written.cpu()], torch.float32)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_expand_ignores_unwritten_v_and_keeps_other_outputs(backend):
    seg_lens, slots, ranks, scalings = [2, 3, 0, 4, 1], [1, 0, 2, 2, 3], [0, 4, 16, 0], [0, 0.5, 2, 7]
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)
    output_slices = ((0, 20), (40, 8))  # columns 20..39 and 48..63 belong to no target
    _, B = make_weights(4, 8, 64, 2, torch.float16, seed=3)
    v = torch.full((11, 2 * MAX_RANK), float("nan"), dtype=torch.float16, device=DEVICE)
    lora_rows = {1: slice(0, 2), 2: slice(5, 9)}
    for w, rows in lora_rows.items():
        for k in range(2):
            v[rows, k * MAX_RANK : k * MAX_RANK + ranks[w]] = torch.randn(rows.stop - rows.start, ranks[w])
    storage = torch.randn(11, 100).to(DEVICE, torch.float16)
    y = storage[:, 10:74]  # a strided view, as a slice of a fused output would be
    before = storage.clone()
    BACKENDS[backend][1](v, B, meta, y, output_slices=output_slices)
    changed = torch.zeros_like(storage, dtype=torch.bool)
    for rows in lora_rows.values():
        changed[rows, 10:30] = changed[rows, 50:58] = True
    assert torch.equal(storage[~changed], before[~changed])
    for w, rows in lora_rows.items():
        for k, (offset, size) in enumerate(output_slices):
            vs = v[rows, k * MAX_RANK : k * MAX_RANK + ranks[w]].double().cpu()
            delta = scalings[w] * vs @ B[w, offset : offset + size, : ranks[w]].double().cpu().T
            got = y[rows, offset : offset + size]
            assert_close(
                got, before[rows, 10 + offset : 10 + offset + size].double().cpu() + delta, torch.float16
            )


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_base_only_and_empty_batches_change_nothing(backend):
    shrink, expand = BACKENDS[backend]
    A, B = make_weights(2, 32, 24, 1, torch.float32, seed=4)
    for seg_lens, slots in ([[3, 0, 2], [0, 0, 1]], [[], []], [[0, 0], [1, 1]]):
        num_tokens = sum(seg_lens)
        meta = SgmvMeta.from_lists(seg_lens, slots, [0, 0], [1.0, 1.0], DEVICE)
        x, y = torch.randn(num_tokens, 32).to(DEVICE), torch.randn(num_tokens, 24).to(DEVICE)
        before = y.clone()
        expand(shrink(x, A, meta, num_stack=1), B, meta, y, output_slices=((0, 24),))
        assert torch.equal(y, before)


# -- metadata ------------------------------------------------------------------------------------------


def test_meta_from_lists():
    meta = SgmvMeta.from_lists([3, 0, 2, 4], [1, 2, 0, 2], [0, 8, 16], [0.0, 0.5, 2.0], DEVICE)
    assert meta.seg_indptr.tolist() == [0, 3, 3, 5, 9]
    assert meta.weight_indices.tolist() == [1, 2, 0, 2]
    assert meta.seg_indptr.dtype == meta.weight_indices.dtype == meta.lora_ranks.dtype == torch.int32
    assert meta.scalings.dtype == torch.float32
    assert (meta.max_seg_len, meta.num_segments) == (4, 4)
    with pytest.raises(ValueError, match="slot index"):
        SgmvMeta.from_lists([1], [3], [0, 8], [0.0, 1.0])
    with pytest.raises(ValueError, match=">= 0"):
        SgmvMeta.from_lists([-1], [0], [0], [0.0])


def test_chunk_segments_merges_and_splits():
    assert chunk_segments([3, 2, 0, 6, 1], [1, 1, 2, 0, 2], [0, 8, 8], 4) == ([4, 1, 6, 1], [1, 1, 0, 2])
    # base-model runs merge across different rank-0 slots; LoRA slots merge only with themselves
    assert chunk_segments([1, 2, 3, 1], [0, 3, 2, 2], [0, 8, 8, 0], 16) == ([3, 4], [0, 2])


@pytest.mark.parametrize("popularity", POPULARITY)
def test_chunked_meta_covers_the_same_rows(popularity):
    seg_lens, slots, ranks, scalings = make_batch(popularity, 9, 100, seed=5)
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)
    chunked = meta.chunked(8)
    assert meta.chunked(8) is chunked
    row_slot = [w for n, w in zip(seg_lens, slots, strict=True) for _ in range(n) if ranks[w] > 0]
    new_lens, new_slots = chunked.seg_indptr.diff().tolist(), chunked.weight_indices.tolist()
    new_row_slot = [w for n, w in zip(new_lens, new_slots, strict=True) for _ in range(n) if ranks[w] > 0]
    assert new_row_slot == row_slot and sum(new_lens) == sum(seg_lens)
    assert all(n <= 8 for n, w in zip(new_lens, new_slots, strict=True) if ranks[w] > 0)
    assert chunked.max_seg_len == max(new_lens) and chunked.num_segments == len(new_lens)


def test_wrappers_check_shapes_and_dtypes():
    meta = SgmvMeta.from_lists([2], [1], [0, 4], [0.0, 1.0], DEVICE)
    x = torch.randn(2, 16).to(DEVICE)
    A = torch.randn(2, 3 * MAX_RANK, 16).to(DEVICE)
    with pytest.raises(ValueError, match="is torch"):
        sgmv_shrink(x.half(), A, meta, num_stack=3)
    with pytest.raises(ValueError, match="num_stack"):
        sgmv_shrink(x, A, meta, num_stack=4)
    v = sgmv_shrink(x, A, meta, num_stack=3)
    B = torch.randn(2, 24, MAX_RANK).to(DEVICE)
    with pytest.raises(ValueError, match="outside"):
        sgmv_expand(v, B, meta, torch.zeros(2, 24, device=DEVICE), output_slices=((0, 8), (8, 8), (16, 9)))



@triton.jit
def _launch_order_kernel(out_ptr, n_tiles, num_stack):
    """Each program writes its (row block, stacked target, column tile) at its program id."""
    block, k, n = _tile_ids(n_tiles, num_stack)
    pid = tl.program_id(0)
    tl.store(out_ptr + 3 * pid, block)
    tl.store(out_ptr + 3 * pid + 1, k)
    tl.store(out_ptr + 3 * pid + 2, n)


def test_a_row_block_s_programs_are_neighbours_in_launch_order():
    """Program ids walk column tiles, then stacked targets, then row blocks: a row block's shrinks of
    every stacked target run together and read its x once from memory (then from L2)."""
    n_tiles, num_stack, blocks = 2, 3, 4
    out = torch.full((blocks * num_stack * n_tiles, 3), -1, dtype=torch.int32, device=DEVICE)
    _launch_order_kernel[(out.shape[0],)](out, n_tiles, num_stack)
    expected = [(b, k, n) for b in range(blocks) for k in range(num_stack) for n in range(n_tiles)]
    assert [tuple(row) for row in out.cpu().tolist()] == expected
