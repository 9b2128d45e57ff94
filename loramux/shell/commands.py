"""Handlers of the `loramux` subcommands; each takes the parsed arguments and returns an exit code."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from loraformat.names import parse_ref
from loramux.engine_client import EngineClient, generate_request
from loramux.grpc_server import stop_event_on_signals
from loramux.registry_client import RegistryClient, adapter_json
from loramux.shell.settings import engine_config, http_port, registry_config, tls_files
from loramux.v1 import engine_pb2
from loramux.v1 import registry_pb2 as pb

REMOTE_SCHEMES = ("s3://", "file://")


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _registry_client(args) -> RegistryClient:
    return RegistryClient(args.registry, api_key=args.api_key, tls=tls_files(args))


# ---- servers -------------------------------------------------------------------------------------


def registry_serve(args) -> int:
    from loramux.heap import keep_freed_chunks
    from registry.server import serve

    _setup_logging()
    keep_freed_chunks()  # FetchAdapter's 1 MiB chunks reuse the heap's pages (loramux/heap.py)

    async def main() -> None:
        await serve(registry_config(args), stop_event_on_signals(), metrics_port=args.metrics_port)

    asyncio.run(main())
    return 0


def registry_gc(args) -> int:
    from registry.server import build_service

    service = build_service(registry_config(args), reclaim=False)
    try:
        result = service.collect_garbage(args.grace_s, dry_run=args.dry_run)
    finally:
        service.close()
    verb = "would remove" if args.dry_run else "removed"
    for blob in result.removed:
        print(f"{verb} {blob.digest} ({blob.size} bytes)")
    print(f"{verb} {len(result.removed)} blobs; kept {result.kept_young} younger than {args.grace_s:g}s")
    if not args.dry_run:
        print(f"reclaimed {result.leftovers}")
    return 0


def engine_serve(args) -> int:
    from engine.server import serve

    _setup_logging()

    async def main() -> None:
        config = engine_config(args, args.model, args.port)
        await serve(config, stop_event_on_signals(), metrics_port=args.metrics_port, http_port=http_port(args))

    asyncio.run(main())
    return 0


def generate(args) -> int:
    request = generate_request(
        args.prompt,
        adapter=args.adapter,
        **({"max_new_tokens": args.max_new_tokens} if args.max_new_tokens is not None else {}),
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=args.stop,
        **({"seed": args.seed} if args.seed is not None else {}),
    )
    with EngineClient(args.engine, api_key=args.api_key, tls=tls_files(args)) as client:
        if args.wait:
            client.wait_ready(args.wait)
        for response in client.stream(request):
            if response.WhichOneof("event") == "chunk":
                print(printable(response.chunk.text), end="", flush=True)
            else:
                done = response.complete
                reason = engine_pb2.FinishReason.Name(done.finish_reason).removeprefix("FINISH_REASON_").lower()
                print(f"\n[{reason}, {done.usage.completion_tokens} tokens]", file=sys.stderr)
    return 0


def up(args) -> int:
    from loramux.shell import background
    from loramux.shell.up import run_up

    data_dir = Path(args.data_dir).expanduser()
    if args.detach:
        return background.detach([a for a in args.argv if a != "--detach"], data_dir)
    with background.holding_pid_file(data_dir):
        _setup_logging()
        asyncio.run(run_up(args))
    return 0


def down(args) -> int:
    from loramux.shell import background

    data_dir = Path(args.data_dir).expanduser()
    pid = background.stop(data_dir)
    print(f"stopped loramux up (pid {pid}) of {data_dir}")
    return 0


# ---- registry client commands ------------------------------------------------------------------


def base_models_register(args) -> int:
    model_dir = Path(args.dir)
    name = args.name or model_dir.resolve().name
    with _registry_client(args) as client:
        model = client.register_base_model(name, model_dir)
    print(f"registered base model {model.name}")
    return 0


def base_models_list(args) -> int:
    with _registry_client(args) as client:
        for model in client.list_base_models():
            print(model.name)
    return 0


def adapters_register(args) -> int:
    labels = dict(_parse_label(item) for item in args.label)
    spec = pb.AdapterSpec(
        name=args.name, base_model=args.base_model, pinned=args.pinned, public=args.public, description=args.description, labels=labels
    )
    adapter_dir = None
    if args.dir.startswith(REMOTE_SCHEMES):
        spec.source_uri = args.dir
    else:
        adapter_dir = Path(args.dir)
        if not adapter_dir.is_dir():
            raise ValueError(f"{args.dir} is not a directory")
    with _registry_client(args) as client:
        adapter = client.register_adapter(spec, adapter_dir, progress=_progress_printer("uploading"))
    _clear_progress()
    if args.json:
        print(adapter_json(adapter))
    else:
        print(f"registered {adapter.name}@{adapter.version} digest {adapter.digest[:12]} rank {adapter.rank}")
    return 0


def adapters_list(args) -> int:
    with _registry_client(args) as client:
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
    with _registry_client(args) as client:
        print(adapter_json(client.get(name, version)))
    return 0


def adapters_delete(args) -> int:
    name, version = parse_ref(args.adapter)
    with _registry_client(args) as client:
        for adapter in client.delete(name, version):
            print(f"deleted {adapter.name}@{adapter.version}")
    return 0


def adapters_pin(args) -> int:
    name, version = parse_ref(args.adapter)
    with _registry_client(args) as client:
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
        print(f"\r{verb} {human_bytes(done)} of {human_bytes(total)}", end="", file=sys.stderr, flush=True)

    return show


def _clear_progress() -> None:
    if sys.stderr.isatty():
        print("\r\033[K", end="", file=sys.stderr, flush=True)


# ---- keys and audit --------------------------------------------------------------------------


def keys_create(args) -> int:
    with _registry_client(args) as client:
        created = client.create_key(args.tenant, args.role, args.description)
    k = created.key
    print(f"created key {k.key_id} for tenant {k.tenant} with role {k.role}; it is shown only now:", file=sys.stderr)
    print(created.secret)  # the last line of stdout: scripts take it with `| tail -n 1`
    return 0


def keys_generate(args) -> int:
    from loramux.security import new_key

    print(new_key()[0])
    return 0


def keys_list(args) -> int:
    with _registry_client(args) as client:
        keys = client.list_keys()
    print(f"{'KEY ID':<14} {'TENANT':<24} {'ROLE':<10} {'STATE':<8} DESCRIPTION")
    for k in keys:
        state = "revoked" if k.revoked_at else "valid"
        print(f"{k.key_id:<14} {k.tenant:<24} {k.role:<10} {state:<8} {k.description}")
    return 0


def keys_revoke(args) -> int:
    with _registry_client(args) as client:
        key = client.revoke_key(args.key_id)
    print(f"revoked key {key.key_id} (tenant {key.tenant}, role {key.role})")
    return 0


def audit_list(args) -> int:
    import datetime

    with _registry_client(args) as client:
        entries = client.audit(args.limit)
    print(f"{'TIME (UTC)':<20} {'KEY ID':<14} {'TENANT':<16} {'ACTION':<20} {'OUTCOME':<18} TARGET")
    for e in entries:
        at = datetime.datetime.fromtimestamp(e.at, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
        print(f"{at:<20} {e.key_id or '-':<14} {e.tenant or '-':<16} {e.action:<20} {e.outcome:<18} {e.target}")
    return 0


# Control characters other than newline and tab, as the model may emit them (a random demo model
# does): written raw they ring the terminal's bell or move its cursor.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0))}


def printable(text: str) -> str:
    """Generated text for a terminal: control characters (newline and tab aside) escaped as \\xNN."""
    return text.translate(_CONTROL)


def human_bytes(num_bytes: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes} B"
