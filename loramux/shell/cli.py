"""The `loramux` command line. Settings come from flags or LORAMUX_* variables, read here once."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

import grpc

from engine.config import (
    DECODE_FUSED_TARGETS,
    DEFAULT_ADAPTER_PREP_THREADS,
    DEFAULT_ENGINE_PORT,
    DEFAULT_FETCH_PROCESSES,
    DEFAULT_HTTP_PORT,
    DEFAULT_LORA_DRAIN_WAIT_S,
    DEFAULT_LORA_LOAD_AHEAD,
    DEFAULT_LORA_SM_CARVEOUT,
    LINEAR_WEIGHT_LAYOUTS,
    LORA_FUSED_TARGETS,
    PREFILL_FUSED_TARGETS,
    parse_target_sms,
)
from loraformat.errors import StatusError
from loramux.shell import commands
from registry.config import (
    DEFAULT_MAX_CONCURRENT_UPLOADS,
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_UPLOAD_BYTES,
    DEFAULT_REGISTRY_PORT,
    DEFAULT_UPLOAD_IDLE_TIMEOUT_S,
)

DEFAULT_DATA_DIR = "~/.loramux"
INT32_MAX = (1 << 31) - 1
UINT64_MAX = (1 << 64) - 1


def _target_sms(text: str) -> tuple[str, int]:
    """An argparse type: TARGET=SMS (engine/config.py parse_target_sms)."""
    try:
        return parse_target_sms(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_in(low: int, high: int):
    """An argparse type: an integer within [low, high] (argparse names the flag in its error)."""

    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside {low}..{high}")
        return value

    parse.__name__ = "integer"
    return parse


def _float_in(low: float, high: float, open_low: bool = False):
    def parse(text: str) -> float:
        value = float(text)
        if not (low < value if open_low else low <= value) or not value <= high:
            bound = f"({low:g}, {high:g}]" if open_low else f"[{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"{value:g} is outside {bound}")
        return value

    parse.__name__ = "number"
    return parse


def _gb_or_auto(text: str) -> float | None:
    """An argparse type: GiB >= 0, or "auto" (None)."""
    if text == "auto":
        return None
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a size in GiB >= 0 or auto")
    return value


_gb_or_auto.__name__ = "GiB or auto"


class _EnvDefaults:
    """Flag defaults overridable by LORAMUX_<FLAG> variables (e.g. --data-dir <- LORAMUX_DATA_DIR)."""

    def __init__(self, env: Mapping[str, str]):
        self.env = env

    def __call__(self, flag: str, default):
        return self.env.get("LORAMUX_" + flag.lstrip("-").upper().replace("-", "_"), default)


def _registry_server_flags(p: argparse.ArgumentParser, env: _EnvDefaults) -> None:
    p.add_argument("--data-dir", default=env("--data-dir", DEFAULT_DATA_DIR))
    p.add_argument("--database-url", default=env("--database-url", ""), help="default: SQLite in --data-dir")
    p.add_argument("--database-url-file", default=env("--database-url-file", ""),
                   help="read --database-url from this file (a mounted secret: keeps the password off the command line)")
    p.add_argument("--object-store", default=env("--object-store", ""), help="a dir, file:///dir or s3://bucket?endpoint_url=...")


def _metrics_flag(p: argparse.ArgumentParser, env: _EnvDefaults) -> None:
    default = env("--metrics-port", None)
    p.add_argument(
        "--metrics-port", type=int, default=None if default is None else int(default),
        help="serve Prometheus metrics at http://HOST:N/metrics (0 = pick a free port; default: off)",
    )


def _http_flag(p: argparse.ArgumentParser, env: _EnvDefaults, default: int | None) -> None:
    value = env("--http-port", default)
    p.add_argument(
        "--http-port", type=int, default=None if value is None else int(value),
        help="serve the OpenAI-compatible HTTP API on HOST:N (0 = pick a free port; a negative port = off; "
        f"default: {'off' if default is None else default})",
    )


def _registry_flags(p: argparse.ArgumentParser, env: _EnvDefaults) -> None:
    p.add_argument("--registry", default=env("--registry", f"127.0.0.1:{DEFAULT_REGISTRY_PORT}"), help="HOST:PORT")
    _client_security_flags(p, env)


def _tls_flags(p: argparse.ArgumentParser, env: _EnvDefaults, server: bool) -> None:
    who = "this service's" if server else "a client"
    p.add_argument("--tls-cert", default=env("--tls-cert", ""), help=f"PEM certificate of {who} (TLS)")
    p.add_argument("--tls-key", default=env("--tls-key", ""), help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-ca", default=env("--tls-ca", ""),
        help="PEM CA: clients must present certificates it signed (mutual TLS)" if server
        else "PEM CA that signed the server's certificate",
    )


def _client_security_flags(p: argparse.ArgumentParser, env: _EnvDefaults) -> None:
    p.add_argument("--api-key", default=env("--api-key", ""), help="sent as 'authorization: Bearer KEY' (or LORAMUX_API_KEY)")
    _tls_flags(p, env, server=False)


def _server_security_flags(p: argparse.ArgumentParser, env: _EnvDefaults, registry: bool) -> None:
    p.add_argument("--auth", action="store_true", default=env("--auth", "") not in ("", "0", "false"),
                   help="require API keys (authorization: Bearer KEY) on every RPC but health and reflection")
    p.add_argument("--allow-unauthenticated", action="store_true", help="listen beyond loopback without --auth")
    if registry:
        p.add_argument("--admin-key-file", default=env("--admin-key-file", ""),
                       help="with --auth: where the first admin key is written (mode 0600) if absent (default: DATA_DIR/admin.key)")
        p.add_argument("--engine-key-file", default=env("--engine-key-file", ""),
                       help="with --auth: an engine key (role engine) made there at start if absent, adopted if present")
        p.add_argument("--import-allow-s3", action="append", default=[], metavar="s3://BUCKET[/PREFIX]",
                       help="S3 prefix source_uri imports may read (repeatable; without --auth and without any: every bucket)")
    _tls_flags(p, env, server=True)


def _add_key_commands(sub, env: _EnvDefaults) -> None:
    keys = sub.add_parser("keys", help="API keys (admin key needed)").add_subparsers(dest="action", required=True)
    create = keys.add_parser("create", help="create a key; it is printed once, as the last line")
    create.add_argument("--tenant", required=True)
    create.add_argument("--role", required=True, choices=("admin", "publisher", "user", "engine"))
    create.add_argument("--description", default="")
    create.set_defaults(func=commands.keys_create)
    listing = keys.add_parser("list", help="every key (never their secrets)")
    listing.set_defaults(func=commands.keys_list)
    generate = keys.add_parser("generate", help="print a new well-formed key without contacting the registry"
                               " (for a Secret that --admin-key-file or --engine-key-file adopts)")
    generate.set_defaults(func=commands.keys_generate)
    revoke = keys.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=commands.keys_revoke)
    audit = sub.add_parser("audit", help="the audit log (admin key needed)").add_subparsers(dest="action", required=True)
    audit_list = audit.add_parser("list", help="newest first")
    audit_list.add_argument("--limit", type=int, default=100)
    audit_list.set_defaults(func=commands.audit_list)
    for p in (create, listing, revoke, audit_list):
        _registry_flags(p, env)


def _add_registry_commands(sub, env: _EnvDefaults) -> None:
    registry = sub.add_parser("registry", help="the adapter registry service").add_subparsers(dest="action", required=True)
    serve = registry.add_parser("serve", help="run the registry service")
    _registry_server_flags(serve, env)
    serve.add_argument("--host", default=env("--host", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=int(env("--port", DEFAULT_REGISTRY_PORT)))
    serve.add_argument("--max-lora-rank", type=int, default=int(env("--max-lora-rank", DEFAULT_MAX_LORA_RANK)))
    serve.add_argument("--max-upload-bytes", type=int, default=int(env("--max-upload-bytes", DEFAULT_MAX_UPLOAD_BYTES)))
    serve.add_argument("--max-concurrent-uploads", type=int,
                       default=int(env("--max-concurrent-uploads", DEFAULT_MAX_CONCURRENT_UPLOADS)),
                       help="uploads in flight at once; more are refused with RESOURCE_EXHAUSTED")
    serve.add_argument("--upload-idle-timeout-s", type=float,
                       default=float(env("--upload-idle-timeout-s", DEFAULT_UPLOAD_IDLE_TIMEOUT_S)),
                       help="drop an upload stream that sent nothing for this long")
    serve.add_argument("--import-allow-dir", action="append", default=[], help="local dir source_uri may read (repeatable)")
    serve.add_argument("--import-s3-endpoint-url", default=env("--import-s3-endpoint-url", ""))
    _server_security_flags(serve, env, registry=True)
    _metrics_flag(serve, env)
    serve.set_defaults(func=commands.registry_serve)
    gc = registry.add_parser("gc", help="remove blobs that no adapter refers to")
    _registry_server_flags(gc, env)
    gc.add_argument("--grace-s", type=float, default=3600.0, help="keep orphans younger than this (uploads in flight)")
    gc.add_argument("--dry-run", action="store_true")
    gc.set_defaults(func=commands.registry_gc)


def _add_base_model_commands(sub, env: _EnvDefaults) -> None:
    base = sub.add_parser("base-models", help="base models known to the registry").add_subparsers(dest="action", required=True)
    register = base.add_parser("register", help="register a model directory's config.json")
    register.add_argument("dir")
    register.add_argument("--name", default="", help="default: the directory's name")
    _registry_flags(register, env)
    register.set_defaults(func=commands.base_models_register)
    listing = base.add_parser("list", help="list the registered base models")
    _registry_flags(listing, env)
    listing.set_defaults(func=commands.base_models_list)


def _add_adapter_commands(sub, env: _EnvDefaults) -> None:
    adapters = sub.add_parser("adapters", help="manage LoRA adapters").add_subparsers(dest="action", required=True)
    register = adapters.add_parser("register", help="upload a PEFT adapter dir, or import s3://bucket/prefix")
    register.add_argument("dir")
    register.add_argument("--name", required=True)
    register.add_argument("--base-model", default="")
    register.add_argument("--pinned", action="store_true")
    register.add_argument("--public", action="store_true", help="visible to every tenant (default: your tenant only)")
    register.add_argument("--description", default="")
    register.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    register.add_argument("--json", action="store_true")
    register.set_defaults(func=commands.adapters_register)
    listing = adapters.add_parser("list", help="list adapters (the latest version of each, by name)")
    listing.add_argument("--base-model", default="")
    listing.add_argument("--prefix", default="")
    listing.add_argument("--all-versions", action="store_true")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=commands.adapters_list)
    for action, func, what in (
        ("show", commands.adapters_show, "print one adapter version as JSON"),
        ("delete", commands.adapters_delete, "delete one version (NAME@N) or every version (NAME)"),
    ):
        p = adapters.add_parser(action, help=what)
        p.add_argument("adapter", metavar="NAME[@N]")
        p.set_defaults(func=func)
    for action, pinned in (("pin", True), ("unpin", False)):
        p = adapters.add_parser(action, help=f"{action} an adapter: pinned adapters stay loaded on engines")
        p.add_argument("adapter", metavar="NAME[@N]")
        p.set_defaults(func=commands.adapters_pin, pinned=pinned)
    for p in (register, listing, *(adapters.choices[a] for a in ("show", "delete", "pin", "unpin"))):
        _registry_flags(p, env)


def _add_engine_commands(sub, env: _EnvDefaults) -> None:
    engine = sub.add_parser("engine", help="the GPU engine service").add_subparsers(dest="action", required=True)
    serve = engine.add_parser("serve", help="run the engine service")
    serve.add_argument("--model", required=env("--model", "") == "", default=env("--model", ""), help="a Hugging Face model dir")
    serve.add_argument("--base-model-name", default=env("--base-model-name", ""), help="default: the model dir's name")
    serve.add_argument("--host", default=env("--host", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=int(env("--port", DEFAULT_ENGINE_PORT)))
    serve.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR", help="serve a PEFT adapter dir (repeatable)")
    serve.add_argument("--registry", default=env("--registry", ""), help="HOST:PORT of the registry (adapters by name)")
    _metrics_flag(serve, env)
    _http_flag(serve, env, None)
    serve.add_argument("--max-lora-rank", type=int, default=int(env("--max-lora-rank", DEFAULT_MAX_LORA_RANK)))
    _engine_tuning_flags(serve, env)
    _server_security_flags(serve, env, registry=False)
    serve.add_argument("--api-key", default=env("--api-key", ""),
                       help="this engine's own key (role engine) for the registry; with --auth it checks clients' keys")
    serve.add_argument("--api-key-file", default=env("--api-key-file", ""), help="read --api-key from this file (a mounted Secret)")
    serve.set_defaults(func=commands.engine_serve)


def _engine_tuning_flags(p: argparse.ArgumentParser, env: _EnvDefaults) -> None:
    p.add_argument("--device", default=env("--device", "cpu"), help="cpu or cuda")
    p.add_argument("--dtype", default=env("--dtype", ""), help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--page-size", type=int, default=int(env("--page-size", 1)))
    p.add_argument("--num-kv-slots", type=int, default=int(env("--num-kv-slots", 0)), help="0 = automatic")
    p.add_argument("--max-context", type=int, default=int(env("--max-context", 0)), help="0 = the model's")
    p.add_argument("--max-running-requests", type=int, default=int(env("--max-running-requests", 64)))
    p.add_argument("--max-batch-tokens", type=int, default=int(env("--max-batch-tokens", 2048)))
    p.add_argument("--max-queued-requests", type=int, default=int(env("--max-queued-requests", 1024)))
    p.add_argument(
        "--cuda-graph-max-batch", type=int, default=int(env("--cuda-graph-max-batch", 64)),
        help="replay captured CUDA graphs for decode steps of up to N requests (0 = off)",
    )
    p.add_argument(
        "--cuda-graph-max-tokens", type=int, default=int(env("--cuda-graph-max-tokens", 2048)),
        help="replay captured CUDA graphs for prefill and mixed steps of up to N tokens, padded to a bucket"
        " (0 = off; at most --max-batch-tokens)",
    )
    p.add_argument(
        "--kernel-pdl", action="store_true", default=env("--kernel-pdl", "") not in ("", "0", "false"),
        help="on cuda (compute capability 9+), launch the decode kernels that follow one another (RMSNorm, RoPE"
        " with the KV write, attention, SiLU-mul) with programmatic dependent launch",
    )
    p.add_argument(
        "--disable-lora-pdl", action="store_true", default=env("--disable-lora-pdl", "") not in ("", "0", "false"),
        help="launch the decode LoRA kernels plainly; by default on cuda (compute capability 9+) the kernels after"
        " the split shrink (its reduce, the expand) take programmatic dependent launch and read the adapters'"
        " weights while the kernel before them runs",
    )
    p.add_argument(
        "--linear-weight-layout", choices=LINEAR_WEIGHT_LAYOUTS, default=env("--linear-weight-layout", "in_out"),
        help="how the base model's linear weights lie in memory: in_out (stored transposed, so the GEMMs read a"
        " row-major [in, out] matrix; decode steps 3.5-3.9%% shorter at batch 32-64 on an H100, prefill level;"
        " the default) or out_in (as nn.Linear stores them)",
    )
    p.add_argument("--attention-backend", default=env("--attention-backend", ""), help="ref, sdpa or triton (default: triton on cuda, ref on cpu)")
    p.add_argument("--max-loras-per-batch", type=int, default=int(env("--max-loras-per-batch", 8)), help="GPU adapter slots")
    p.add_argument(
        "--lora-target-modules", nargs="*", metavar="MODULE", default=env("--lora-target-modules", "").split(),
        help="projections the slots hold LoRA for, e.g. q_proj v_proj (q_proj keeps all of q/k/v, which share a"
        " buffer); adapters of other projections are refused; a slot then takes less memory, so more fit"
        " (default: all projections)",
    )
    p.add_argument("--max-host-adapters", type=int, default=int(env("--max-host-adapters", 64)))
    p.add_argument(
        "--host-pinned-gb", type=_gb_or_auto, default=_gb_or_auto(env("--host-pinned-gb", "auto")),
        help="on cuda, page-locked host memory (GiB) taken at startup that adapters are packed into, so a burst"
        " of new adapters does not page-lock memory while serving (which held up decoding for up to 110 ms per"
        " 84 MB adapter); adapters that do not fit are pinned as before; 0 = off; auto (the default): room for"
        " --max-loras-per-batch + --max-host-adapters adapters at --max-lora-rank, at most 4 GiB and an eighth of"
        " the host's memory (or its container's limit), per engine process",
    )
    p.add_argument(
        "--lora-sm-carveout", type=_int_in(0, 1024), default=int(env("--lora-sm-carveout", DEFAULT_LORA_SM_CARVEOUT)),
        help="on cuda, SMs a decode step's base GEMMs leave free for the LoRA kernels beside them (0 = none)",
    )
    p.add_argument(
        "--lora-sm-carveout-target", nargs="+", metavar="TARGET=SMS", type=_target_sms,
        default=[_target_sms(text) for text in env("--lora-sm-carveout-target", "").split()],
        help=f"on cuda, these fused targets' decode GEMMs leave SMS SMs free in place of --lora-sm-carveout"
        f" (TARGET: {', '.join(LORA_FUSED_TARGETS)}; default: none)",
    )
    p.add_argument(
        "--disable-decode-gemm-tuning", action="store_true",
        default=env("--disable-decode-gemm-tuning", "") not in ("", "0", "false"),
        help="run PyTorch's own cuBLAS pick for every decode GEMM; by default on cuda with cuda graphs the engine"
        " times cuBLASLt's algorithms for each decode GEMM at each captured batch size when it starts (under the"
        " LoRA SM carve-out and on every SM) and runs the fastest where it beats PyTorch's pick",
    )
    p.add_argument(
        "--lora-decode-fused-expand", nargs="+", metavar="TARGET", choices=DECODE_FUSED_TARGETS,
        default=env("--lora-decode-fused-expand", "").split(),
        help="on cuda with the triton or splitk LoRA backend, decode steps add these projections' LoRA expand"
        " in the kernel that reads them next (qkv: RoPE with the KV write; gate_up: SiLU-mul) rather than"
        " computing it beside the base GEMM (default: none)",
    )
    p.add_argument(
        "--lora-decode-norm-shrink", nargs="+", metavar="TARGET", choices=DECODE_FUSED_TARGETS,
        default=env("--lora-decode-norm-shrink", "").split(),
        help="on cuda with the triton or splitk LoRA backend, decode steps run these projections' LoRA with no"
        " side stream: the RMSNorm kernel before the projection shrinks its output, the base GEMM takes every"
        " SM, and the kernel that reads the projection next expands (qkv: RoPE with the KV write; gate_up:"
        " SiLU-mul) (default: none)",
    )
    p.add_argument(
        "--lora-prefill-fused-expand", nargs="*", metavar="TARGET", choices=PREFILL_FUSED_TARGETS,
        default=env("--lora-prefill-fused-expand", "gate_up").split(),
        help="on cuda with the triton or splitk LoRA backend, prefill-sized steps add these projections' LoRA"
        " expand in the kernel that reads them next (gate_up: SiLU-mul; o, down: the residual add + RMSNorm,"
        " on one GPU) rather than reading and writing the projection's output first (default: gate_up;"
        " none: every expand in line)",
    )
    p.add_argument(
        "--lora-graph-segments", nargs="+", type=int, metavar="N",
        default=[int(n) for n in env("--lora-graph-segments", "").split()],
        help="on cuda with cuda graphs, decode graphs with LoRA are also captured for steps of at most N LoRA"
        " segments (one adapter's neighbouring requests, up to 16 a segment), and a step replays the graph of"
        " the fewest that hold its own, so its LoRA kernels launch no programs for padding segments; each N"
        " adds a graph per batch size (default: none)",
    )
    p.add_argument(
        "--lora-gemm-tail-blocks", type=int, metavar="N", default=int(env("--lora-gemm-tail-blocks", "4")),
        help="on one GPU with the triton or splitk LoRA backend, prefill-sized steps (256+ tokens) of at most N"
        " adapters add their LoRA in the base GEMMs: each adapter's shrink as extra input columns and its B"
        " as extra weight rows, so no expand reads and writes a projection's output; a copy of N adapters'"
        " weights stays beside the base weights (default 4; 0: off)",
    )
    p.add_argument(
        "--lora-decode-fused-delta", nargs="+", metavar="TARGET", choices=LORA_FUSED_TARGETS,
        default=env("--lora-decode-fused-delta", "").split(),
        help="on cuda with the splitk LoRA backend, decode steps compute these projections' LoRA delta beside"
        " the base GEMM in one fused pass (the expand sums the split shrink's partials; no reduce kernel)"
        f" rather than shrink, reduce and expand (TARGET: {', '.join(LORA_FUSED_TARGETS)}; default: none)",
    )
    p.add_argument(
        "--kernel-configs", metavar="DIR", default=env("--kernel-configs", ""),
        help="a directory of tuned tile files for the LoRA kernels, one per GPU model"
        " (benchmarks/tune_lora_tiles.py writes them; default: the ones loramux ships)",
    )
    p.add_argument(
        "--max-concurrent-fetches", type=_int_in(1, 1024), default=int(env("--max-concurrent-fetches", 4)),
        help="registry fetches of adapters in flight at most; the rest wait their turn in arrival order",
    )
    p.add_argument(
        "--disable-fetch-process", action="store_true", default=env("--disable-fetch-process", "") not in ("", "0", "false"),
        help="receive adapters from the registry on the engine's event loop instead of in a process of its own"
        " (Linux; there the chunks do not wait for the engine's GIL)",
    )
    p.add_argument(
        "--fetch-processes", type=_int_in(1, 64), default=int(env("--fetch-processes", DEFAULT_FETCH_PROCESSES)),
        help="processes that receive adapters from the registry, splitting --max-concurrent-fetches between them"
        " (one process's event loop handles every chunk of its fetches)",
    )
    p.add_argument(
        "--adapter-prep-threads", type=_int_in(1, 64), default=int(env("--adapter-prep-threads", DEFAULT_ADAPTER_PREP_THREADS)),
        help="threads that check and pack fetched adapters; one alone falls behind a burst of new adapters,"
        " and each one takes the GIL from the engine loop while it packs",
    )
    p.add_argument(
        "--gil-switch-interval-ms", type=float, default=float(env("--gil-switch-interval-ms", 0)),
        help="the engine process's GIL switch interval: how long a thread that wants the GIL waits for one"
        " running Python (registry fetches, adapter packing, the engine loop's launches); 0 = Python's own, 5 ms",
    )
    p.add_argument(
        "--lora-drain-wait-s", type=float, default=float(env("--lora-drain-wait-s", DEFAULT_LORA_DRAIN_WAIT_S)),
        help="starvation drain: when another adapter's requests waited this long for a slot, stop admitting"
        " to the running adapter with the fewest remaining tokens; 0 turns it off",
    )
    p.add_argument("--lora-eviction-policy", default=env("--lora-eviction-policy", "lru"), choices=("lru", "fifo"))
    p.add_argument(
        "--lora-load-ahead", type=_int_in(0, 4096), default=int(env("--lora-load-ahead", DEFAULT_LORA_LOAD_AHEAD)),
        help="per step, load up to N adapters of queued requests into free GPU slots before their turn,"
        " so the copies overlap decoding; 0 turns it off",
    )
    p.add_argument("--lora-backend", default=env("--lora-backend", ""), help="ref, triton, chunked or splitk (default: splitk on cuda, ref on cpu)")
    p.add_argument(
        "--tensor-parallel-size", type=int, default=int(env("--tensor-parallel-size", 1)),
        help="model workers, one per GPU (cuda:0..N-1); gloo processes on cpu",
    )
    p.add_argument(
        "--disable-overlap-schedule", action="store_true", default=env("--disable-overlap-schedule", "") not in ("", "0", "false"),
        help="on CUDA, plan each decode step only after the previous step's tokens are back (by default the"
        " next step is planned and launched while the previous one runs)",
    )
    p.add_argument(
        "--disable-custom-all-reduce", action="store_true", default=env("--disable-custom-all-reduce", "") not in ("", "0", "false"),
        help="under tensor parallelism on CUDA, send every all-reduce through NCCL instead of the one-shot"
        " peer-memory path for decode-size tensors",
    )


def _add_generate_command(sub, env: _EnvDefaults) -> None:
    gen = sub.add_parser("generate", help="stream a generation to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--engine", default=env("--engine", f"127.0.0.1:{DEFAULT_ENGINE_PORT}"), help="HOST:PORT")
    gen.add_argument("--adapter", default="", help="NAME or NAME@VERSION; empty = the base model")
    gen.add_argument("--max-new-tokens", type=_int_in(1, INT32_MAX), default=None,
                     help="at most N new tokens (default: the engine's, 256, within the model's context)")
    gen.add_argument("--temperature", type=_float_in(0.0, 100.0), default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=_float_in(0.0, 1.0, open_low=True), default=1.0,
                     help="nucleus sampling: keep the smallest set of tokens whose probability reaches P (0 < P <= 1)")
    gen.add_argument("--top-k", type=_int_in(0, INT32_MAX), default=0, help="keep the K most likely tokens (0 = all)")
    gen.add_argument("--seed", type=_int_in(0, UINT64_MAX), default=None, help="a seed for reproducible sampling")
    gen.add_argument("--stop", action="append", default=[], help="stop at this text (repeatable)")
    gen.add_argument("--wait", type=float, default=0.0, metavar="S", help="wait up to S seconds for the engine to be ready")
    _client_security_flags(gen, env)
    gen.set_defaults(func=commands.generate)


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    env = _EnvDefaults(environ)
    parser = argparse.ArgumentParser(prog="loramux", description="Multi-LoRA LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run loramux on this machine with no outside services")
    up.add_argument("--model", default=env("--model", ""), help="a Hugging Face model dir (default: the demo model)")
    up.add_argument("--data-dir", default=env("--data-dir", DEFAULT_DATA_DIR))
    up.add_argument("--registry-port", type=int, default=int(env("--registry-port", DEFAULT_REGISTRY_PORT)))
    up.add_argument("--engine-port", type=int, default=int(env("--engine-port", DEFAULT_ENGINE_PORT)))
    _metrics_flag(up, env)
    _http_flag(up, env, DEFAULT_HTTP_PORT)
    up.add_argument("--max-lora-rank", type=int, default=int(env("--max-lora-rank", DEFAULT_MAX_LORA_RANK)))
    _engine_tuning_flags(up, env)
    _server_security_flags(up, env, registry=True)
    up.add_argument("--detach", action="store_true",
                    help="run in the background (pid file, output and logs in --data-dir) and return once ready;"
                    " `loramux down` stops it")
    up.set_defaults(func=commands.up)
    down = sub.add_parser("down", help="stop the `loramux up --detach` of a data dir (Ctrl-C stops a foreground one)")
    down.add_argument("--data-dir", default=env("--data-dir", DEFAULT_DATA_DIR), help="the data dir of that loramux up")
    down.set_defaults(func=commands.down)
    _add_registry_commands(sub, env)
    _add_engine_commands(sub, env)
    _add_generate_command(sub, env)
    _add_base_model_commands(sub, env)
    _add_adapter_commands(sub, env)
    _add_key_commands(sub, env)
    _describe(parser)
    return parser


# What each flag or argument without its own help means, by destination (the same meaning everywhere).
_HELP = {
    "data_dir": "where SQLite, the local object store, the spool and (for up) the demo model, pid file and logs live",
    "registry_port": "the registry's gRPC port (0 = pick a free one)",
    "engine_port": "the engine's gRPC port (0 = pick a free one)",
    "max_lora_rank": "the highest adapter rank accepted (and the slots' rank on an engine)",
    "page_size": "tokens per KV-cache page",
    "max_running_requests": "requests decoded together at most",
    "max_batch_tokens": "tokens a step computes at most (chunked prefill splits longer prompts)",
    "max_queued_requests": "requests admitted and not finished at most (waiting, fetching or running); more get RESOURCE_EXHAUSTED",
    "max_host_adapters": "adapters kept packed in host memory (LRU) besides those in GPU slots, which always keep theirs",
    "lora_eviction_policy": "which unpinned, idle adapter leaves a slot first",
    "host": "the address to listen on",
    "port": "the gRPC port to listen on (0 = pick a free one)",
    "max_upload_bytes": "the largest upload (both files together); reading stops there",
    "import_s3_endpoint_url": "the S3 endpoint source_uri imports read from (default: the object store's)",
    "dry_run": "list what would be removed, remove nothing",
    "prompt": "the prompt text",
    "dir": "a directory holding adapter_config.json and adapter_model.safetensors (or s3://bucket/prefix)",
    "name": "the adapter's name (a-z, 0-9, '.', '_', '-')",
    "base_model": "the base model's name (default: the registry's only one)",
    "pinned": "keep it loaded on engines",
    "description": "free text kept with it",
    "label": "a KEY=VALUE label (repeatable)",
    "json": "print JSON",
    "prefix": "only names starting with this",
    "all_versions": "every version, not only the latest",
    "adapter": "NAME (the latest version) or NAME@N",
    "tenant": "the tenant the key belongs to",
    "role": "what the key may do",
    "key_id": "the key's id (from `keys list`)",
    "limit": "rows at most",
}

# One line of what each command does, shown at the top of its --help.
_DESCRIPTIONS = {
    "up": "Run the registry and the engine on this machine with no outside services: SQLite, a local object "
    "store and (without --model) a demo model under --data-dir (default ~/.loramux); registry on 127.0.0.1:50051, "
    "engine on 127.0.0.1:50052, HTTP on 127.0.0.1:8000. Foreground (Ctrl-C stops it) or --detach (then `loramux "
    "down`). Every flag can also be set as a LORAMUX_* variable: --data-dir is LORAMUX_DATA_DIR, --engine-port "
    "LORAMUX_ENGINE_PORT.",
}


class _Formatter(argparse.HelpFormatter):
    """Help with each flag's default, when it has one worth printing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        meaningful = action.default not in (None, "", False, [], argparse.SUPPRESS)
        if meaningful and "default" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


def _describe(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> None:
    """Fill in help and descriptions left out where flags are declared, and show defaults everywhere."""
    parser.formatter_class = _Formatter
    if path and parser.description is None:
        parser.description = _DESCRIPTIONS.get(" ".join(path))
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                if sub.description is None and not _DESCRIPTIONS.get(" ".join((*path, name))):
                    sub.description = helps.get(name)
                _describe(sub, (*path, name))
        elif action.help is None:
            action.help = _HELP.get(action.dest)


def _hint(args, exc: grpc.RpcError) -> str:
    """What to do about a refused call whose cause is where it went, not what it asked."""
    target = "engine" if args.command == "generate" else "registry"
    address = getattr(args, target, "") or "?"
    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
        ports = f"the registry's default port is {DEFAULT_REGISTRY_PORT}, the engine's {DEFAULT_ENGINE_PORT}"
        return f" ({address} is not a loramux {target}? {ports})"
    if exc.code() == grpc.StatusCode.UNAVAILABLE and "connect" in (exc.details() or "").lower():
        return f" (nothing answers at {address}: start loramux with `loramux up --detach`, or point --{target} at it)"
    return ""


def main(argv: list[str] | None = None) -> int:
    args = build_parser(dict(os.environ)).parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args) or 0
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}{_hint(args, exc)}", file=sys.stderr)
    except StatusError as exc:
        print(f"error: {exc.code.value}: {exc}", file=sys.stderr)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
