"""lorakernels/pdl.py: which launches take programmatic dependent launch, and that the kernels which take
it compute the same with it (on a GPU of compute capability 9+; the interpreter never launches with it)."""

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
