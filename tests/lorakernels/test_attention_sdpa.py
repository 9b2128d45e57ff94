"""lorakernels/attention_sdpa.py against the fp32 reference extend_attention_ref, over a grid of batch shapes
(all decode, all prefill, mixed with a cached prefix, one request), head layouts (MHA, GQA, MQA) and
KV layouts (contiguous and scattered slots)."""

import pytest
import torch

from lorakernels.attention_ref import extend_attention_ref
from lorakernels.attention_sdpa import SdpaPlan, sdpa_extend_attention

HEAD_DIM, NUM_SLOTS, MAX_CONTEXT, SCALE = 16, 4096, 96, 0.25
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (6, 1)}  # name -> (num_heads, num_kv_heads)
BATCHES: dict[str, list[tuple[int, int]]] = {  # name -> [(prefix_len, extend_len)] per request
    "decode_varied": [(0, 1), (14, 1), (63, 1), (5, 1), (31, 1)],
    "prefill": [(0, 9), (0, 2), (0, 17)],
    "mixed": [(12, 1), (20, 7), (0, 1), (0, 11), (40, 1), (3, 2)],
    "single_decode": [(37, 1)],
    "single_prefill_on_prefix": [(25, 13)],
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _case(
    batch: list[tuple[int, int]], num_heads: int, num_kv_heads: int, scattered: bool, dtype, seed: int = 0
):
    """Random q/K/V and a req_to_token whose rows are shuffled and whose unused entries hold junk slots."""
    g = torch.Generator().manual_seed(seed)
    num_tokens = sum(e for _, e in batch)
    q = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=g).to(dtype)  # [T, H, D]
    k_cache = torch.randn(NUM_SLOTS, num_kv_heads, HEAD_DIM, generator=g).to(dtype)
    v_cache = torch.randn(NUM_SLOTS, num_kv_heads, HEAD_DIM, generator=g).to(dtype)
    slots = torch.randperm(NUM_SLOTS, generator=g) if scattered else torch.arange(NUM_SLOTS)
    # Junk past each request's length: a kernel that reads it without masking gets a wrong answer.
    req_to_token = torch.randint(0, NUM_SLOTS, (len(batch) + 2, MAX_CONTEXT), generator=g, dtype=torch.int32)
    rows = torch.randperm(len(batch) + 2, generator=g)[: len(batch)].tolist()  # request b's row is not b
    next_slot = 0
    for row, (prefix_len, extend_len) in zip(rows, batch, strict=True):
        n = prefix_len + extend_len
        req_to_token[row, :n] = slots[next_slot : next_slot + n].int()
        next_slot += n
    return q, k_cache, v_cache, req_to_token, rows


def _both(batch, q, k_cache, v_cache, req_to_token, rows):
    prefix_lens, extend_lens = [p for p, _ in batch], [e for _, e in batch]
    want = extend_attention_ref(
        q, k_cache, v_cache, req_to_token,
        torch.tensor(rows), torch.tensor(prefix_lens), torch.tensor(extend_lens), SCALE,
    )  # fmt: skip
    plan = SdpaPlan.build(rows, prefix_lens, extend_lens, req_to_token, q.device)
    return sdpa_extend_attention(q, k_cache, v_cache, plan, SCALE), want


@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("heads_name", list(HEADS))
@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_matches_reference(batch_name, heads_name, scattered, dtype):
    batch = BATCHES[batch_name]
    q, k_cache, v_cache, req_to_token, rows = _case(batch, *HEADS[heads_name], scattered, dtype)
    got, want = _both(batch, q, k_cache, v_cache, req_to_token, rows)
    assert got.dtype == dtype and got.shape == q.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_large_decode_batch_of_random_lengths():
    g = torch.Generator().manual_seed(7)
    batch = [(int(p), 1) for p in torch.randint(0, MAX_CONTEXT - 1, (64,), generator=g)]
    q, k_cache, v_cache, req_to_token, rows = _case(batch, 8, 2, True, torch.float32, seed=7)
    got, want = _both(batch, q, k_cache, v_cache, req_to_token, rows)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_plan_pads_decodes_with_slot_zero_and_masks_them():
    req_to_token = torch.full((3, 8), 99, dtype=torch.int32)
    req_to_token[2, :4] = torch.tensor([5, 6, 7, 8], dtype=torch.int32)
    req_to_token[0, :2] = torch.tensor([1, 2], dtype=torch.int32)
    req_to_token[1, :5] = torch.tensor([10, 11, 12, 13, 14], dtype=torch.int32)
    plan = SdpaPlan.build([2, 1, 0], [3, 2, 1], [1, 3, 1], req_to_token, "cpu")
    assert plan.num_tokens == 5 and not plan.is_all_decode
    assert plan.decode_q_rows.tolist() == [0, 4]
    assert plan.decode_slots.tolist() == [[5, 6, 7, 8], [1, 2, 0, 0]]
    assert plan.decode_key_mask.shape == (2, 1, 1, 4)
    assert plan.decode_key_mask[:, 0, 0].tolist() == [[True] * 4, [True, True, False, False]]
    (chunk,) = plan.extends
    assert (chunk.q_start, chunk.extend_len, chunk.slots.tolist()) == (1, 3, [10, 11, 12, 13, 14])
    # Query j sits at position 2 + j and sees keys 0 .. 2 + j.
    assert chunk.causal_mask.int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def test_all_decode_plan_has_no_extends():
    plan = SdpaPlan.build([0, 1], [3, 0], [1, 1], torch.zeros(2, 8, dtype=torch.int32), "cpu")
    assert plan.is_all_decode and plan.extends == [] and plan.decode_slots.shape == (2, 4)


def test_checks_inputs():
    q, k_cache, v_cache, req_to_token, rows = _case([(3, 2)], 4, 2, False, torch.float32)
    plan = SdpaPlan.build(rows, [3], [2], req_to_token, "cpu")
    with pytest.raises(ValueError, match="KV heads"):
        sdpa_extend_attention(torch.randn(2, 3, HEAD_DIM), k_cache, v_cache, plan, SCALE)
    with pytest.raises(ValueError, match="covers 2 tokens"):
        sdpa_extend_attention(q[:1], k_cache, v_cache, plan, SCALE)
    with pytest.raises(ValueError, match="extend_len"):
        SdpaPlan.build(rows, [3], [0], req_to_token, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_matches_reference_on_cuda(dtype):
    batch = BATCHES["mixed"]
    case = _case(batch, 8, 2, True, dtype)
    q, k_cache, v_cache, req_to_token, rows = (x.cuda() if torch.is_tensor(x) else x for x in case)
    got, want = _both(batch, q, k_cache, v_cache, req_to_token, rows)
    assert got.device.type == "cuda" and got.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
