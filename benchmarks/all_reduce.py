"""All-reduce latency on two or more GPUs of one host: NCCL against the one-shot peer-memory path
(`engine.parallel.PeerAllReduce`), for the hidden states a tensor-parallel step reduces.

    python benchmarks/all_reduce.py [--ranks 2] [--hidden 8192] [--rows 1 32 64 128 512]

For each row count it prints one JSON line: microseconds a call, eager and replayed from a CUDA graph of
`--calls` calls (the way decode steps run), for both paths, and whether the two sums agree exactly.
Rows above the peer buffer (8 MiB) are NCCL's alone, as in the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.parallel import PeerAllReduce, TensorParallel


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed_us(fn, calls: int, graph: bool) -> float:
    """Mean microseconds a call over `calls` calls: launched one by one, or captured once and replayed."""
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up outside the capture (NCCL's and the kernel's lazy set-up)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        run = g.replay
    else:
        def run():
            for _ in range(calls):
                fn()
    run()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (10 * calls)


def rank_main(rank: int, ranks: int, port: int, hidden: int, rows: list[int], calls: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=ranks, device_id=device)
    tp = TensorParallel(rank, ranks).with_peer_all_reduce(device)
    assert tp.peer is not None, "the peer all-reduce is not available here"
    for n in rows:
        x = torch.randn(n, hidden, device=device, dtype=torch.bfloat16, generator=torch.Generator(device).manual_seed(rank))
        nccl_sum, peer_sum = x.clone(), x.clone()
        dist.all_reduce(nccl_sum)
        fits = tp.peer.fits(peer_sum)
        if fits:
            tp.peer(peer_sum)
        work = x.clone()
        row = {"rows": n, "hidden": hidden, "bytes": x.numel() * 2, "ranks": ranks}
        row["nccl_eager_us"] = timed_us(lambda work=work: dist.all_reduce(work), calls, graph=False)
        row["nccl_graph_us"] = timed_us(lambda work=work: dist.all_reduce(work), calls, graph=True)
        if fits:
            row["equal"] = bool(torch.equal(nccl_sum, peer_sum))
            row["peer_eager_us"] = timed_us(lambda work=work: tp.peer(work), calls, graph=False)
            row["peer_graph_us"] = timed_us(lambda work=work: tp.peer(work), calls, graph=True)
            row["graph_speedup"] = row["nccl_graph_us"] / row["peer_graph_us"]
        if rank == 0:
            print(json.dumps(row), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 512, 2048])
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    if torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"needs {args.ranks} CUDA devices, found {torch.cuda.device_count()}")
    mp.spawn(rank_main, args=(args.ranks, free_port(), args.hidden, args.rows, args.calls), nprocs=args.ranks)
    print(json.dumps({"peer_buffer_bytes": PeerAllReduce.MAX_BYTES, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
