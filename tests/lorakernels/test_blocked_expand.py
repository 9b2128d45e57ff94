"""The expands reading every tail block's shrink: a decode step's wide GEMM (--lora-decode-wide-gemm,
engine/lora_inputs.py) computes x @ [W | A_0 .. A_n-1] in one GEMM, so each row's shrink lies in its slot's
block of the output's extra columns, and the kernel that reads the projection next expands from that block
(RoPE/KV write and SiLU-mul in their dense every-block forms, the residual add + RMSNorm one row a
program with `v_block`).

Each kernel must give what the per-row kernel gives for the rows' own shrinks (`own_block_v` gathers them
for the readers that cannot fuse). Every block but a row's own is NaN or garbage, so a row reading another
block, or a slot's block offset computed wrongly, fails.
Under TRITON_INTERPRET=1 on the CPU; natively with CUDA.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from lorakernels.rmsnorm import add_rmsnorm_expand  # noqa: E402
from lorakernels.rope_kv import rope_kv_write  # noqa: E402
from lorakernels.sgmv_ref import SgmvMeta, own_block_v  # noqa: E402
from lorakernels.silu_mul import silu_mul_expand  # noqa: E402
from tests.lorakernels.test_fused_ops import (  # noqa: E402
    EXPAND_MAX_RANK,
    HEADS,
    adapted_rows,
    assert_close,
    caches,
    randn,
    rope_case,
)
from tests.lorakernels.test_sgmv import POPULARITY  # noqa: E402
from tests.lorakernels.test_sgmv_decode import decode_batch, merged  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
R = EXPAND_MAX_RANK
NUM_BLOCKS = 5


def blocked_batch(popularity, batch=12, num_adapters=4):
    """A decode batch (test_sgmv_decode's, rows merged into runs), each adapted slot given a tail block
    in an order unlike the slots' (block j != slot), the base slot and any slot without an adapter none
    (-1): (seg_lens, slots, ranks, scalings, v_block)."""
    seg_lens, slots, ranks = decode_batch(popularity, batch=batch, num_adapters=num_adapters, seed=len(popularity))
    seg_lens, slots = merged(seg_lens, slots)
    ranks = [min(r, R) for r in ranks]
    scalings = [0.0] + [0.25 * (1 + i % 7) for i in range(len(ranks) - 1)]
    adapted = [w for w in dict.fromkeys(slots) if ranks[w] > 0]
    blocks = [-1] * len(ranks)
    for j, w in enumerate(reversed(adapted)):
        blocks[w] = NUM_BLOCKS - 1 - j  # the highest blocks first: a row reading block 0 reads NaN
    return seg_lens, slots, ranks, scalings, torch.tensor(blocks, dtype=torch.int32, device=DEVICE)


def every_block_v(own, seg_lens, slots, v_block, width):
    """[T, NUM_BLOCKS * width]: each row's `own` shrink in its slot's block, NaN in every other block (and
    everywhere in a row of no block: it has no LoRA and reads none)."""
    v_all = torch.full((own.shape[0], NUM_BLOCKS * width), float("nan"), dtype=own.dtype, device=own.device)
    start, blocks = 0, v_block.tolist()
    for n, w in zip(seg_lens, slots, strict=True):
        if blocks[w] >= 0:
            v_all[start : start + n, blocks[w] * width : (blocks[w] + 1) * width] = own[start : start + n]
        start += n
    return v_all


def test_own_block_v_gathers_each_rows_block():
    seg_lens, slots, ranks, scalings, v_block = blocked_batch("zipf")
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)
    own = randn(sum(seg_lens), 2 * R, dtype=torch.float32, seed=3)
    v_all = every_block_v(own, seg_lens, slots, v_block, 2 * R)
    got = own_block_v(v_all, v_block, meta, 2 * R)
    adapted = adapted_rows(seg_lens, slots, ranks, own.shape[0], DEVICE)
    assert adapted.any() and torch.equal(got[adapted], own[adapted])


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first"])
def test_add_rmsnorm_expand_one_row_a_program_is_the_delta_path(popularity, dtype, with_residual):
    """rows=True (a decode step's o or down expand): each row's delta rounded, added to x, then the residual
    and the norm, as add_rmsnorm does with the side stream's delta; a width no multiple of the column block
    (ROWS_BLOCK_N) walks a partial block; padding rows get the add and the norm alone; with v_block the
    same result from every block's shrink."""
    from lorakernels import rmsnorm
    from lorakernels.rmsnorm import add_rmsnorm, add_rmsnorm_ref
    from lorakernels.sgmv_ref import sgmv_expand_ref

    seg_lens, slots, ranks, scalings, v_block = blocked_batch(popularity)
    rows, hidden = sum(seg_lens) + 2, rmsnorm.ROWS_BLOCK_N + 200
    x = randn(rows, hidden + 8, dtype=dtype, seed=4, scale=2.0)[:, :hidden]  # the wide GEMM's strided rows
    residual = randn(rows, hidden, dtype=dtype, seed=5, scale=3.0) if with_residual else None
    weight = randn(hidden, dtype=dtype, seed=6)
    own = randn(rows, R, dtype=dtype, seed=7)
    B = randn(len(ranks), hidden, R, dtype=dtype, seed=8, scale=0.5)
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)
    poisoned, start = own.clone(), 0
    for n, w in zip(seg_lens, slots, strict=True):  # v past a row's rank: never read
        poisoned[start : start + n, ranks[w] :] = float("nan")
        start += n
    before = x.clone()
    out, summed = add_rmsnorm_expand(x, residual, weight, 1e-5, poisoned, B, meta, rows=True)
    delta = torch.zeros_like(x)
    sgmv_expand_ref(own, B, meta, delta, output_slices=((0, hidden),))  # the delta path's delta, rounded
    want_out, want_sum = add_rmsnorm_ref(x, residual, weight, 1e-5, delta)
    assert torch.equal(x, before)
    assert_close(summed, want_sum, dtype, "sum", roundings=2)
    assert_close(out, want_out, dtype, "out", roundings=3)
    if dtype == torch.float32 or HAS_CUDA:  # the kernel's delta path on the same device
        k_out, _ = add_rmsnorm(x, residual, weight, 1e-5, delta)
        assert_close(out, k_out, dtype, "out against add_rmsnorm with the delta", roundings=2)
    adapted = adapted_rows(seg_lens, slots, ranks, rows, DEVICE)
    _, plain_sum = add_rmsnorm(x, residual, weight, 1e-5)
    assert torch.equal(summed[~adapted], plain_sum[~adapted])
    if adapted.any():
        assert not torch.allclose(summed[adapted].float(), plain_sum[adapted].float())
    v_all = every_block_v(own, seg_lens, slots, v_block, R)
    b_out, b_sum = add_rmsnorm_expand(x, residual, weight, 1e-5, v_all, B, meta, rows=True, v_block=v_block)
    o_out, o_sum = add_rmsnorm_expand(x, residual, weight, 1e-5, own, B, meta, rows=True)
    assert torch.equal(b_out, o_out) and torch.equal(b_sum, o_sum)


def tail_rows(B, v_block, num_stack, slices, ranks, dtype):
    """[NUM_BLOCKS * num_stack * R, out]: engine/lora_tail.py's tail rows, block j holding its slot's B^T,
    projection k's rank rows in k's own columns; NaN in the other projections' columns (never read), zeros
    past a slot's rank (as the pool keeps them), and finite noise in blocks no slot holds."""
    width, out_dim = num_stack * R, B.shape[1]
    bt = randn(NUM_BLOCKS * width, out_dim, dtype=dtype, seed=11)
    for j in range(NUM_BLOCKS):
        for k, (offset, size) in enumerate(slices):
            rows = slice(j * width + k * R, j * width + (k + 1) * R)
            others = torch.ones(out_dim, dtype=torch.bool, device=bt.device)
            others[offset : offset + size] = False
            block_rows = bt[rows]
            block_rows[:, others] = float("nan")
            bt[rows] = block_rows
    for w, j in enumerate(v_block.tolist()):
        if j < 0:
            continue
        for k, (offset, size) in enumerate(slices):
            rows = slice(j * width + k * R, j * width + (k + 1) * R)
            block_rows = bt[rows]
            block_rows[:, offset : offset + size] = B[w, offset : offset + size].T
            block_rows[ranks[w] :, offset : offset + size] = 0
            bt[rows] = block_rows
    return bt


@pytest.fixture(params=[False, True], ids=["one-dot", "k-chunks"])
def k_chunks(request, monkeypatch):
    """The dense expands' dots over every block's columns at once (5 blocks x R = 40 <= 128), or in chunks
    of 16 (three, the last partial), as a rank capacity of 64 takes them."""
    if request.param:
        import lorakernels.sgmv

        monkeypatch.setattr(lorakernels.sgmv, "BLOCKS_K", 16)  # blocks_k reads it at each launch
    return request.param


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [13, 70], ids=["one-row-tile", "row-tiles"])
def test_silu_mul_blocks_is_silu_mul_expand_from_each_rows_block(popularity, dtype, rows, k_chunks):
    """The dense form: a column block of every row at once, the rows' shrinks masked to their own blocks
    times every block's B^T tail rows; silu_mul_expand's result from the rows' own shrinks and the slots'
    B (in fp32 to the dot's summation order; in bf16 to a rounding step), padding rows the SiLU-mul alone,
    and more rows than one row tile (64) walked in tiles."""
    from lorakernels.silu_mul import silu_mul, silu_mul_blocks

    seg_lens, slots, ranks, scalings, v_block = blocked_batch(popularity, batch=min(rows - 1, 64))
    if rows > 64:  # a second row tile: more runs of the same adapters
        seg_lens, slots = [*seg_lens, rows - 1 - sum(seg_lens)], [*slots, slots[0]]
    inter = 80
    gate_up = randn(rows, 2 * inter + 24, dtype=dtype, seed=1, scale=3.0)[:, : 2 * inter]  # the wide GEMM's strided rows
    own = randn(rows, 2 * R, dtype=dtype, seed=2)
    B = randn(len(ranks), 2 * inter, R, dtype=dtype, seed=3, scale=0.5)
    for w, r in enumerate(ranks):
        B[w, :, r:] = 0
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)
    v_all = every_block_v(own, seg_lens, slots, v_block, 2 * R)
    start = 0
    for n, w in zip(seg_lens, slots, strict=True):  # v past a row's rank: whatever the GEMM gave, masked
        if v_block[w] >= 0:
            j = int(v_block[w])
            v_all[start : start + n, j * 2 * R + ranks[w] : (j + 1) * 2 * R] = 7.0
            v_all[start : start + n, j * 2 * R + R : j * 2 * R + R + ranks[w]] = own[start : start + n, R : R + ranks[w]]
        start += n
    v_all = torch.nan_to_num(v_all, nan=5.0)  # other blocks: finite garbage the mask must drop
    bt = tail_rows(B, v_block, 2, ((0, inter), (inter, inter)), ranks, dtype)
    out = silu_mul_blocks(gate_up, v_all, bt, meta, v_block, max_rank=R)
    want = silu_mul_expand(gate_up, torch.nan_to_num(own), B, meta)
    assert_close(out, want, dtype, "against silu_mul_expand", roundings=2)
    adapted = adapted_rows(seg_lens, slots, ranks, rows, DEVICE)
    assert torch.equal(out[~adapted], silu_mul(gate_up)[~adapted])
    assert adapted.any() and not torch.allclose(out[adapted].float(), silu_mul(gate_up)[adapted].float())


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads, head_dim", [("gqa", 64), ("mqa", 16)], ids=["gqa-64", "mqa-16"])
def test_rope_kv_write_blocks_is_the_expand_from_each_rows_block(popularity, dtype, heads, head_dim, k_chunks):
    """The dense form of the q/k/v expand: each head of a row tile from one dot over every block's B^T tail
    rows (rows masked to their own blocks); rope_kv_write's result with the rows' own shrinks and the
    slots' B (fp32 to the dot's summation order, bf16 to a rounding step), over row tiles (13 rows in
    tiles of 8), head halves narrower than a dot (16-wide heads) and padding rows without LoRA."""
    from lorakernels.rope_kv import rope_kv_write_blocks

    seg_lens, slots, ranks, scalings, v_block = blocked_batch(popularity)
    num_heads, num_kv_heads = HEADS[heads]
    rows = sum(seg_lens) + 1
    cos_sin, qkv, positions, loc = rope_case(dtype, num_heads, num_kv_heads, head_dim, num_tokens=rows, seed=7, num_slots=80)
    qkv = torch.cat([qkv, torch.full_like(qkv[:, :40], float("nan"))], dim=1)[:, : qkv.shape[1]]  # strided rows, NaN past them
    kw = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    own = randn(rows, 3 * R, dtype=dtype, seed=8)
    B = randn(len(ranks), qkv.shape[1], R, dtype=dtype, seed=9, scale=0.5)
    for w, r in enumerate(ranks):
        B[w, :, r:] = 0
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)
    v_all = torch.nan_to_num(every_block_v(own, seg_lens, slots, v_block, 3 * R), nan=5.0)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    slices = ((0, q_size), (q_size, kv_size), (q_size + kv_size, kv_size))
    bt = tail_rows(B, v_block, 3, slices, ranks, dtype)
    k_cache, v_cache = caches(num_kv_heads, head_dim, dtype, num_slots=80)
    q = rope_kv_write_blocks(qkv, positions, cos_sin, k_cache, v_cache, loc, v_all, bt, meta, v_block, max_rank=R, block_t=8, **kw)
    k_own, v_own = caches(num_kv_heads, head_dim, dtype, num_slots=80)
    q_own = rope_kv_write(qkv, positions, cos_sin, k_own, v_own, loc, expand=(own, B, meta), **kw)
    assert_close(q, q_own, dtype, "q", roundings=2)
    assert_close(k_cache[loc], k_own[loc], dtype, "k", roundings=2)
    assert_close(v_cache[loc], v_own[loc], dtype, "v", roundings=2)
    adapted = adapted_rows(seg_lens, slots, ranks, rows, DEVICE)
    k_plain, v_plain = caches(num_kv_heads, head_dim, dtype, num_slots=80)
    q_plain = rope_kv_write(qkv, positions, cos_sin, k_plain, v_plain, loc, **kw)
    # Rows without LoRA rotate as the plain kernel does: bit for bit in bf16 (the rounding to bf16 hides
    # it), to a few fp32 roundings in fp32, where the GPU compiler may contract u1 * cos - u2 * sin into an
    # FMA one way in one kernel and the other way in the other (seen on an H100); v is stored unrotated.
    if dtype == torch.float32:
        torch.testing.assert_close(q[~adapted], q_plain[~adapted], rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(q[~adapted], q_plain[~adapted])
    assert torch.equal(v_cache[loc][~adapted], v_plain[loc][~adapted])
    assert not torch.allclose(q[adapted].float(), q_plain[adapted].float())
    assert adapted.any() and not torch.allclose(v_cache[loc][adapted].float(), v_plain[loc][adapted].float())


def test_the_expands_refuse_a_bad_v_block():
    seg_lens, slots, ranks, scalings, v_block = blocked_batch("uniform")
    meta = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings, DEVICE)
    rows, hidden = sum(seg_lens), 16
    x, residual = randn(rows, hidden, dtype=torch.float32, seed=1), randn(rows, hidden, dtype=torch.float32, seed=4)
    weight = randn(hidden, dtype=torch.float32, seed=5)
    B = randn(len(ranks), hidden, R, dtype=torch.float32, seed=3)
    v_all = randn(rows, NUM_BLOCKS * R, dtype=torch.float32, seed=2)
    with pytest.raises(ValueError, match="blocks of 1 targets"):
        add_rmsnorm_expand(x, residual, weight, 1e-5, v_all[:, :-1], B, meta, rows=True, v_block=v_block)
    with pytest.raises(ValueError, match="v_block must be int32"):
        add_rmsnorm_expand(x, residual, weight, 1e-5, v_all, B, meta, rows=True, v_block=v_block.long())
    with pytest.raises(ValueError, match="v_block must be int32"):
        add_rmsnorm_expand(x, residual, weight, 1e-5, v_all, B, meta, rows=True, v_block=v_block[:1])
    with pytest.raises(ValueError, match="v_block goes with rows=True"):
        add_rmsnorm_expand(x, residual, weight, 1e-5, v_all, B, meta, v_block=v_block)
