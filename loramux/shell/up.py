"""`loramux up`: the registry and the engine on one machine with no outside services.

SQLite and a local object directory under --data-dir, and the built-in demo model (random weights,
a real tokenizer) when no --model is given. The engine's model is registered as the registry's base
model. Ctrl-C stops both gracefully.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from pathlib import Path

from engine.server import start_engine, stop_on_failure
from loramux.grpc_server import stop_event_on_signals
from loramux.metrics import start_metrics_server
from loramux.ready import announce
from loramux.security import Role
from loramux.shell.background import READY_PREFIX, cli_name
from loramux.shell.settings import engine_config, http_port, registry_config
from registry.access import AccessStore
from registry.errors import NotFound
from registry.server import SYSTEM, RegistryServer, build_service

log = logging.getLogger(__name__)
DEMO_MODEL_NAME = "loramux-demo"
DEMO_ADAPTER_DIR = "demo-adapter"
ENGINE_KEY_FILE = "engine.key"


def ensure_demo_model(data_dir: Path) -> Path:
    """Write the demo checkpoint and a demo PEFT adapter of it once under data_dir; returns the model dir."""
    from loramux.demo_model import write_demo_adapter, write_llama_checkpoint

    model_dir = data_dir / "models" / DEMO_MODEL_NAME
    if not (model_dir / "config.json").is_file():
        write_llama_checkpoint(model_dir)
    if not (data_dir / DEMO_ADAPTER_DIR / "adapter_config.json").is_file():
        write_demo_adapter(data_dir / DEMO_ADAPTER_DIR, model_dir)
    return model_dir


def ensure_engine_key(access: AccessStore, data_dir: Path) -> str:
    """The embedded engine's own key (role engine), kept in DATA_DIR/engine.key (mode 0600); a key
    revoked meanwhile is replaced."""
    path = data_dir / ENGINE_KEY_FILE
    if path.exists() and access.authenticate(path.read_text().strip()) is None:
        path.unlink()
    access.ensure_key_file(path, "engine", Role.ENGINE, SYSTEM)
    return path.read_text().strip()


def curl_line(engine, model: str) -> str:
    """A ready-to-paste OpenAI-style call to the engine's HTTP front."""
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 16})
    url = f"http://{engine.http.host}:{engine.http.port}/v1/completions"
    return f"curl -s {url} -H 'Content-Type: application/json' -d '{body}'"


def _hints(args, data_dir: Path, registry, engine, base_name: str) -> list[str]:
    """What to try next, with the executable as it was run, never suggesting what is already done."""
    exe = cli_name()
    lines = []
    if not args.model:
        try:
            registry.service.catalog.get("demo")
        except NotFound:
            lines.append(f"{exe} adapters register {data_dir / DEMO_ADAPTER_DIR} --name demo --registry {registry.address}")
        lines.append(f"{exe} generate --engine {engine.address} --adapter demo 'Once upon a time'")
    else:
        lines.append(f"{exe} generate --engine {engine.address} 'Once upon a time'")
    if engine.http is not None:
        lines.append(curl_line(engine, "demo" if not args.model else base_name))
    return ["try: " + lines[0], *("     " + line for line in lines[1:])]


async def run_up(args) -> None:
    data_dir = Path(args.data_dir).expanduser()
    model_dir = Path(args.model) if args.model else await asyncio.to_thread(ensure_demo_model, data_dir)
    base_name = model_dir.resolve().name
    stop = stop_event_on_signals()
    config = dataclasses.replace(registry_config(args), host="127.0.0.1", port=args.registry_port)
    registry = RegistryServer(config, await asyncio.to_thread(build_service, config))
    engine_key = await asyncio.to_thread(ensure_engine_key, registry.service.access, data_dir) if config.auth else ""
    config_json = (model_dir / "config.json").read_text()
    await asyncio.to_thread(registry.service.register_base_model, base_name, config_json)
    await registry.start()
    announce("registry", config.host, registry.port)
    engine_settings = engine_config(args, str(model_dir), args.engine_port, registry=registry.address)
    engine = await start_engine(dataclasses.replace(engine_settings, api_key=engine_key))
    if http_port(args) is not None:
        await engine.start_http(http_port(args))
    metrics_server = None
    if args.metrics_port is not None:
        metrics_server, _ = start_metrics_server([registry.metrics, engine.metrics], config.host, args.metrics_port)
    announce("engine", engine.config.host, engine.port)
    print(f"base model {base_name} from {model_dir}", flush=True)
    if config.auth:
        key_file = config.resolved_admin_key_file
        print(f"auth on: the admin key is in {key_file}; export LORAMUX_API_KEY=$(cat {key_file})", flush=True)
    for line in await asyncio.to_thread(_hints, args, data_dir, registry, engine, base_name):
        print(line, flush=True)
    print(f"{READY_PREFIX} (Ctrl-C stops it)", flush=True)
    relay = stop_on_failure(engine, stop)
    await stop.wait()
    relay.cancel()
    log.info("shutting down")
    await engine.stop()
    await registry.stop()
    if metrics_server is not None:
        await asyncio.to_thread(metrics_server.shutdown)
    if engine.failure is not None:
        raise SystemExit(f"engine failed: {engine.failure}")
