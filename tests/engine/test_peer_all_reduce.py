"""The one-shot peer-memory all-reduce (engine.parallel.PeerAllReduce) on two GPUs of one host (skipped
with fewer): sums equal NCCL's exactly, eager and replayed from a CUDA graph with new inputs, in bf16 and
fp32, at sizes that do not fill a vector; what does not fit goes to NCCL."""

from __future__ import annotations

import os
import socket

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def _rank(rank: int, port: int) -> None:
    import torch.distributed as dist

    from engine.parallel import PeerAllReduce, TensorParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    tp = TensorParallel(rank, 2).with_peer_all_reduce(device)
    assert isinstance(tp.peer, PeerAllReduce)
    gen = torch.Generator(device).manual_seed(rank)
    for shape, dtype in [((1, 4096), torch.bfloat16), ((37, 8192), torch.bfloat16), ((3, 100), torch.float32), ((512, 8192), torch.bfloat16)]:
        x = torch.randn(shape, device=device, dtype=dtype, generator=gen)
        want = x.clone()
        dist.all_reduce(want)
        assert tp.peer.fits(x)
        assert tp.all_reduce(x) is x and torch.equal(x, want), (shape, dtype)

    # Captured once, replayed over new inputs (the decode graphs' case): three reductions a replay.
    static = [torch.zeros(64, 8192, device=device, dtype=torch.bfloat16) for _ in range(3)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for t in static:
            tp.all_reduce(t)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for t in static:
            tp.all_reduce(t)
    for _ in range(4):
        inputs = [torch.randn(t.shape, device=device, dtype=t.dtype, generator=gen) for t in static]
        for t, value in zip(static, inputs, strict=True):
            t.copy_(value)
        graph.replay()
        for t, value in zip(static, inputs, strict=True):
            dist.all_reduce(value)
            assert torch.equal(t, value)

    big = torch.randn(PeerAllReduce.MAX_BYTES // 2 + 8192, device=device, dtype=torch.bfloat16, generator=gen)
    assert not tp.peer.fits(big)  # NCCL's
    want = big.clone()
    dist.all_reduce(want)
    assert torch.equal(tp.all_reduce(big), want)
    dist.barrier()
    dist.destroy_process_group()


def test_peer_all_reduce_equals_nccl_eager_and_in_graphs():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port,), nprocs=2)  # raises what a rank raised
