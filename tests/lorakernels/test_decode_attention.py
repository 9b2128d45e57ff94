"""Paged split-KV decode attention: Triton kernel and PyTorch reference against an fp64 loop.

Without CUDA the Triton kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set here before
triton is imported) on small dims; with CUDA they run natively, with Llama-sized cases added. Every case
checks softmax(scale * q . K) @ V per request and head over the request's gathered (shuffled) slots,
computed independently in fp64, for MHA, GQA and MQA, head_dim 64 and 128, three dtypes, batches mixing
L = 1, short, chunk-spanning and long sequences with padding rows (L = 0, whose output must be zeros).
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from lorakernels.decode_attention import (  # noqa: E402
    DecodeAttentionWorkspace,
    decode_attention,
    decode_attention_ref,
    default_num_splits,
)

DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # absolute; |o| <= ~1
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}  # name -> (H, Hkv)
# 0 = padding row; 1; short; several BLOCK_N (16 on CPU) tiles and chunks; the longest sets max_context
SEQ_LENS = (37, 0, 1, 5, 100, 0, 64)
BACKENDS = {"triton": decode_attention, "ref": decode_attention_ref}


def make_case(
    seq_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    dtype,
    *,
    max_context,
    seed,
    index_dtype=torch.int32,
    num_slots=None,
):
    """Random q/K/V; each request's positions map to distinct shuffled slots in a pool with spare slots,
    its req_to_token row is a shuffled row of a table wider than max_context (junk past L and max_context)."""
    gen = torch.Generator().manual_seed(seed)
    batch_size = len(seq_lens)
    num_slots = num_slots or sum(seq_lens) + 13
    max_reqs = batch_size + 3
    q = torch.randn(batch_size, num_heads, head_dim, generator=gen)
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    # out-of-range junk everywhere the kernel must not look: a read past L would fault or show up
    req_to_token = torch.full((max_reqs, max_context + 5), 2**30, dtype=torch.int64)
    perm = torch.randperm(num_slots, generator=gen)
    req_rows = torch.randperm(max_reqs, generator=gen)[:batch_size]
    start = 0
    for row, seq_len in zip(req_rows.tolist(), seq_lens, strict=True):
        req_to_token[row, :seq_len] = perm[start : start + seq_len]
        start += seq_len
    to = dict(device=DEVICE)
    return (
        q.to(dtype=dtype, **to), k_cache.to(dtype=dtype, **to), v_cache.to(dtype=dtype, **to),
        req_to_token.to(dtype=index_dtype, **to), req_rows.to(**to),
        torch.tensor(seq_lens, dtype=torch.int32, **to),
    )  # fmt: skip


def naive_attention(q, k_cache, v_cache, req_to_token, req_rows, seq_lens, scale):
    """fp64, one request and one head at a time; zeros for L == 0."""
    group = q.shape[1] // k_cache.shape[1]
    o = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        slots = req_to_token[int(req_rows[b]), : int(seq_lens[b])].long().cpu()
        for h in range(q.shape[1]):
            k = k_cache.cpu().double()[slots, h // group]  # [L, D]
            v = v_cache.cpu().double()[slots, h // group]
            if len(slots):
                o[b, h] = torch.softmax(scale * k @ q[b, h].cpu().double(), dim=0) @ v
    return o


def check(o, expected, dtype):
    assert o.dtype == dtype and o.shape == expected.shape
    assert torch.isfinite(o).all()
    err = (o.cpu().double() - expected).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs error {err}"


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_matches_fp64(heads, head_dim, dtype, backend):
    num_heads, num_kv_heads = HEADS[heads]
    max_context = max(SEQ_LENS)
    case = make_case(
        SEQ_LENS, num_heads, num_kv_heads, head_dim, dtype, max_context=max_context, seed=head_dim
    )
    scale = head_dim**-0.5
    o = BACKENDS[backend](*case, scale, max_context=max_context, num_splits=3)
    expected = naive_attention(*case, scale)
    check(o, expected, dtype)
    assert (o[torch.tensor(SEQ_LENS) == 0] == 0).all()  # padding rows: zeros, not left uninitialised


@pytest.mark.parametrize("num_splits", [1, 2, 7, 16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_splits_and_index_dtypes(num_splits, index_dtype):
    """Any chunk count (more chunks than tiles leaves most empty) and both req_to_token dtypes agree."""
    seq_lens = (100, 1, 0, 48, 17)
    case = make_case(
        seq_lens, 8, 2, 64, torch.float32, max_context=128, seed=num_splits, index_dtype=index_dtype
    )
    o = decode_attention(*case, 0.125, max_context=128, num_splits=num_splits)
    check(o, naive_attention(*case, 0.125), torch.float32)


def test_seq_lens_clamped_to_max_context():
    """L > max_context attends to the first max_context positions only, never reads further."""
    case = make_case((40, 20), 4, 2, 64, torch.float32, max_context=40, seed=3)
    q, k_cache, v_cache, req_to_token, req_rows, _ = case
    seq_lens = torch.tensor([1000, 20], dtype=torch.int32, device=DEVICE)
    o = decode_attention(
        q, k_cache, v_cache, req_to_token, req_rows, seq_lens, 0.125, max_context=32, num_splits=2
    )
    clamped = torch.tensor([32, 20], dtype=torch.int32)
    check(o, naive_attention(q, k_cache, v_cache, req_to_token, req_rows, clamped, 0.125), torch.float32)


def test_workspace_reused_and_out_buffer():
    """A workspace for a larger batch serves a smaller one; out= is written in place; padding rows zeroed
    even when the buffer held garbage."""
    seq_lens = (30, 0, 9)
    case = make_case(seq_lens, 8, 2, 64, torch.float16, max_context=64, seed=5)
    workspace = DecodeAttentionWorkspace.allocate(8, 8, 64, 4, DEVICE)
    out = torch.full((3, 8, 64), float("nan"), dtype=torch.float16, device=DEVICE)
    o = decode_attention(*case, 0.125, max_context=64, workspace=workspace, out=out)
    assert o.data_ptr() == out.data_ptr()
    check(o, naive_attention(*case, 0.125), torch.float16)
    assert (o[1] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_chunk_writes_the_output_itself(dtype, monkeypatch, kernel_launches):
    """num_splits 1: stage 1 writes o (padding rows zeroed over garbage) and the merge is not launched;
    the result is the two-kernel path's bit for bit (that path forced through `_one_pass`)."""
    import lorakernels.decode_attention as da

    case = make_case(SEQ_LENS, 8, 2, 64, dtype, max_context=128, seed=11)
    merges = kernel_launches(da, "_decode_attention_merge_kernel")
    out = torch.full((len(SEQ_LENS), 8, 64), float("nan"), dtype=dtype, device=DEVICE)
    direct = decode_attention(*case, 0.125, max_context=128, num_splits=1, out=out)
    assert merges == []
    check(direct, naive_attention(*case, 0.125), dtype)
    assert (direct[torch.tensor(SEQ_LENS) == 0] == 0).all()
    monkeypatch.setattr(da, "_one_pass", lambda num_splits: False)
    merged = decode_attention(*case, 0.125, max_context=128, num_splits=1)
    assert len(merges) == 1
    assert torch.equal(direct, merged)
    decode_attention(*case, 0.125, max_context=128, num_splits=2)
    assert len(merges) == 2


def test_bad_inputs_rejected():
    case = make_case((4,), 4, 2, 64, torch.float32, max_context=8, seed=0)
    with pytest.raises(ValueError, match="max_context"):
        decode_attention(*case, 0.125, max_context=100)
    with pytest.raises(ValueError, match="cannot hold"):
        decode_attention(
            *case,
            0.125,
            max_context=8,
            workspace=DecodeAttentionWorkspace.allocate(1, 4, 64, 2, DEVICE),
            num_splits=3,
        )
    q, k_cache, *rest = case
    with pytest.raises(ValueError, match="do not fit"):
        decode_attention(q[:, :3], k_cache, k_cache, *rest[1:], 0.125, max_context=8)


def test_default_num_splits_depends_on_sizes_only():
    device = torch.device(DEVICE)
    assert default_num_splits(1, 1, 8192, device) > default_num_splits(64, 8, 8192, device) >= 1
    assert default_num_splits(1, 8, 50, device) == 1  # capacity under one chunk: one chunk


@pytest.mark.skipif(not HAS_CUDA, reason="Llama-sized cases run on CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_llama3_shapes_cuda(dtype):
    seq_lens = (1, 0, 511, 2048, 4097, 3, 0, 8000)
    case = make_case(seq_lens, 32, 8, 128, dtype, max_context=8192, seed=11)
    o = decode_attention(*case, 128**-0.5, max_context=8192)
    check(o, naive_attention(*case, 128**-0.5), dtype)


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need CUDA")
def test_cuda_graph_replay_follows_new_lengths():
    """Capture once at a fixed max_context, then rewrite seq_lens / req_to_token / q in place and replay."""
    max_context, dtype = 1024, torch.bfloat16
    shape = dict(max_context=max_context, num_slots=2048)
    first = make_case((700, 0, 1, 300), 32, 8, 128, dtype, seed=1, **shape)
    second = make_case((5, 900, 0, 1024), 32, 8, 128, dtype, seed=2, **shape)
    q, k_cache, v_cache, req_to_token, req_rows, seq_lens = (t.clone() for t in first)
    workspace = DecodeAttentionWorkspace.allocate(
        4, 32, 128, default_num_splits(4, 8, max_context, q.device), DEVICE
    )
    out = torch.empty_like(q)
    scale = 128**-0.5

    def step():
        decode_attention(
            q, k_cache, v_cache, req_to_token, req_rows, seq_lens, scale,
            max_context=max_context, workspace=workspace, out=out,
        )  # fmt: skip

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    graph.replay()
    torch.cuda.synchronize()
    check(out, naive_attention(q, k_cache, v_cache, req_to_token, req_rows, seq_lens, scale), dtype)
    for static, new in zip((q, k_cache, v_cache, req_to_token, req_rows, seq_lens), second, strict=True):
        static.copy_(new)  # same shapes: the graph's buffers get new contents, lengths included
    graph.replay()
    torch.cuda.synchronize()
    check(out, naive_attention(q, k_cache, v_cache, req_to_token, req_rows, seq_lens, scale), dtype)
    assert (out[2] == 0).all()
