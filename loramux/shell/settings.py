"""Service configurations from parsed command-line arguments: what `registry serve`, `engine serve` and
`up` share, so the subcommands and `up` import it rather than each other."""

from __future__ import annotations

from pathlib import Path

from engine.adapters import parse_adapter_spec
from engine.config import EngineConfig
from loramux.security import TlsFiles
from registry.config import RegistryConfig


def registry_config(args, host: str = "127.0.0.1", port: int = 0) -> RegistryConfig:
    return RegistryConfig(
        data_dir=Path(args.data_dir).expanduser(),
        host=getattr(args, "host", host),
        port=getattr(args, "port", port),
        database_url=database_url(args),
        object_store=getattr(args, "object_store", ""),
        max_lora_rank=getattr(args, "max_lora_rank", RegistryConfig.max_lora_rank),
        max_upload_bytes=getattr(args, "max_upload_bytes", RegistryConfig.max_upload_bytes),
        max_concurrent_uploads=getattr(args, "max_concurrent_uploads", RegistryConfig.max_concurrent_uploads),
        upload_idle_timeout_s=getattr(args, "upload_idle_timeout_s", RegistryConfig.upload_idle_timeout_s),
        import_allow_dirs=tuple(Path(d).resolve() for d in getattr(args, "import_allow_dir", [])),
        import_s3_endpoint_url=getattr(args, "import_s3_endpoint_url", ""),
        import_allow_s3=tuple(getattr(args, "import_allow_s3", [])),
        auth=getattr(args, "auth", False),
        admin_key_file=Path(args.admin_key_file).expanduser() if getattr(args, "admin_key_file", "") else None,
        engine_key_file=Path(args.engine_key_file).expanduser() if getattr(args, "engine_key_file", "") else None,
        allow_unauthenticated=getattr(args, "allow_unauthenticated", False),
        tls=tls_files(args),
    )


def database_url(args) -> str:
    """--database-url, or the contents of --database-url-file; both at once is refused rather than one
    silently winning (LORAMUX_DATABASE_URL counts as --database-url)."""
    url, path = getattr(args, "database_url", ""), getattr(args, "database_url_file", "")
    if not path:
        return url
    if url:
        raise ValueError("give --database-url or --database-url-file, not both")
    url = Path(path).expanduser().read_text().strip()
    if not url:
        raise ValueError(f"--database-url-file {path} is empty")
    return url


def tls_files(args) -> TlsFiles:
    return TlsFiles(getattr(args, "tls_cert", ""), getattr(args, "tls_key", ""), getattr(args, "tls_ca", ""))


def http_port(args) -> int | None:
    """--http-port: None (or negative) = no HTTP front."""
    port = getattr(args, "http_port", None)
    return None if port is None or port < 0 else port


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
        cuda_graph_max_tokens=args.cuda_graph_max_tokens,
        kernel_pdl=args.kernel_pdl,
        lora_pdl=not args.disable_lora_pdl,
        linear_weight_layout=args.linear_weight_layout,
        adapters=tuple(parse_adapter_spec(spec) for spec in getattr(args, "adapter", [])),
        max_loras_per_batch=args.max_loras_per_batch,
        max_lora_rank=args.max_lora_rank,
        lora_target_modules=tuple(args.lora_target_modules),
        max_host_adapters=args.max_host_adapters,
        host_pinned_gb=args.host_pinned_gb,
        lora_sm_carveout=args.lora_sm_carveout,
        lora_sm_carveout_targets=tuple(args.lora_sm_carveout_target),
        tune_decode_gemms=not args.disable_decode_gemm_tuning,
        lora_decode_fused_expand=tuple(args.lora_decode_fused_expand),
        lora_decode_norm_shrink=tuple(args.lora_decode_norm_shrink),
        lora_decode_fused_delta=tuple(args.lora_decode_fused_delta),
        lora_prefill_fused_expand=tuple(args.lora_prefill_fused_expand),
        lora_gemm_tail_blocks=args.lora_gemm_tail_blocks,
        lora_graph_segments=tuple(args.lora_graph_segments),
        kernel_configs=args.kernel_configs,
        lora_eviction_policy=args.lora_eviction_policy,
        lora_load_ahead=args.lora_load_ahead,
        lora_drain_wait_s=args.lora_drain_wait_s,
        lora_backend=args.lora_backend,
        registry=registry or getattr(args, "registry", ""),
        max_concurrent_fetches=args.max_concurrent_fetches,
        disable_fetch_process=args.disable_fetch_process,
        fetch_processes=args.fetch_processes,
        adapter_prep_threads=args.adapter_prep_threads,
        gil_switch_interval_ms=args.gil_switch_interval_ms,
        tensor_parallel_size=args.tensor_parallel_size,
        disable_custom_all_reduce=args.disable_custom_all_reduce,
        disable_overlap_schedule=args.disable_overlap_schedule,
        auth=getattr(args, "auth", False),
        api_key=api_key(args),
        allow_unauthenticated=getattr(args, "allow_unauthenticated", False),
        tls=tls_files(args),
    )


def api_key(args) -> str:
    """--api-key, else the contents of --api-key-file (a mounted Secret), else ''."""
    if getattr(args, "api_key", ""):
        return args.api_key
    path = getattr(args, "api_key_file", "")
    return Path(path).read_text().strip() if path else ""
