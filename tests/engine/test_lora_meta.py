"""Per-step SGMV metadata in preallocated buffers, and a CUDA-graph replay that reads them."""

from __future__ import annotations

import pytest
import torch

from engine.lora_inputs import SgmvMetaBuffers, lora_segments
from lorakernels.sgmv_ref import SgmvMeta, sgmv_expand_ref, sgmv_shrink_ref


def test_refill_keeps_addresses_and_matches_from_lists():
    buffers = SgmvMetaBuffers(max_segments=6, num_slots=4, device="cpu")
    addresses = [t.data_ptr() for t in (buffers.seg_indptr, buffers.weight_indices, buffers.lora_ranks, buffers.scalings)]
    for seg_lens, slots in (([3, 1, 4], [1, 3, 0]), ([1] * 6, [2, 2, 0, 1, 3, 3]), ([7], [3])):
        ranks, scalings = [8, 0, 16, 4], [1.0, 0.0, 0.5, 2.0]
        meta = buffers.fill(seg_lens, slots, ranks, scalings)
        expected = SgmvMeta.from_lists(seg_lens, slots, ranks, scalings)
        for name in ("seg_indptr", "weight_indices", "lora_ranks", "scalings"):
            assert torch.equal(getattr(meta, name), getattr(expected, name)), name
        assert (meta.num_segments, meta.max_seg_len) == (expected.num_segments, expected.max_seg_len)
        assert buffers.seg_indptr[len(seg_lens) + 1 :].eq(sum(seg_lens)).all()  # unused segments are empty
    assert addresses == [t.data_ptr() for t in (buffers.seg_indptr, buffers.weight_indices, buffers.lora_ranks, buffers.scalings)]
    with pytest.raises(ValueError, match="segments"):
        buffers.fill([1] * 7, [0] * 7, ranks, scalings)


def test_unused_segments_name_the_pad_slot_after_a_step_with_more_segments():
    """A graph's kernels run for all max_segments: after a step of 5 segments and one of 2, the 3 segments
    the second leaves unused name the rank-0 pad slot, not the adapters the first put there (the decode
    expand would read their B for nothing)."""
    ranks, scalings = [16, 16, 16, 16, 0], [1.0, 1.0, 1.0, 1.0, 0.0]
    buffers = SgmvMetaBuffers(max_segments=6, num_slots=5, device="cpu")  # pad_slot: the last slot
    buffers.fill([1] * 5, [0, 1, 2, 3, 0], ranks, scalings)
    assert buffers.weight_indices.tolist() == [0, 1, 2, 3, 0, 4]
    meta = buffers.fill([3, 1], [2, 1], ranks, scalings)
    assert meta.weight_indices.tolist() == [2, 1]
    assert buffers.weight_indices.tolist() == [2, 1, 4, 4, 4, 4]
    assert buffers.lora_ranks[buffers.weight_indices[2:]].eq(0).all()
    buffers = SgmvMetaBuffers(max_segments=3, num_slots=5, device="cpu", pad_slot=1)
    buffers.fill([2], [3], [16, 0, 16, 16, 16], [1.0] * 5)
    assert buffers.weight_indices.tolist() == [3, 1, 1]
    for bad in (-1, 5):
        with pytest.raises(ValueError, match="pad_slot"):
            SgmvMetaBuffers(max_segments=3, num_slots=5, device="cpu", pad_slot=bad)


def test_each_target_gets_its_own_ranks_in_place():
    """by_target: the fill's metadata with each target's ranks (device views refilled in place, the host
    copy for the chunked backend, a chunk cache of its own); lora_ranks stays the slots' ranks."""
    buffers = SgmvMetaBuffers(max_segments=4, num_slots=3, device="cpu", targets=("qkv", "down"))
    views = {name: t.data_ptr() for name, t in buffers.target_ranks.items()}
    for qkv, down in (([4, 0, 0], [0, 8, 0]), ([2, 2, 0], [2, 0, 0])):
        meta = buffers.fill([2, 1], [0, 1], [4, 8, 0], [1.0, 2.0, 0.0], {"qkv": qkv, "down": down})
        metas = buffers.by_target(meta)
        assert meta.lora_ranks.tolist() == [4, 8, 0]
        assert metas["qkv"].lora_ranks.tolist() == qkv and metas["down"].lora_ranks.tolist() == down
        assert (metas["qkv"].host_ranks, metas["down"].host_ranks) == (tuple(qkv), tuple(down))
        assert torch.equal(metas["down"].seg_indptr, meta.seg_indptr) and metas["down"].scalings is meta.scalings
        assert metas["qkv"].chunked(1) is not metas["down"].chunked(1)
    assert views == {name: t.data_ptr() for name, t in buffers.target_ranks.items()}
    meta = buffers.fill([3], [2], [4, 8, 0], [1.0, 2.0, 0.0])  # no target ranks: each target has the slots'
    assert all(m.lora_ranks.tolist() == [4, 8, 0] for m in buffers.by_target(meta).values())


def test_lora_segments_merge_neighbouring_requests_of_one_slot():
    assert lora_segments([1, 1, 1, 1, 3], [2, 2, 2, 5, 5], 2) == ([2, 1, 1, 3], [2, 2, 5, 5])
    assert lora_segments([1, 1, 1, 1, 3], [2, 2, 2, 5, 5]) == ([3, 4], [2, 5])  # no cap: prefill steps
    assert lora_segments([1] * 5, [7, 2, 7, 7, 2], 16) == ([1, 1, 2, 1], [7, 2, 7, 2])  # only neighbours
    assert lora_segments([5, 1], [3, 3], 4) == ([5, 1], [3, 3])  # a request longer than the cap stays whole
    assert lora_segments([], []) == ([], [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_sees_refilled_metadata():
    from lorakernels.sgmv import sgmv_expand, sgmv_shrink

    torch.manual_seed(0)
    num_slots, rank, in_dim, out_dim, tokens = 5, 16, 256, 384, 8
    A = torch.randn(num_slots, rank, in_dim, device="cuda", dtype=torch.bfloat16) / 16
    B = torch.randn(num_slots, out_dim, rank, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, in_dim, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(tokens, out_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.zeros(tokens, rank, device="cuda", dtype=torch.bfloat16)
    buffers = SgmvMetaBuffers(max_segments=tokens, num_slots=num_slots, device="cuda")
    ranks, scalings = [rank, rank, 0, rank, rank], [0.5, 1.0, 0.0, 2.0, 0.25]
    # capture with the largest grid (one token per segment); replays reuse its launch shape
    meta = buffers.fill([1] * tokens, [0] * tokens, ranks, scalings)
    slices = ((0, out_dim),)

    def step():
        y.zero_()
        sgmv_shrink(x, A, meta, num_stack=1, out=v)
        sgmv_expand(v, B, meta, y, output_slices=slices)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seg_slots in ([1, 3, 4, 0, 2, 1, 1, 3], [4] * 8, [2] * 8):
        buffers.fill([1] * tokens, seg_slots, ranks, scalings)
        graph.replay()
        expected = torch.zeros(tokens, out_dim, device="cuda", dtype=torch.bfloat16)
        ref_meta = SgmvMeta.from_lists([1] * tokens, seg_slots, ranks, scalings, "cuda")
        sgmv_expand_ref(sgmv_shrink_ref(x, A, ref_meta, num_stack=1), B, ref_meta, expected, output_slices=slices)
        torch.testing.assert_close(y.float(), expected.float(), atol=2e-2, rtol=2e-2)
