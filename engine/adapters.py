"""Adapters the engine serves from local files (`--adapter NAME=DIR`), by name and digest.

A DIR is a PEFT adapter (compiled here with the registry's own compiler, so there is one
interpretation of PEFT) or a canonical artifact file. Every adapter is version 1 of its name.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import FailedPrecondition, InvalidArgument, NotFound
from loraformat.model_shapes import ModelShape
from loraformat.names import check_name, parse_ref
from loraformat.peft_compile import CanonicalAdapter, compile_adapter, read_canonical
from loraformat.peft_files import CONFIG_FILE, WEIGHTS_FILE


@dataclass(frozen=True)
class AdapterRecord:
    name: str
    version: int
    digest: str
    path: Path | None  # the canonical artifact on local disk; None when it comes from the registry
    rank: int
    pinned: bool = False  # as the registry last said
    tenant: str = ""  # the owner, from the registry ("" for local adapters and without authentication)
    public: bool = True  # local adapters are served to every caller; the registry says for its own
    base_model: str = ""  # the registry's base model name; "" for local adapters (compiled for this engine)
    target_modules: tuple[str, ...] = ()  # as the registry says; () for local adapters (their artifact says)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


class LocalAdapters:
    def __init__(self, records: list[AdapterRecord]):
        self._by_name = {r.name: r for r in records}
        self._by_digest = {r.digest: r for r in records}

    @classmethod
    def compile_all(
        cls, specs: list[tuple[str, Path]], model_dir: Path, base_model: str, max_rank: int, work_dir: Path,
        served: frozenset[str] | None = None,
    ) -> LocalAdapters:  # fmt: skip
        shape = ModelShape.from_config(json.loads((model_dir / "config.json").read_text()))
        work_dir.mkdir(parents=True, exist_ok=True)
        records = [_compile_one(check_name(name, "adapter"), Path(src), shape, base_model, max_rank, work_dir, served) for name, src in specs]
        return cls(records)

    def resolve(self, ref: str) -> AdapterRecord:
        """'name' or 'name@1' -> the record; NOT_FOUND for unknown names and versions."""
        name, version = parse_ref(ref)
        record = self._by_name.get(name)
        if record is None or version not in (0, record.version):
            raise NotFound(f"adapter {ref!r} is not available on this engine")
        return record

    def records(self) -> list[AdapterRecord]:
        return sorted(self._by_name.values(), key=lambda r: r.name)

    def by_digest(self, digest: str) -> AdapterRecord:
        return self._by_digest[digest]


def read_canonical_within(
    artifact: bytes | bytearray | memoryview, shape: ModelShape, max_rank: int, label: str, served: frozenset[str] | None = None
) -> CanonicalAdapter:
    """A canonical artifact checked against the base model, the engine's slot rank and the projections
    its slots hold LoRA for (`served`; None: all)."""
    adapter = read_canonical(artifact, shape)
    check_within(label, adapter.rank, adapter.target_modules, max_rank, served)
    return adapter


def check_within(label: str, rank: int, modules: tuple[str, ...], max_rank: int, served: frozenset[str] | None) -> None:
    """Refuse an adapter over the engine's slot rank or of a projection its slots hold no LoRA for."""
    if rank > max_rank:
        raise FailedPrecondition(f"{label}: rank {rank} is over this engine's --max-lora-rank {max_rank}")
    check_served(label, modules, served)


def check_served(label: str, modules: tuple[str, ...], served: frozenset[str] | None) -> None:
    """Refuse an adapter of a projection the engine's slots hold no LoRA for (--lora-target-modules)."""
    missing = [m for m in modules if served is not None and m not in served]
    if missing:
        raise FailedPrecondition(
            f"{label}: adapts {', '.join(missing)}, which this engine's slots hold no LoRA for"
            f" (--lora-target-modules: {', '.join(sorted(served))})"
        )


def parse_adapter_spec(spec: str) -> tuple[str, str]:
    """`NAME=DIR` from the command line."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise InvalidArgument(f"--adapter {spec!r}: expected NAME=DIR")
    return name, path


def _compile_one(
    name: str, src: Path, shape: ModelShape, base_model: str, max_rank: int, work_dir: Path, served: frozenset[str] | None
) -> AdapterRecord:
    if src.is_file():
        data = src.read_bytes()
        adapter = read_canonical_within(data, shape, max_rank, f"adapter {name!r}", served)
        return AdapterRecord(name, 1, hashlib.sha256(data).hexdigest(), src, adapter.rank)
    if not (src / CONFIG_FILE).is_file():
        raise NotFound(f"adapter {name!r}: {src / CONFIG_FILE} does not exist")
    staging = work_dir / f".{name}.safetensors"
    compiled = compile_adapter(
        (src / CONFIG_FILE).read_bytes(), src / WEIGHTS_FILE, shape, base_model=base_model, max_rank=max_rank, out_path=staging
    )
    try:
        check_served(f"adapter {name!r}", compiled.target_modules, served)
    except FailedPrecondition:
        staging.unlink(missing_ok=True)
        raise
    final = work_dir / f"{compiled.digest}.safetensors"
    staging.replace(final)
    return AdapterRecord(name, 1, compiled.digest, final, compiled.rank)
