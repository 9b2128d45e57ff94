"""`loramux registry serve` and `loramux up` as real processes, driven by the CLI, gRPC and grpcurl."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest

from loramux.engine_client import EngineClient, generate_request
from loramux.registry_client import RegistryClient
from loramux.testing.procs import Service, run_cli
from tests.registry.backends import fresh_postgres_database

pytestmark = pytest.mark.slow


def grpcurl(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    return subprocess.run([exe, "-plaintext", *args], capture_output=True, text=True, timeout=60)


def test_registry_process_with_cli_grpc_and_grpcurl(tmp_path, tiny_llama_dir, make_adapter):
    adapter_dir = make_adapter("cli-qv", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    other_dir = make_adapter("cli-mlp", r=4, lora_alpha=4, target_modules=["down_proj"], seed=3)
    data = tmp_path / "data"
    server = Service(["registry", "serve", "--port", "0", "--data-dir", str(data)], "registry")
    try:
        reg = ("--registry", server.address)
        run_cli("base-models", "register", str(tiny_llama_dir), "--name", "tiny", *reg)
        out = run_cli("adapters", "register", str(adapter_dir), "--name", "bot", "--label", "team=x", "--json", *reg).stdout
        registered = json.loads(out)
        assert registered["version"] == 1 and registered["rank"] == 8 and registered["labels"] == {"team": "x"}
        run_cli("adapters", "register", str(other_dir), "--name", "bot", *reg)
        listing = run_cli("adapters", "list", "--all-versions", *reg).stdout
        assert "bot@1" in listing and "bot@2" in listing
        shown = json.loads(run_cli("adapters", "show", "bot@1", *reg).stdout)
        assert shown["digest"] == registered["digest"]
        assert "pinned=true" in run_cli("adapters", "pin", "bot", *reg).stdout
        assert "pinned=false" in run_cli("adapters", "unpin", "bot", *reg).stdout

        with RegistryClient(server.address) as client:
            adapter, artifact = client.fetch("bot", 1)
        assert hashlib.sha256(artifact).hexdigest() == adapter.digest == registered["digest"]

        services = grpcurl(server.address, "list").stdout.split()
        assert {"loramux.v1.Registry", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(services)
        health = grpcurl("-d", '{"service": "loramux.v1.Registry"}', server.address, "grpc.health.v1.Health/Check")
        assert json.loads(health.stdout)["status"] == "SERVING"
        listed = grpcurl("-d", '{"name_prefix": "bo", "latest_only": true}', server.address, "loramux.v1.Registry/ListAdapters")
        assert [a["version"] for a in json.loads(listed.stdout)["adapters"]] == [2]
        missing = grpcurl("-d", '{"name": "nope"}', server.address, "loramux.v1.Registry/GetAdapter")
        assert missing.returncode != 0 and "NotFound" in missing.stderr

        failed = run_cli("adapters", "show", "nope@3", *reg, check=False)
        assert failed.returncode == 1
        assert failed.stderr.strip() == "error: NOT_FOUND: adapter 'nope@3' is not registered"
        assert "Traceback" not in failed.stderr
        bad_name = run_cli("adapters", "show", "Bad Name", *reg, check=False)
        assert bad_name.returncode == 1 and bad_name.stderr.startswith("error: INVALID_ARGUMENT")

        assert "deleted bot@2" in run_cli("adapters", "delete", "bot@2", *reg).stdout
    finally:
        code = server.interrupt()
    assert code == 0, "".join(server.stderr)[-2000:]

    gc = run_cli("registry", "gc", "--data-dir", str(data), "--grace-s", "0").stdout
    assert "removed 1 blobs" in gc

    again = Service(["registry", "serve", "--port", "0", "--data-dir", str(data)], "registry")
    try:
        with RegistryClient(again.address) as client:
            assert [(a.name, a.version) for a in client.list()] == [("bot", 1)]
            adapter, artifact = client.fetch("bot")
            assert hashlib.sha256(artifact).hexdigest() == adapter.digest
    finally:
        assert again.interrupt() == 0


def test_registry_process_on_postgres_and_s3(tmp_path, tiny_llama_dir, make_adapter, s3_endpoint, s3_bucket):
    adapter_dir = make_adapter("pg-s3", r=4, lora_alpha=8)
    with fresh_postgres_database() as db_url:
        args = ["registry", "serve", "--port", "0", "--data-dir", str(tmp_path), "--database-url", db_url]
        args += ["--object-store", f"s3://{s3_bucket}/loramux?endpoint_url={s3_endpoint}"]
        server = Service(args, "registry")
        try:
            reg = ("--registry", server.address)
            run_cli("base-models", "register", str(tiny_llama_dir), "--name", "tiny", *reg)
            registered = json.loads(run_cli("adapters", "register", str(adapter_dir), "--name", "pg", "--json", *reg).stdout)
            with RegistryClient(server.address) as client:
                adapter, artifact = client.fetch("pg")
            assert hashlib.sha256(artifact).hexdigest() == registered["digest"] == adapter.digest
        finally:
            assert server.interrupt() == 0


def test_loramux_up_serves_the_demo_model_and_adapter(tmp_path):
    """The README's first command: up, a generation, the demo adapter registered, a generation with it."""
    args = ["up", "--data-dir", str(tmp_path), "--registry-port", "0", "--engine-port", "0", "--metrics-port", "0", "--http-port", "0"]
    up = Service(args, "registry", also=("engine", "metrics"))
    try:
        reg, eng = ("--registry", up.address), ("--engine", up.addresses["engine"])
        assert run_cli("base-models", "list", *reg).stdout.split() == ["loramux-demo"]
        base = run_cli("generate", *eng, "--wait", "60", "--max-new-tokens", "8", "Once upon a time")
        assert base.stdout.strip() and "8 tokens]" in base.stderr
        out = run_cli("adapters", "register", str(tmp_path / "demo-adapter"), "--name", "demo", *reg).stdout
        assert out.startswith("registered demo@1")
        tuned = run_cli("generate", *eng, "--adapter", "demo", "--max-new-tokens", "8", "Once upon a time")
        assert "8 tokens]" in tuned.stderr and tuned.stdout != base.stdout
        metrics = urllib.request.urlopen(f"http://{up.addresses['metrics']}/metrics", timeout=10).read().decode()
        assert 'loramux_engine_requests_total{adapter="demo",outcome="length"} 1.0' in metrics
        assert "loramux_registry_adapters_registered_total 1.0" in metrics
        assert 'vllm:num_requests_waiting{model_name="loramux-demo"}' in metrics  # the model-server protocol too
        # Ctrl-C with a stream in flight: the stream ends with an error status, the process exits 0
        with EngineClient(up.addresses["engine"]) as client:
            stream = client.stream(generate_request("long", max_new_tokens=480, ignore_eos=True))
            next(stream)
            up.proc.send_signal(signal.SIGINT)
            with pytest.raises(grpc.RpcError) as info:
                list(stream)
            assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    finally:
        assert up.interrupt() == 0
    again = Service(args, "registry", also=("engine", "metrics"))  # the next start finds the adapter again
    try:
        listed = run_cli("adapters", "list", "--registry", again.address).stdout
        assert "demo@1" in listed
    finally:
        assert again.interrupt() == 0


def test_engine_process_with_cli_and_grpcurl(tiny_llama_dir, make_adapter):
    adapter = make_adapter("proc-qv", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=5)
    args = ["engine", "serve", "--model", str(tiny_llama_dir), "--port", "0", "--adapter", f"qv={adapter}", "--http-port", "0"]
    engine = Service(args, "engine", also=("http",))
    try:
        with_adapter = run_cli("generate", "--engine", engine.address, "--adapter", "qv@1", "--max-new-tokens", "5", "Hello")
        assert "[length, 5 tokens]" in with_adapter.stderr
        out = run_cli("generate", "--engine", engine.address, "--max-new-tokens", "5", "Hello")
        assert out.stdout and "[length, 5 tokens]" in out.stderr
        services = grpcurl(engine.address, "list").stdout.split()
        assert {"loramux.v1.Engine", "grpc.health.v1.Health"} <= set(services)
        health = grpcurl("-d", '{"service": "loramux.v1.Engine"}', engine.address, "grpc.health.v1.Health/Check")
        assert json.loads(health.stdout)["status"] == "SERVING"
        body = '{"text": "Hi", "sampling": {"max_new_tokens": 3, "ignore_eos": true}}'
        streamed = grpcurl("-d", body, engine.address, "loramux.v1.Engine/Generate")
        messages = [json.loads(m) for m in streamed.stdout.replace("}\n{", "}\x00{").split("\x00") if m.strip()]
        assert [next(iter(m)) for m in messages] == ["chunk", "chunk", "chunk", "complete"]
        bad = grpcurl("-d", '{"text": "Hi", "adapter": "nope"}', engine.address, "loramux.v1.Engine/Generate")
        assert bad.returncode != 0 and "NotFound" in bad.stderr
        missing = run_cli("generate", "--engine", engine.address, "--adapter", "nope", "Hi", check=False)
        assert missing.returncode == 1 and missing.stderr.startswith("error: NOT_FOUND")
        # the same engine over its OpenAI-compatible HTTP port: local adapters are listed and served
        http = f"http://{engine.addresses['http']}"
        models = json.loads(urllib.request.urlopen(f"{http}/v1/models", timeout=30).read())
        assert [(m["id"], m["parent"]) for m in models["data"]] == [(tiny_llama_dir.name, None), ("qv", tiny_llama_dir.name)]
        body = json.dumps({"model": "qv@1", "prompt": "Hello", "max_tokens": 5, "temperature": 0}).encode()
        request = urllib.request.Request(f"{http}/v1/completions", body, {"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert reply["choices"][0]["text"] == with_adapter.stdout.rstrip("\n") and reply["usage"]["completion_tokens"] == 5
    finally:
        assert engine.interrupt() == 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_first_command_then_down(tmp_path):
    """The README's first command as written (after its install step), on free ports and a fresh HOME:
    `up --detach` returns once ready, the clients run, `loramux down` stops it and frees the ports."""
    import os
    import re as regex

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    first = regex.search(r"```bash\n(.*?)\n```", readme, flags=regex.S).group(1)
    command = first[first.index(".venv/bin/loramux up --detach"):]
    bin_dir = str(Path(sys.executable).parent) + "/"
    ports = {name: _free_port() for name in ("REGISTRY_PORT", "ENGINE_PORT", "HTTP_PORT")}
    command = command.replace(".venv/bin/", bin_dir).replace("127.0.0.1:8000", f"127.0.0.1:{ports['HTTP_PORT']}")
    env = {**os.environ, "HOME": str(tmp_path), "NO_PROXY": "127.0.0.1,localhost"}
    env.update({f"LORAMUX_{name}": str(port) for name, port in ports.items()})
    env["LORAMUX_REGISTRY"] = f"127.0.0.1:{ports['REGISTRY_PORT']}"
    env["LORAMUX_ENGINE"] = f"127.0.0.1:{ports['ENGINE_PORT']}"
    data_dir = tmp_path / ".loramux"
    try:
        proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=900)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "loramux is up in the background" in proc.stdout and '"choices"' in proc.stdout
        assert "INFO" not in proc.stdout + proc.stderr  # server logs go to the log file, not the terminal
        assert (data_dir / "loramux.pid").is_file()
    finally:
        down = subprocess.run([bin_dir + "loramux", "down", "--data-dir", str(data_dir)], capture_output=True,
                              text=True, env=env, timeout=120)
    assert down.returncode == 0 and "stopped loramux up" in down.stdout, down.stderr
    assert not (data_dir / "loramux.pid").exists()
    again = subprocess.run([bin_dir + "loramux", "down", "--data-dir", str(data_dir)], capture_output=True, text=True, env=env)
    assert again.returncode == 1 and again.stderr.strip() == f"error: no loramux up is running for {data_dir}"
