"""`loramux up`: the registry and the engine on one machine with no outside services.

SQLite and a local object directory under --data-dir, and the built-in demo model (random weights,
a real tokenizer) when no --model is given. The engine's model is registered as the registry's base
model. Ctrl-C stops both gracefully.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from engine.server import start_engine
from loramux.commands import engine_config
from loramux.grpc_server import announce, stop_event_on_signals
from registry.config import RegistryConfig
from registry.server import RegistryServer, build_service

log = logging.getLogger(__name__)
DEMO_MODEL_NAME = "loramux-demo"


def ensure_demo_model(data_dir: Path) -> Path:
    """Write the demo checkpoint once under data_dir/models and return its directory."""
    from loramux.demo_model import write_llama_checkpoint

    model_dir = data_dir / "models" / DEMO_MODEL_NAME
    if not (model_dir / "config.json").is_file():
        write_llama_checkpoint(model_dir)
    return model_dir


async def run_up(args) -> None:
    data_dir = Path(args.data_dir).expanduser()
    model_dir = Path(args.model) if args.model else await asyncio.to_thread(ensure_demo_model, data_dir)
    base_name = model_dir.resolve().name
    stop = stop_event_on_signals()
    config = RegistryConfig(data_dir=data_dir, port=args.registry_port, max_lora_rank=args.max_lora_rank)
    registry = RegistryServer(config, await asyncio.to_thread(build_service, config))
    config_json = (model_dir / "config.json").read_text()
    await asyncio.to_thread(registry.service.register_base_model, base_name, config_json)
    await registry.start()
    announce("registry", config.host, registry.port)
    engine = await start_engine(engine_config(args, str(model_dir), args.engine_port, registry=registry.address))
    announce("engine", engine.config.host, engine.port)
    print(f"base model {base_name} from {model_dir}", flush=True)
    print(f"try: loramux generate --engine {engine.address} 'Once upon a time'", flush=True)
    await stop.wait()
    log.info("shutting down")
    await engine.stop()
    await registry.stop()
