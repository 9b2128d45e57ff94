"""The registry's settings, read once at the entry point (flags or LORAMUX_* variables)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loramux.security import TlsFiles

DEFAULT_REGISTRY_PORT = 50051
DEFAULT_MAX_LORA_RANK = 64
DEFAULT_MAX_UPLOAD_BYTES = 2 << 30
DEFAULT_MAX_CONCURRENT_UPLOADS = 16
DEFAULT_UPLOAD_IDLE_TIMEOUT_S = 60.0
DEFAULT_HEALTH_PROBE_S = 2.0


@dataclass(frozen=True)
class RegistryConfig:
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = DEFAULT_REGISTRY_PORT
    database_url: str = ""  # "" = SQLite at <data_dir>/registry.db
    object_store: str = ""  # "" = a local directory at <data_dir>/objects
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    import_allow_dirs: tuple[Path, ...] = ()
    import_s3_endpoint_url: str = ""  # "" = the object store's endpoint when it is S3
    # Each upload in flight holds a spool directory and file handles: a bounded number, and none idle.
    max_concurrent_uploads: int = DEFAULT_MAX_CONCURRENT_UPLOADS
    upload_idle_timeout_s: float = DEFAULT_UPLOAD_IDLE_TIMEOUT_S
    health_probe_s: float = DEFAULT_HEALTH_PROBE_S  # how often health checks the database
    watch_poll_s: float = 1.0  # events reach watchers at once; this poll only covers a lost notification
    import_allow_s3: tuple[str, ...] = ()  # s3://bucket[/prefix] imports may read; none = any without auth
    auth: bool = False
    admin_key_file: Path | None = None  # None = <data_dir>/admin.key
    engine_key_file: Path | None = None  # with auth: an engine key made (or adopted) there at start
    allow_unauthenticated: bool = False  # listen beyond loopback without --auth
    tls: TlsFiles = field(default_factory=TlsFiles)

    @property
    def resolved_admin_key_file(self) -> Path:
        return self.admin_key_file or self.data_dir / "admin.key"

    @property
    def import_s3_allow_list(self) -> tuple[str, ...] | None:
        """None (any bucket) only for a registry without authentication and without a list."""
        return self.import_allow_s3 if (self.auth or self.import_allow_s3) else None

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'registry.db'}"

    @property
    def resolved_object_store(self) -> str:
        return self.object_store or str(self.data_dir / "objects")

    @property
    def spool_dir(self) -> Path:
        """Where uploads and compiled artifacts wait before they reach the object store."""
        return self.data_dir / "spool"
