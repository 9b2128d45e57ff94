"""The registry's use cases, composed of the catalog (SQL), the object store and the compiler.

Registration order is the durability argument: validate and compile everything into a spool file,
write the blob (content-addressed, write-once), and commit the SQL row last. A failure at any step
leaves no row; a blob left without a row is removed by `collect_garbage`.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from loraformat.model_shapes import ModelShape
from loraformat.peft_compile import compile_adapter
from loraformat.peft_files import CONFIG_FILE, WEIGHTS_FILE
from loramux.security import ANONYMOUS, PermissionDenied, Principal, Role
from registry.access import AccessStore
from registry.catalog import Catalog, NewVersion
from registry.config import RegistryConfig
from registry.sources import fetch_source
from registry.spool import Spool
from registry.store import BlobInfo, ObjectStore, S3Store, make_s3_client
from registry.types import AdapterFiles, AdapterInfo, AdapterSpecIn, BaseModelInfo, check_name

log = logging.getLogger(__name__)

ARTIFACT_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Leftovers:
    """What crashed registrations left behind, reclaimed: spool entries and partial blob writes."""

    spool_entries: int
    spool_bytes: int
    temp_blobs: int
    temp_blob_bytes: int

    def __bool__(self) -> bool:
        return bool(self.spool_entries or self.temp_blobs)

    def __str__(self) -> str:
        return (
            f"{self.spool_entries} spool entries ({self.spool_bytes / 1e6:.1f} MB) and"
            f" {self.temp_blobs} partial blobs ({self.temp_blob_bytes / 1e6:.1f} MB) of crashed registrations"
        )


@dataclass(frozen=True)
class GcResult:
    removed: tuple[BlobInfo, ...]
    kept_young: int  # unreferenced but inside the grace period (maybe a registration in flight)
    leftovers: Leftovers


CommitCheck = Callable[[], None]  # raises when the registration must not commit (deadline, shutdown)


class RegistryService:
    def __init__(self, catalog: Catalog, store: ObjectStore, config: RegistryConfig):
        self.catalog = catalog
        self.access = AccessStore(catalog.engine)
        self.store = store
        self.config = config
        self.spool = Spool(config.spool_dir)

    def close(self) -> None:
        self.spool.close()

    def reclaim_leftovers(self) -> Leftovers:
        """Remove the spools of dead registry processes and blob writes begun before any live upload."""
        spool = self.spool.reclaim()
        temp_blobs, temp_bytes = self.store.remove_leftovers(older_than=spool.oldest_live_start)
        return Leftovers(spool.num_entries, spool.num_bytes, temp_blobs, temp_bytes)

    def register_base_model(self, name: str, config_json: str, caller: Principal = ANONYMOUS) -> BaseModelInfo:
        if caller.role not in (Role.ADMIN, Role.ENGINE):
            raise PermissionDenied("registering a base model needs an admin or engine key")
        check_name(name, "name")
        ModelShape.from_json(config_json)  # refuses deep JSON and models the engine cannot serve
        return self.catalog.register_base_model(name, config_json, caller)

    def register_adapter(
        self,
        spec: AdapterSpecIn,
        files: AdapterFiles,
        caller: Principal = ANONYMOUS,
        may_commit: CommitCheck = lambda: None,
    ) -> AdapterInfo:
        """Validate, compile, store the blob, then commit the row; returns the (new or equal) version.

        `may_commit` runs just before the commit: a client whose deadline passed (or a registry shutting
        down) gets no row it was told failed; the blob it leaves is an orphan that gc removes."""
        base = self.catalog.resolve_base_model(spec.base_model)
        shape = ModelShape.from_config(json.loads(base.config_json))
        with tempfile.TemporaryDirectory(dir=self.spool.path) as tmp:
            artifact = Path(tmp) / "artifact.safetensors"
            compiled = compile_adapter(
                files.config_path.read_bytes(),
                files.weights_path,
                shape,
                base_model=base.name,
                max_rank=self.config.max_lora_rank,
                out_path=artifact,
            )
            started = time.monotonic()
            self.store.put_file(compiled.digest, artifact, take=True)  # the temp dir goes right after
            log.info(
                "stored %s (%d bytes) in %.3fs",
                compiled.digest,
                compiled.size_bytes,
                time.monotonic() - started,
            )
        new = NewVersion(
            digest=compiled.digest,
            rank=compiled.rank,
            alpha=compiled.alpha,
            scaling=compiled.scaling,
            target_modules=tuple(compiled.target_modules),
            size_bytes=compiled.size_bytes,
            pinned=spec.pinned,
            description=spec.description,
            labels=spec.labels,
            public=spec.public,
        )
        may_commit()
        return self.catalog.add_version(spec.name, base.name, new, caller)

    def import_adapter(
        self, spec: AdapterSpecIn, caller: Principal = ANONYMOUS, may_commit: CommitCheck = lambda: None
    ) -> AdapterInfo:
        """Register from spec.source_uri (s3://bucket/prefix or an allow-listed local directory)."""
        with tempfile.TemporaryDirectory(dir=self.spool.path) as tmp:
            paths = fetch_source(
                spec.source_uri,
                Path(tmp),
                allowed_dirs=self.config.import_allow_dirs,
                max_bytes=self.config.max_upload_bytes,
                s3_client_factory=self._import_s3_client,
                allowed_s3=self.config.import_s3_allow_list,
            )
            files = AdapterFiles(paths[CONFIG_FILE], paths[WEIGHTS_FILE])
            return self.register_adapter(spec, files, caller, may_commit)

    def iter_artifact(self, digest: str, offset: int = 0) -> Iterator[bytes]:
        return self.store.iter_chunks(digest, ARTIFACT_CHUNK_BYTES, offset)

    def collect_garbage(self, grace_s: float, dry_run: bool = False) -> GcResult:
        """Remove blobs that no adapter row refers to and that are older than grace_s."""
        referenced = self.catalog.referenced_digests()
        cutoff = time.time() - grace_s
        orphans = [b for b in self.store.list_blobs() if b.digest not in referenced]
        old = tuple(b for b in orphans if b.modified_at < cutoff)
        leftovers = Leftovers(0, 0, 0, 0)
        if not dry_run:
            for blob in old:
                self.store.delete(blob.digest)
            leftovers = self.reclaim_leftovers()
        return GcResult(removed=old, kept_young=len(orphans) - len(old), leftovers=leftovers)

    def _import_s3_client(self):
        """S3 sources are read from --import-s3-endpoint-url, else the object store's own endpoint."""
        if self.config.import_s3_endpoint_url:
            return make_s3_client(self.config.import_s3_endpoint_url)
        if isinstance(self.store, S3Store):
            return make_s3_client(self.store.endpoint_url, self.store.region)
        return make_s3_client()
