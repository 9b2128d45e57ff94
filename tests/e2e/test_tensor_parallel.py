"""`loramux up --tensor-parallel-size 2` as a real process on the CPU (gloo): peft's greedy tokens for
the base model and registry adapters of every kind with fewer slots than adapters; a killed model
worker ends the streams with UNAVAILABLE and the process with a non-zero exit."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import grpc
import pytest

from loramux.engine_client import EngineClient, generate_request
from loramux.testing.procs import Service, run_cli

pytestmark = pytest.mark.slow

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "mixed": dict(r=8, lora_alpha=16, target_modules=ALL, rank_pattern={"down_proj": 12}, alpha_pattern={"v_proj": 4}, seed=71),
    "rs": dict(r=16, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True, seed=72),
    "mlp": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], seed=73),
}
PROMPT = "The quick brown fox jumps over"
NUM_TOKENS = 8


def peft_tokens(model_dir, adapter_dirs) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    from loramux.testing.peft_adapters import load_peft_model

    model, tokenizer = load_peft_model(model_dir, adapter_dirs), AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    out = {}
    for name in ["", *adapter_dirs]:
        generated = model.generate(input_ids=ids, adapter_names=[name or "__base__"], max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False)
        out[name] = generated[0, ids.shape[1] :].tolist()
    return out


def test_up_with_two_ranks_matches_peft_and_a_killed_worker_fails_the_process(tmp_path, tiny_llama_dir, make_adapter):
    dirs = {name: make_adapter(f"tp-{name}", **kwargs) for name, kwargs in ADAPTERS.items()}
    args = [
        "up", "--model", str(tiny_llama_dir), "--data-dir", str(tmp_path), "--registry-port", "0", "--engine-port", "0",
        "--tensor-parallel-size", "2", "--max-loras-per-batch", "2",
    ]  # fmt: skip
    up = Service(args, "registry", also=("engine",))
    try:
        reg = ("--registry", up.address)
        for name, path in dirs.items():
            run_cli("adapters", "register", str(path), "--name", name, *reg)
        expected = peft_tokens(tiny_llama_dir, dirs)
        with EngineClient(up.addresses["engine"]) as client:
            for name in ["", *dirs, ""]:  # three adapters through two slots: an eviction on the way
                request = generate_request(PROMPT, adapter=name, max_new_tokens=NUM_TOKENS, ignore_eos=True)
                assert client.generate(request).token_ids == expected[name], name
            [pid] = [int(m) for m in re.findall(r"model worker rank 1 started \(pid (\d+)\)", "".join(up.stderr))]
            stream = client.stream(generate_request("long", max_new_tokens=400, ignore_eos=True))
            next(stream)
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as info:
                list(stream)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "model worker rank 1" in info.value.details()
        assert up.proc.wait(120) != 0
        assert "engine failed: model worker rank 1" in "".join(up.stderr)
    finally:
        if up.proc.poll() is None:
            up.kill()


def _gone(pid: int) -> bool:
    """The process exited (reaped, or a zombie waiting for a reaper that is not its old parent)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def test_ctrl_c_stops_every_worker(tiny_llama_dir):
    engine = Service(["engine", "serve", "--model", str(tiny_llama_dir), "--port", "0", "--tensor-parallel-size", "2"], "engine")
    try:
        with EngineClient(engine.address) as client:
            assert len(client.generate(generate_request("Hello", max_new_tokens=3, ignore_eos=True)).token_ids) == 3
        [pid] = [int(m) for m in re.findall(r"model worker rank 1 started \(pid (\d+)\)", "".join(engine.stderr))]
        assert not _gone(pid)
        assert engine.interrupt() == 0
        assert _gone(pid)  # the front stopped its worker before it exited
    finally:
        engine.kill()
