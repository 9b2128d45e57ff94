"""The LoRA tail placement (lorakernels/gemm_tail.py) against its PyTorch reference, and the widened GEMM
it feeds against the in-line LoRA path: x_aug @ W_aug^T equals x @ W^T plus every segment's
scaling * (x @ A^T) @ B^T.

Without CUDA the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set here before triton is
imported), which rounds fp32 -> bf16 toward zero; the placement tests then use scalings whose products
are exact. Outputs are poisoned first, so a tail entry the kernel leaves unwritten fails.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from lorakernels.gemm_tail import place_lora_tail, place_lora_tail_ref  # noqa: E402
from lorakernels.sgmv_ref import SgmvMeta, sgmv_expand_ref, sgmv_shrink_ref  # noqa: E402
from tests.lorakernels.test_sgmv import POPULARITY, make_batch  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
POISON = 7.0


def randn(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def meta_of(seg_lens, slots, ranks, scalings):
    return SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)


def place_both(v, meta, slot_block, blocks, max_rank, num_stack, head=24, extra_rows=0):
    """The kernel's tail (a strided view into a wider, poisoned x_aug) and the reference's."""
    rows, width = v.shape[0], num_stack * max_rank
    x_aug = torch.full((rows + extra_rows, head + blocks * width), POISON, dtype=v.dtype, device=DEVICE)[:rows]
    tail = x_aug[:, head:]
    place_lora_tail(v, meta, slot_block, tail, max_rank=max_rank, num_stack=num_stack)
    expected = torch.full_like(tail, POISON)
    place_lora_tail_ref(v, meta, slot_block, expected, max_rank=max_rank, num_stack=num_stack)
    return x_aug, tail, expected


@pytest.mark.parametrize("num_stack", [1, 2, 3])
def test_place_matches_reference_and_leaves_the_head(num_stack):
    max_rank = 8
    # segments of slots 0, 3, 1 (rank 0 in this target), 0 again, 2 (no block); a slot of lower rank than R
    meta = meta_of([10, 5, 12, 7, 3], [0, 3, 1, 0, 2], [8, 4, 0, 6], [2.0, 0.5, 1.0, 4.0])
    slot_block = torch.tensor([1, -1, -1, 0], dtype=torch.int32, device=DEVICE)
    v = randn(37, num_stack * max_rank, seed=num_stack)
    x_aug, tail, expected = place_both(v, meta, slot_block, blocks=2, max_rank=max_rank, num_stack=num_stack)
    torch.testing.assert_close(tail, expected, rtol=0, atol=0)
    assert (x_aug[:, :24] == POISON).all()  # the head (x) is not touched
    # slot 3's rows (10..15) hold 4 * v in block 0, columns below its rank 6 of each projection only
    cols = torch.arange(num_stack * max_rank, device=DEVICE) % max_rank < 6
    torch.testing.assert_close(tail[10:15, : num_stack * max_rank], ((v[10:15].float() * 4.0).to(v.dtype)) * cols)
    assert (tail[15:27] == 0).all() and (tail[34:] == 0).all()  # slot 1 (rank 0 here) and slot 2 (no block)
    assert (tail[10:15, num_stack * max_rank :] == 0).all()


def test_place_zeroes_padding_rows_past_the_segments():
    """A captured graph's padding rows (past the last segment) get zeros, whatever v holds there."""
    meta = meta_of([6, 4], [1, 0], [8, 8], [1.0, 2.0])
    slot_block = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    v = randn(40, 16, seed=3)
    _, tail, expected = place_both(v, meta, slot_block, blocks=2, max_rank=8, num_stack=2, extra_rows=5)
    torch.testing.assert_close(tail, expected, rtol=0, atol=0)
    assert (tail[10:] == 0).all()
    assert (tail[:6, 16:] != 0).any() and (tail[:6, :16] == 0).all()  # slot 1 owns block 1


def test_place_takes_each_rows_block_of_an_every_block_shrink():
    """v with every block's columns (one GEMM against all blocks' A): a row keeps its own block's, scaled,
    and the other blocks' products are dropped."""
    max_rank, num_stack = 4, 3
    width = num_stack * max_rank
    meta = meta_of([5, 9, 4], [2, 0, 1], [4, 3, 2, 0], [2.0, 1.0, 0.5, 0.0])
    slot_block = torch.tensor([2, 0, 1, -1], dtype=torch.int32, device=DEVICE)
    v_all = randn(18, 3 * width, seed=7)
    _, tail, expected = place_both(v_all, meta, slot_block, blocks=3, max_rank=max_rank, num_stack=num_stack)
    torch.testing.assert_close(tail, expected, rtol=0, atol=0)
    own = v_all[:5, width : 2 * width]  # slot 2 owns block 1, rank 2, scaling 0.5
    cols = torch.arange(width, device=DEVICE) % max_rank < 2
    torch.testing.assert_close(tail[:5, width : 2 * width], (own.float() * 0.5).to(own.dtype) * cols, rtol=0, atol=0)
    assert (tail[:5, :width] == 0).all() and (tail[:5, 2 * width :] == 0).all()


@pytest.mark.parametrize("every_block", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_stack", [1, 3])
@pytest.mark.parametrize("popularity", POPULARITY)
def test_place_grid_over_adapter_popularity(popularity, num_stack, dtype, every_block):
    """The kernel against its reference over test_sgmv's batches (base, empty and rank-0 segments among
    the adapters', ranks 1-16 in a capacity of 16) with some adapters' slots owning no block, for a
    shrink of the rows' own slot and one of every block, and three padding rows past the segments."""
    max_rank, blocks, num_tokens = 16, 3, 40
    width = num_stack * max_rank
    seg_lens, slots, ranks, scalings = make_batch(popularity, 6, num_tokens, seed=len(popularity) + num_stack)
    ranks = [min(r, max_rank) for r in ranks]
    if dtype == torch.bfloat16:  # products exact in bf16 (the interpreter rounds toward zero)
        scalings = [0.0 if s == 0.0 else 2.0 ** (i % 3 - 1) for i, s in enumerate(scalings)]
    meta = meta_of(seg_lens, slots, ranks, scalings)
    # up to `blocks` of the batch's adapted slots own a block, in a shuffled order; the rest own none
    gen = torch.Generator().manual_seed(num_stack)
    adapted = [s for s in dict.fromkeys(slots) if s != 0 and ranks[s] > 0]
    owners = [adapted[i] for i in torch.randperm(len(adapted), generator=gen).tolist()[:blocks]]
    slot_block = torch.full((len(ranks),), -1, dtype=torch.int32)
    for block, slot in zip(torch.randperm(blocks, generator=gen).tolist(), owners, strict=False):
        slot_block[slot] = block
    rows = sum(seg_lens) + 3
    v = randn(rows, blocks * width if every_block else width, dtype=dtype, seed=11)
    _, tail, expected = place_both(v, meta, slot_block.to(DEVICE), blocks=blocks, max_rank=max_rank, num_stack=num_stack)
    torch.testing.assert_close(tail, expected, rtol=0, atol=0)
    assert (tail[rows - 3 :] == 0).all()
    if owners:
        assert (tail != 0).any()  # some row's block holds its scaled shrink


def test_place_rejects_mismatched_shapes():
    meta = meta_of([4], [0], [8], [1.0])
    slot_block = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="tail"):
        place_lora_tail(randn(4, 16), meta, slot_block, torch.empty(4, 24, dtype=torch.bfloat16, device=DEVICE), max_rank=8, num_stack=2)
    with pytest.raises(ValueError, match="int32"):
        place_lora_tail(randn(4, 16), meta, slot_block.long(), torch.empty(4, 32, dtype=torch.bfloat16, device=DEVICE), max_rank=8, num_stack=2)


@pytest.mark.parametrize("slices", [((0, 40),), ((0, 24), (24, 8), (32, 8))])
def test_widened_gemm_equals_base_plus_lora(slices):
    """One GEMM over [x | tail] and [W | B^T rows] gives the base projection plus each segment's LoRA delta
    (fp32 operands: the sums agree to fp32 rounding)."""
    dtype, in_dim, max_rank = torch.float32, 48, 8
    stack, out_dim = len(slices), slices[-1][0] + slices[-1][1]
    width = stack * max_rank
    num_slots = 4  # slot 4: the base model's
    a = randn(num_slots + 1, width, in_dim, dtype=dtype, seed=1, scale=0.2)
    b = randn(num_slots + 1, out_dim, max_rank, dtype=dtype, seed=2, scale=0.2)
    ranks = [8, 5, 0, 8, 0]
    for slot, rank in enumerate(ranks):  # the pool zeroes what lies past a slot's rank
        a[slot].view(stack, max_rank, in_dim)[:, rank:] = 0
        b[slot, :, rank:] = 0
    meta = meta_of([7, 5, 6, 4], [3, 4, 1, 3], ranks, [2.0, 0.5, 1.0, 1.5, 0.0])
    slot_block = torch.tensor([-1, 1, -1, 0, -1], dtype=torch.int32, device=DEVICE)
    blocks = 2
    weight = randn(in_dim + blocks * width, out_dim, dtype=dtype, seed=4, scale=0.1)  # [in + tail, out] storage
    for slot, block in ((3, 0), (1, 1)):
        rows = weight[in_dim + block * width : in_dim + (block + 1) * width].view(stack, max_rank, out_dim)
        rows.zero_()
        for k, (offset, size) in enumerate(slices):
            rows[k, :, offset : offset + size] = b[slot, offset : offset + size].t()
    x_aug = torch.full((22, in_dim + blocks * width), POISON, dtype=dtype, device=DEVICE)
    x_aug[:, :in_dim] = randn(22, in_dim, dtype=dtype, seed=5)
    x = x_aug[:, :in_dim]
    v = sgmv_shrink_ref(x, a, meta, num_stack=stack)
    place_lora_tail(v, meta, slot_block, x_aug[:, in_dim:], max_rank=max_rank, num_stack=stack)
    widened = torch.nn.functional.linear(x_aug, weight.t())

    expected = torch.nn.functional.linear(x, weight[:in_dim].t())
    sgmv_expand_ref(v, b, meta, expected, output_slices=slices)
    torch.testing.assert_close(widened, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(expected, torch.nn.functional.linear(x, weight[:in_dim].t()))  # the LoRA rows moved
