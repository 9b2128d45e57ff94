"""The one-shot peer-memory all-reduce (engine.parallel.PeerAllReduce) on two GPUs of one host (skipped
with fewer): sums equal NCCL's exactly, eager and replayed from a CUDA graph with new inputs, in bf16 and
fp32, at sizes that do not fill a vector; a row-parallel linear's output written into the staging buffer;
what does not fit goes to NCCL."""

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

    from engine.parallel import PeerAllReduce, RowParallelLinear, TensorParallel

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

    # A row-parallel linear writes its partial sum straight into the staging buffer; the sum comes back
    # in a new tensor (peers still read the buffer), in a graph too, and equals NCCL's over F.linear.
    with torch.inference_mode():  # as the engine runs it (an out= matmul refuses autograd)
        linear = RowParallelLinear(2 * 512, 8192, bias=False, tp=tp, device=device, dtype=torch.bfloat16)
        linear.weight.data.copy_(torch.randn(linear.weight.shape, device=device, generator=gen))
        x_in = torch.randn(64, 512, device=device, dtype=torch.bfloat16, generator=gen)
        partial = linear(x_in)
        assert partial.data_ptr() == tp.peer.buffer.data_ptr()
        want = torch.nn.functional.linear(x_in, linear.weight)
        dist.all_reduce(want)
        summed = tp.all_reduce(partial)
        assert summed.data_ptr() != partial.data_ptr() and torch.equal(summed, want)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            summed = tp.all_reduce(linear(x_in))
        for _ in range(3):
            x_in.copy_(torch.randn(x_in.shape, device=device, generator=gen))
            graph.replay()
            want = torch.nn.functional.linear(x_in, linear.weight)
            dist.all_reduce(want)
            assert torch.equal(summed, want)
        assert tp.partial_sum_out(512, 8192, torch.bfloat16) is not None and tp.partial_sum_out(1024, 8192, torch.bfloat16) is None

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
