"""Register and fetch a Llama-3-8B-shaped rank-16 adapter (all seven projections, bf16, ~84 MB)
through a real `loramux registry serve` process on loopback; prints MB/s each way.

    python benchmarks/registry_transfer.py [--repeats 3] [--rank 16]

Register time covers the whole RPC: upload, validation, compilation, the blob write and the row
commit. Fetch time covers streaming the canonical artifact to this process: through the blocking client
(`loramux.registry_client`), and through the engine's own path (`engine.registry_link`, grpc.aio, each
chunk sha256-checked as it arrives), which cold serving waits on. Both clients time warm connections (an
engine opens its link at start and keeps it).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.registry_link import RegistryLink, record_of
from loraformat.model_shapes import SUPPORTED_MODULES, ModelShape
from loramux.demo_model import LLAMA3_8B_CONFIG
from loramux.registry_client import RegistryClient
from loramux.testing.procs import Service
from loramux.v1 import registry_pb2 as pb

PEFT_PREFIX = "base_model.model.model.layers"


def write_peft_adapter(out: Path, shape: ModelShape, rank: int, seed: int, modules: tuple[str, ...] = SUPPORTED_MODULES) -> int:
    """A PEFT-format adapter of `modules` with random bf16 weights; returns the weights file's size."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape.num_layers):
        for module in modules:
            in_dim, out_dim = shape.module_dims(module)
            parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            name = f"{PEFT_PREFIX}.{layer}.{parent}.{module}"
            tensors[f"{name}.lora_A.weight"] = (torch.randn(rank, in_dim, generator=gen) * 0.01).bfloat16()
            tensors[f"{name}.lora_B.weight"] = (torch.randn(out_dim, rank, generator=gen) * 0.01).bfloat16()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules)}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return (out / "adapter_model.safetensors").stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    shape = ModelShape.from_config(LLAMA3_8B_CONFIG)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "model").mkdir()
        (root / "model" / "config.json").write_text(json.dumps(LLAMA3_8B_CONFIG))
        dirs = [root / f"adapter{i}" for i in range(args.repeats)]
        sizes = [write_peft_adapter(d, shape, args.rank, seed=i) for i, d in enumerate(dirs)]
        server = Service(["registry", "serve", "--port", "0", "--data-dir", str(root / "data")], "registry")
        try:
            report(run(server.address, root / "model", dirs), sizes)
        finally:
            server.interrupt()


def run(address: str, model_dir: Path, dirs: list[Path]) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"register": [], "fetch": [], "engine_fetch": [], "artifact_bytes": []}
    adapters: list[pb.Adapter] = []
    with RegistryClient(address) as client:
        client.register_base_model("llama3-8b", model_dir)
        for i, adapter_dir in enumerate(dirs):
            start = time.perf_counter()
            adapter = client.register_adapter(pb.AdapterSpec(name=f"bench-{i}"), adapter_dir)
            times["register"].append(time.perf_counter() - start)
            start = time.perf_counter()
            fetched, artifact = client.fetch(adapter.name)
            times["fetch"].append(time.perf_counter() - start)
            assert hashlib.sha256(artifact).hexdigest() == fetched.digest
            times["artifact_bytes"].append(len(artifact))
            adapters.append(fetched)
    times["engine_fetch"] = asyncio.run(engine_fetches(address, adapters))
    return times


async def engine_fetches(address: str, adapters: list[pb.Adapter]) -> list[float]:
    """Seconds the engine's registry link takes to fetch and check each adapter's artifact, over one
    link whose connection is warm (as an engine's is: it opens the link at start and keeps it), like
    the blocking client's above; the untimed first fetch opens it."""
    link = RegistryLink(address, adapters[0].base_model, "{}", on_event=lambda event: None)
    seconds = []
    try:
        await link.fetch(record_of(adapters[0]))
        for adapter in adapters:
            start = time.perf_counter()
            artifact = await link.fetch(record_of(adapter))
            seconds.append(time.perf_counter() - start)
            assert len(artifact) == adapter.size_bytes
    finally:
        await link.close()
    return seconds


def report(times: dict[str, list[float]], upload_sizes: list[int]) -> None:
    upload_mb = statistics.median(upload_sizes) / 1e6
    artifact_mb = statistics.median(times["artifact_bytes"]) / 1e6
    register_s = statistics.median(times["register"])
    fetch_s = statistics.median(times["fetch"])
    engine_s = statistics.median(times["engine_fetch"])
    print(f"upload {upload_mb:.1f} MB, artifact {artifact_mb:.1f} MB, {len(upload_sizes)} runs, medians:")
    print(f"register: {register_s * 1e3:.0f} ms = {upload_mb / register_s:.0f} MB/s")
    print(f"fetch:    {fetch_s * 1e3:.0f} ms = {artifact_mb / fetch_s:.0f} MB/s")
    print(f"engine fetch (sha256-checked): {engine_s * 1e3:.0f} ms = {artifact_mb / engine_s:.0f} MB/s")


if __name__ == "__main__":
    main()
