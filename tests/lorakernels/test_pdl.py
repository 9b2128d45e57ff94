"""lorakernels/pdl.py: which launches take programmatic dependent launch, and that the kernels which take
it compute the same with it (on a GPU of compute capability 9+; the interpreter never launches with it)."""

import itertools
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from lorakernels import pdl  # noqa: E402


@pytest.fixture
def restore_pdl():
    before = pdl.enabled()
    yield
    pdl.set_enabled(before)


def test_launch_takes_pdl_only_where_enabled_on_a_hopper_or_later(restore_pdl, monkeypatch):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(pdl, "HAS_GDC", True)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    pdl.set_enabled(False)
    assert pdl.launch(cuda) == {} and pdl.launch(cpu) == {}
    pdl.set_enabled(True)
    assert pdl.launch(cuda) == {"USE_PDL": True, "launch_pdl": True}
    assert pdl.launch(cpu) == {}  # the interpreter: a plain launch
    capability[0] = (8, 0)  # an A100: no grid dependency control
    assert pdl.launch(cuda) == {}
    capability[0] = (10, 0)
    assert pdl.launch(cuda) == {"USE_PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "HAS_GDC", False)  # a Triton without it
    assert pdl.launch(cuda) == {}


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability()[0] < 9, reason="PDL needs compute capability 9+")
def test_the_decode_chain_in_a_cuda_graph_computes_the_same_with_pdl(restore_pdl):
    """GEMM -> RMSNorm -> GEMM -> RoPE/KV write -> attention -> GEMM -> SiLU-mul, captured in one graph with
    and without PDL and replayed: every output bit for bit the same (each kernel waits for its producer)."""
    from lorakernels.decode_attention import DecodeAttentionWorkspace, decode_attention
    from lorakernels.rmsnorm import add_rmsnorm
    from lorakernels.rope_kv import rope_kv_write
    from lorakernels.silu_mul import silu_mul

    torch.manual_seed(0)
    batch, hidden, heads, kv_heads, head_dim, inter, context = 32, 1024, 8, 2, 128, 2048, 300
    dt, dev = torch.bfloat16, "cuda"
    w_qkv = torch.randn(hidden, (heads + 2 * kv_heads) * head_dim, device=dev, dtype=dt) / hidden**0.5
    w_gu = torch.randn(heads * head_dim, 2 * inter, device=dev, dtype=dt) / hidden**0.5
    norm_w = torch.rand(hidden, device=dev, dtype=dt) + 0.5
    x, residual = torch.randn(batch, hidden, device=dev, dtype=dt), torch.randn(batch, hidden, device=dev, dtype=dt)
    positions = torch.randint(0, context - 1, (batch,), device=dev)
    cos_sin = torch.randn(4096, head_dim, device=dev)
    req_to_token = torch.arange(batch * context, device=dev, dtype=torch.int32).view(batch, context)
    seq_lens = (positions + 1).to(torch.int32)
    loc = req_to_token[torch.arange(batch, device=dev), positions].long()
    workspace = DecodeAttentionWorkspace.allocate(batch, heads, head_dim, 4, torch.device(dev))

    def run(use_pdl: bool):
        pdl.set_enabled(use_pdl)
        gen = torch.Generator(dev).manual_seed(1)
        k_cache, v_cache = (torch.randn(batch * context, kv_heads, head_dim, device=dev, dtype=dt, generator=gen) for _ in range(2))

        def chain():
            h, _ = add_rmsnorm(x, residual, norm_w, 1e-5)
            q = rope_kv_write(h @ w_qkv, positions, cos_sin, k_cache, v_cache, loc, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
            o = decode_attention(q, k_cache, v_cache, req_to_token, torch.arange(batch, device=dev), seq_lens, head_dim**-0.5,
                                 max_context=context, workspace=workspace)  # fmt: skip
            return silu_mul(o.reshape(batch, -1) @ w_gu), k_cache.clone()

        chain()  # compile
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        graph.replay()
        torch.cuda.synchronize()
        return out

    plain, with_pdl = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, with_pdl, strict=True))
    assert plain[0].abs().sum() > 0


@pytest.fixture
def restore_lora_pdl():
    before = pdl.lora_enabled()
    yield
    pdl.set_lora_enabled(before)


def test_lora_launch_releases_first_and_waits_after_only_where_enabled_on_a_hopper_or_later(restore_pdl, restore_lora_pdl, monkeypatch):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(pdl, "HAS_GDC", True)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    pdl.set_lora_enabled(False)
    pdl.set_enabled(True)  # the other switch does not turn this one on
    assert pdl.lora_launch(cuda, first=True) == {} and pdl.lora_launch(cuda, first=False) == {}
    pdl.set_enabled(False)
    pdl.set_lora_enabled(True)
    assert pdl.launch(cuda) == {}  # nor this one the other
    assert pdl.lora_launch(cuda, first=True) == {"RELEASE": True}  # the chain's first kernel: a plain launch
    assert pdl.lora_launch(cuda, first=False) == {"RELEASE": True, "USE_PDL": True, "launch_pdl": True}
    assert pdl.lora_launch(cpu, first=False) == {}
    capability[0] = (8, 0)
    assert pdl.lora_launch(cuda, first=False) == {} and pdl.lora_launch(cuda, first=True) == {}
    capability[0] = (9, 0)
    monkeypatch.setattr(pdl, "HAS_GDC", False)
    assert pdl.lora_launch(cuda, first=False) == {}


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability()[0] < 9, reason="PDL needs compute capability 9+")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_decode_lora_chain_beside_a_gemm_in_a_cuda_graph_computes_the_same_with_pdl(restore_lora_pdl, dtype):
    """Per layer, a GEMM on the main stream and the decode LoRA chain beside it on a side stream (split
    shrink -> reduce -> expand into a new delta, and the fused delta), joined, the delta added: a graph of
    several such projections captured with and without the LoRA PDL switch, replayed over groupings that
    change between replays (popular and unpopular adapters, a rank-0 segment, a rank-4 slot in a rank-16
    capacity); every output bit for bit the same, and the same as eager calls."""
    from lorakernels.sgmv_decode import sgmv_delta_auto, sgmv_lora_delta_decode, sgmv_shrink_auto
    from lorakernels.sgmv_ref import SgmvMeta

    torch.manual_seed(0)
    dev, tokens, hidden, out_dim, max_rank, num_slots, layers = "cuda", 48, 1024, 1536, 16, 9, 4
    gen = torch.Generator(dev).manual_seed(2)
    w = [torch.randn(hidden, out_dim, device=dev, dtype=dtype, generator=gen) / hidden**0.5 for _ in range(layers)]
    a = [torch.randn(num_slots, 3 * max_rank, hidden, device=dev, dtype=dtype, generator=gen) / hidden**0.5 for _ in range(layers)]
    b = [torch.randn(num_slots, out_dim, max_rank, device=dev, dtype=dtype, generator=gen) for _ in range(layers)]
    slices = ((0, 1024), (1024, 256), (1280, 256))
    ranks = torch.tensor([0, 16, 16, 4, 16, 8, 16, 16, 16], dtype=torch.int32, device=dev)
    scalings = torch.linspace(0.5, 2.0, num_slots, device=dev)
    x = torch.randn(tokens, hidden, device=dev, dtype=dtype, generator=gen)
    seg_indptr = torch.zeros(tokens + 1, dtype=torch.int32, device=dev)
    weight_indices = torch.zeros(tokens, dtype=torch.int32, device=dev)
    groupings = [  # (segment lengths, slots): every row covered, as a decode graph's
        ([16, 16, 16], [1, 2, 4]),
        ([1] * 8 + [16, 16, 8], [1, 2, 3, 4, 5, 6, 7, 8, 1, 0, 3]),
        ([48], [3]),
        ([3, 5, 7, 9, 11, 13], [8, 0, 6, 5, 2, 7]),
    ]
    num_segments = max(len(lens) for lens, _ in groupings)

    def meta_for(lens: list[int], slots: list[int]) -> SgmvMeta:
        # padding segments are empty and trail, as the engine's decode graphs have them
        starts = [0, *itertools.accumulate(lens)]
        seg_indptr[: num_segments + 1] = torch.tensor(starts + [tokens] * (num_segments + 1 - len(starts)), dtype=torch.int32)
        weight_indices[:num_segments] = torch.tensor(slots + [0] * (num_segments - len(slots)), dtype=torch.int32)
        return SgmvMeta(
            seg_indptr=seg_indptr[: num_segments + 1], weight_indices=weight_indices[:num_segments], lora_ranks=ranks,
            scalings=scalings, max_seg_len=tokens, num_segments=num_segments,
            host_seg_lens=tuple(lens) + (0,) * (num_segments - len(lens)), host_slots=tuple(slots) + (0,) * (num_segments - len(slots)),
        )  # fmt: skip

    side = torch.cuda.Stream(dev)

    def step(meta: SgmvMeta) -> list[torch.Tensor]:
        main, outs, h = torch.cuda.current_stream(), [], x
        for i in range(layers):
            ready = main.record_event()
            y = h @ w[i]
            side.wait_event(ready)
            with torch.cuda.stream(side):
                if i % 2:
                    delta = sgmv_lora_delta_decode(h, a[i], b[i], meta, num_stack=3, output_slices=slices)
                else:
                    v = sgmv_shrink_auto(h, a[i], meta, num_stack=3)
                    delta = sgmv_delta_auto(v, b[i], meta, output_slices=slices)
            main.wait_stream(side)
            delta.record_stream(main)
            outs.append(y + delta)
            h = outs[-1][:, :hidden].contiguous()
        return outs

    def run(use_pdl: bool) -> tuple[list, list]:
        pdl.set_lora_enabled(use_pdl)
        meta = meta_for(*groupings[0])
        eager = [[t.clone() for t in step(meta_for(*g))] for g in groupings]
        meta = meta_for(*groupings[0])
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step(meta)
        replayed = []
        for g in groupings:
            meta_for(*g)  # the same buffers, refilled in place
            graph.replay()
            replayed.append([t.clone() for t in outs])
        torch.cuda.synchronize()
        return eager, replayed

    plain_eager, plain_graph = run(False)
    pdl_eager, pdl_graph = run(True)
    for got in (plain_graph, pdl_eager, pdl_graph):
        assert all(torch.equal(p, q) for ps, qs in zip(plain_eager, got, strict=True) for p, q in zip(ps, qs, strict=True))
    assert all(not torch.equal(ps[0], qs[0]) for ps, qs in itertools.pairwise(plain_eager))  # the groupings matter
