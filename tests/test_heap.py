"""loramux/heap.py: the registry's server and the engine's fetch process reuse their heap's pages for
the 1 MiB chunks they stream, where glibc by default faulted fresh pages in for about every chunk (the
registry about 300 page faults a MB fetched, the fetch process about 170, on the 2-core VM)."""

import json
import platform
import subprocess
import sys

import pytest

from benchmarks.fetch_contention import process_usage
from benchmarks.registry_transfer import write_peft_adapter
from engine.fetch_process import fetch_process_supported
from engine.named_shapes import LLAMA3_8B_CONFIG
from engine.registry_link import RegistryLink, record_of
from loraformat.model_shapes import ModelShape
from loramux.registry_client import RegistryClient
from loramux.testing.procs import Service
from loramux.v1 import registry_pb2 as pb

MAX_FAULTS_PER_MB = 80  # measured 22 (fetch process) and 6 (registry) with the settings, 255 and 377 without


async def _ignore(kind, record):
    pass


@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or not fetch_process_supported(), reason="glibc's heap, the fetch process (Linux)"
)
async def test_streaming_chunks_reuses_the_heaps_pages(tmp_path):
    config = dict(LLAMA3_8B_CONFIG, num_hidden_layers=8)  # a 3.4 MB artifact of q/v at rank 16
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    write_peft_adapter(tmp_path / "adapter", ModelShape.from_config(config), 16, seed=0, modules=("q_proj", "v_proj"))
    registry = Service(["registry", "serve", "--port", "0", "--data-dir", str(tmp_path / "data")], "registry")
    try:
        with RegistryClient(registry.address) as client:
            client.register_base_model("heap", tmp_path / "model")
            adapter = client.register_adapter(pb.AdapterSpec(name="heap"), tmp_path / "adapter")
        link = RegistryLink(registry.address, "heap", "{}", _ignore)
        try:
            await link.fetch(record_of(adapter))  # warm: both heaps grow once
            child = link.process.pid
            before = process_usage(child)[1], process_usage(registry.proc.pid)[1]  # minor page faults
            fetched = 0
            for _ in range(40):
                fetched += len(await link.fetch(record_of(adapter)))
            after = process_usage(child)[1], process_usage(registry.proc.pid)[1]
        finally:
            await link.close()
    finally:
        registry.interrupt()
    per_mb = [(b - a) / (fetched / 1e6) for a, b in zip(before, after, strict=True)]
    assert fetched > 130e6 and all(n < MAX_FAULTS_PER_MB for n in per_mb), per_mb


def test_keep_freed_chunks_says_where_it_applies():
    code = "from loramux.heap import keep_freed_chunks; print(keep_freed_chunks())"  # not in this process's heap
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60).stdout
    assert out.strip() == str(platform.libc_ver()[0] == "glibc")
