"""Handlers of the `loramux` subcommands; each takes the parsed arguments and returns an exit code."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from engine.adapters import parse_adapter_spec
from engine.config import EngineConfig
from loramux.engine_client import EngineClient, generate_request
from loramux.grpc_server import stop_event_on_signals
from loramux.registry_client import RegistryClient, adapter_json
from loramux.v1 import engine_pb2
from loramux.v1 import registry_pb2 as pb
from registry.config import RegistryConfig
from registry.types import parse_ref

REMOTE_SCHEMES = ("s3://", "file://")


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _registry_config(args, host: str = "127.0.0.1", port: int = 0) -> RegistryConfig:
    return RegistryConfig(
        data_dir=Path(args.data_dir).expanduser(),
        host=getattr(args, "host", host),
        port=getattr(args, "port", port),
        database_url=args.database_url,
        object_store=args.object_store,
        max_lora_rank=getattr(args, "max_lora_rank", RegistryConfig.max_lora_rank),
        max_upload_bytes=getattr(args, "max_upload_bytes", RegistryConfig.max_upload_bytes),
        import_allow_dirs=tuple(Path(d).resolve() for d in getattr(args, "import_allow_dir", [])),
        import_s3_endpoint_url=getattr(args, "import_s3_endpoint_url", ""),
    )


# ---- servers -------------------------------------------------------------------------------------


def registry_serve(args) -> int:
    from registry.server import serve

    _setup_logging()

    async def main() -> None:
        await serve(_registry_config(args), stop_event_on_signals(), metrics_port=args.metrics_port)

    asyncio.run(main())
    return 0


def registry_gc(args) -> int:
    from registry.server import build_service

    service = build_service(_registry_config(args))
    result = service.collect_garbage(args.grace_s, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for blob in result.removed:
        print(f"{verb} {blob.digest} ({blob.size} bytes)")
    print(f"{verb} {len(result.removed)} blobs; kept {result.kept_young} younger than {args.grace_s:g}s")
    return 0


def engine_config(args, model_dir: str, port: int, registry: str = "") -> EngineConfig:
    return EngineConfig(
        model_dir=model_dir,
        base_model_name=getattr(args, "base_model_name", ""),
        host=getattr(args, "host", "127.0.0.1"),
        port=port,
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        num_kv_slots=args.num_kv_slots,
        max_context=args.max_context,
        max_running_requests=args.max_running_requests,
        max_batch_tokens=args.max_batch_tokens,
        max_queued_requests=args.max_queued_requests,
        attention_backend=args.attention_backend,
        cuda_graph_max_batch=args.cuda_graph_max_batch,
        adapters=tuple(parse_adapter_spec(spec) for spec in getattr(args, "adapter", [])),
        max_loras_per_batch=args.max_loras_per_batch,
        max_lora_rank=args.max_lora_rank,
        max_host_adapters=args.max_host_adapters,
        lora_eviction_policy=args.lora_eviction_policy,
        lora_drain_wait_s=args.lora_drain_wait_s,
        lora_backend=args.lora_backend,
        registry=registry or getattr(args, "registry", ""),
        tensor_parallel_size=args.tensor_parallel_size,
    )


def engine_serve(args) -> int:
    from engine.server import serve

    _setup_logging()

    async def main() -> None:
        await serve(engine_config(args, args.model, args.port), stop_event_on_signals(), metrics_port=args.metrics_port)

    asyncio.run(main())
    return 0


def generate(args) -> int:
    request = generate_request(
        args.prompt,
        adapter=args.adapter,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=args.stop,
        **({"seed": args.seed} if args.seed is not None else {}),
    )
    with EngineClient(args.engine) as client:
        if args.wait:
            client.wait_ready(args.wait)
        for response in client.stream(request):
            if response.WhichOneof("event") == "chunk":
                print(response.chunk.text, end="", flush=True)
            else:
                done = response.complete
                reason = engine_pb2.FinishReason.Name(done.finish_reason).removeprefix("FINISH_REASON_").lower()
                print(f"\n[{reason}, {done.usage.completion_tokens} tokens]", file=sys.stderr)
    return 0


def up(args) -> int:
    from loramux.up import run_up

    _setup_logging()
    asyncio.run(run_up(args))
    return 0


# ---- registry client commands ------------------------------------------------------------------


def base_models_register(args) -> int:
    model_dir = Path(args.dir)
    name = args.name or model_dir.resolve().name
    with RegistryClient(args.registry) as client:
        model = client.register_base_model(name, model_dir)
    print(f"registered base model {model.name}")
    return 0


def base_models_list(args) -> int:
    with RegistryClient(args.registry) as client:
        for model in client.list_base_models():
            print(model.name)
    return 0


def adapters_register(args) -> int:
    labels = dict(_parse_label(item) for item in args.label)
    spec = pb.AdapterSpec(
        name=args.name, base_model=args.base_model, pinned=args.pinned, description=args.description, labels=labels
    )
    adapter_dir = None
    if args.dir.startswith(REMOTE_SCHEMES):
        spec.source_uri = args.dir
    else:
        adapter_dir = Path(args.dir)
        if not adapter_dir.is_dir():
            raise ValueError(f"{args.dir} is not a directory")
    with RegistryClient(args.registry) as client:
        adapter = client.register_adapter(spec, adapter_dir, progress=_progress_printer("uploading"))
    _clear_progress()
    if args.json:
        print(adapter_json(adapter))
    else:
        print(f"registered {adapter.name}@{adapter.version} digest {adapter.digest[:12]} rank {adapter.rank}")
    return 0


def adapters_list(args) -> int:
    with RegistryClient(args.registry) as client:
        adapters = list(client.list(args.base_model, args.prefix, latest_only=not args.all_versions))
    if args.json:
        print("[" + ",\n".join(adapter_json(a) for a in adapters) + "]")
        return 0
    print(f"{'ADAPTER':<40} {'BASE MODEL':<20} {'RANK':>4} {'PINNED':<6} DIGEST")
    for a in adapters:
        print(f"{a.name + '@' + str(a.version):<40} {a.base_model:<20} {a.rank:>4} {a.pinned!s:<6} {a.digest[:12]}")
    return 0


def adapters_show(args) -> int:
    name, version = parse_ref(args.adapter)
    with RegistryClient(args.registry) as client:
        print(adapter_json(client.get(name, version)))
    return 0


def adapters_delete(args) -> int:
    name, version = parse_ref(args.adapter)
    with RegistryClient(args.registry) as client:
        for adapter in client.delete(name, version):
            print(f"deleted {adapter.name}@{adapter.version}")
    return 0


def adapters_pin(args) -> int:
    name, version = parse_ref(args.adapter)
    with RegistryClient(args.registry) as client:
        adapter = client.set_pinned(name, version, args.pinned)
    print(f"{adapter.name}@{adapter.version} pinned={str(adapter.pinned).lower()}")
    return 0


def _parse_label(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ValueError(f"--label {item!r}: expected KEY=VALUE")
    return key, value


def _progress_printer(verb: str):
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        print(f"\r{verb} {done / 1e6:.1f}/{total / 1e6:.1f} MB", end="", file=sys.stderr, flush=True)

    return show


def _clear_progress() -> None:
    if sys.stderr.isatty():
        print("\r\033[K", end="", file=sys.stderr, flush=True)
