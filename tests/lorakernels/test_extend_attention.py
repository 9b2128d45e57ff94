"""lorakernels/extend_attention.py (the Triton prefill kernel) against the fp32 reference
extend_attention_ref, over batch shapes (prefill, prefill on cached prefixes, decode rows, mixed, requests
spanning several query and key blocks), head layouts (MHA, GQA with power-of-two and other groups, MQA),
head sizes (a power of two and not), dtypes, and scattered KV slots with junk past each request.

Without CUDA the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is
imported)."""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from lorakernels.attention_ref import extend_attention_ref  # noqa: E402
from lorakernels.extend_attention import ExtendPlan, ExtendPlanBuffers, block_size_m, extend_attention  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
NUM_SLOTS, MAX_CONTEXT = 4096, 320
HEADS = {"mha": (4, 4), "gqa4": (8, 2), "gqa3": (6, 2), "mqa": (8, 1)}  # name -> (num_heads, num_kv_heads)
BATCHES: dict[str, list[tuple[int, int]]] = {  # name -> [(prefix_len, extend_len)] per request
    "prefill": [(0, 9), (0, 2), (0, 40)],
    "on_prefix": [(25, 13), (70, 1), (3, 33)],
    "mixed": [(12, 1), (20, 7), (0, 1), (0, 11), (40, 1), (3, 2)],
    "long": [(130, 150), (0, 200)],  # several query blocks and key tiles, a prefix not a tile multiple
}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def make_case(batch, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """Random q/K/V; req_to_token rows shuffled, slots scattered, junk slots past each request's length."""
    g = torch.Generator().manual_seed(seed)
    num_tokens = sum(e for _, e in batch)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    k_cache = torch.randn(NUM_SLOTS, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(NUM_SLOTS, num_kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.randperm(NUM_SLOTS, generator=g)
    req_to_token = torch.randint(0, NUM_SLOTS, (len(batch) + 2, MAX_CONTEXT), generator=g, dtype=torch.int64)
    rows = torch.randperm(len(batch) + 2, generator=g)[: len(batch)].tolist()  # request b's row is not b
    used = 0
    for row, (prefix_len, extend_len) in zip(rows, batch, strict=True):
        n = prefix_len + extend_len
        req_to_token[row, :n] = slots[used : used + n]
        used += n
    return q, k_cache, v_cache, req_to_token, rows


def run_both(batch, q, k_cache, v_cache, req_to_token, rows, scale):
    prefix_lens, extend_lens = [p for p, _ in batch], [e for _, e in batch]
    want = extend_attention_ref(
        q, k_cache, v_cache, req_to_token,
        torch.tensor(rows), torch.tensor(prefix_lens), torch.tensor(extend_lens), scale,
    )  # fmt: skip
    group = q.shape[1] // k_cache.shape[1]
    dev = [t.to(DEVICE) for t in (q, k_cache, v_cache, req_to_token)]
    plan = ExtendPlan(rows, prefix_lens, extend_lens, group, torch.device(DEVICE))
    return extend_attention(*dev, plan, scale).cpu(), want


@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("heads_name", list(HEADS))
@pytest.mark.parametrize("head_dim", [32, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference(batch_name, heads_name, head_dim, dtype):
    batch = BATCHES[batch_name]
    case = make_case(batch, *HEADS[heads_name], head_dim, dtype, seed=head_dim)
    got, want = run_both(batch, *case, scale=head_dim**-0.5)
    assert got.dtype == dtype and got.shape == case[0].shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_plan_lists_one_block_per_block_m_new_tokens_of_each_request():
    plan = ExtendPlan([4, 0, 2], [0, 10, 3], [70, 1, 33], group=2, device=torch.device("cpu"))
    assert plan.block_m == block_size_m(2) == 64
    # longest first, by the last query's position: 0 + 70, 0 + 64, 3 + 33, 10 + 1
    assert plan.block_req.tolist() == [0, 0, 2, 1] and plan.block_start.tolist() == [64, 0, 0, 0]
    assert plan.q_starts.tolist() == [0, 70, 71] and plan.num_tokens == 104
    assert [block_size_m(g) for g in (1, 3, 4, 8, 16)] == [128, 32, 32, 16, 16]


def test_static_plan_buffers_replay_any_step_of_their_size():
    """One launch size (a CUDA graph's: 96 query rows, its block list and requests padded) refilled
    with steps of other shapes: each step's rows equal the reference; padding rows belong to no
    request; the plan views of smaller sizes cover every block their steps can have."""
    num_heads, num_kv_heads, head_dim, size = 8, 2, 32, 96
    buffers = ExtendPlanBuffers(128, 6, num_heads // num_kv_heads, torch.device(DEVICE))
    plan = buffers.plan(size)
    assert plan.num_blocks == size // buffers.block_m + 6  # every request may add a partial block
    assert buffers.plan(4).num_blocks == 4 // buffers.block_m + 4  # at most one request per token
    for seed, batch in enumerate([BATCHES["mixed"], [(0, 70), (5, 1)], [(30, 33), (0, 1), (2, 40)], [(9, 96)]]):
        q, k_cache, v_cache, req_to_token, rows = make_case(batch, num_heads, num_kv_heads, head_dim, torch.float32, seed)
        _, want = run_both(batch, q, k_cache, v_cache, req_to_token, rows, 0.2)
        buffers.fill(rows, [p for p, _ in batch], [e for _, e in batch])
        padded = torch.cat([q, torch.randn(size - q.shape[0], num_heads, head_dim)])
        dev = [t.to(DEVICE) for t in (padded, k_cache, v_cache, req_to_token)]
        got = extend_attention(*dev, plan, 0.2).cpu()
        torch.testing.assert_close(got[: q.shape[0]], want, atol=1e-4, rtol=1e-4)
        used = sum(-(-e // buffers.block_m) for _, e in batch)
        assert (buffers.block_req[used:] == 6).all()  # the rest names the padding request
    # the smallest view: a step of up to 4 tokens, as many requests
    batch = [(3, 1), (0, 1), (7, 1)]  # 3 tokens and a padding row
    q, k_cache, v_cache, req_to_token, rows = make_case(batch, num_heads, num_kv_heads, head_dim, torch.float32, seed=9)
    _, want = run_both(batch, q, k_cache, v_cache, req_to_token, rows, 0.2)
    buffers.fill(rows, [p for p, _ in batch], [e for _, e in batch])
    padded = torch.cat([q, torch.randn(1, num_heads, head_dim)])
    got = extend_attention(*[t.to(DEVICE) for t in (padded, k_cache, v_cache, req_to_token)], buffers.plan(4), 0.2).cpu()
    torch.testing.assert_close(got[:3], want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="buffers hold 128"):
        buffers.fill([0, 1], [0, 0], [100, 29])
    with pytest.raises(ValueError, match="at most 6 requests"):
        buffers.fill(list(range(7)), [0] * 7, [1] * 7)


def test_checks_inputs():
    batch = [(3, 2)]
    q, k_cache, v_cache, req_to_token, rows = make_case(batch, 4, 2, 32, torch.float32)
    plan = ExtendPlan(rows, [3], [2], group=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="covers 2 new tokens"):
        extend_attention(q[:1], k_cache, v_cache, req_to_token, plan, 1.0)
    with pytest.raises(ValueError, match="do not fit KV heads"):
        extend_attention(torch.randn(2, 3, 32), k_cache, v_cache, req_to_token, plan, 1.0)
    with pytest.raises(ValueError, match="another head grouping"):
        extend_attention(torch.randn(2, 16, 32), k_cache, v_cache, req_to_token, plan, 1.0)
