"""Plain records the registry's service layer hands to its servicer (protobuf stops at the servicer)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from registry.errors import InvalidArgument

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
MAX_DESCRIPTION_LEN = 4096
MAX_LABELS = 64
MAX_LABEL_LEN = 256


@dataclass(frozen=True)
class BaseModelInfo:
    name: str
    config_json: str


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    version: int
    digest: str
    base_model: str
    rank: int
    alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    pinned: bool
    size_bytes: int
    created_at: float
    description: str = ""
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True)
class AdapterEventInfo:
    event_id: int
    kind: str  # REGISTERED | DELETED | PINNED | UNPINNED
    adapter: AdapterInfo


@dataclass(frozen=True)
class AdapterSpecIn:
    """A validated `AdapterSpec`."""

    name: str
    base_model: str = ""
    pinned: bool = False
    description: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    source_uri: str = ""


@dataclass(frozen=True)
class AdapterFiles:
    """The two files of a PEFT adapter, spooled to local disk."""

    config_path: Path
    weights_path: Path


def check_name(name: str, field_name: str = "name") -> str:
    if not NAME_RE.fullmatch(name):
        raise InvalidArgument(
            f"{field_name} {name[:140]!r} is invalid: use 1-128 characters of a-z, 0-9, '.', '_', '-',"
            " starting with a letter or digit"
        )
    return name


def make_spec(
    name: str,
    base_model: str = "",
    pinned: bool = False,
    description: str = "",
    labels: dict[str, str] | None = None,
    source_uri: str = "",
) -> AdapterSpecIn:
    """Validate the fields of an AdapterSpec; raises InvalidArgument naming the bad field."""
    check_name(name)
    if base_model:
        check_name(base_model, "base_model")
    if len(description) > MAX_DESCRIPTION_LEN:
        raise InvalidArgument(f"description is longer than {MAX_DESCRIPTION_LEN} characters")
    labels = dict(labels or {})
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(f"labels: more than {MAX_LABELS} entries")
    for key, value in labels.items():
        if not key or len(key) > MAX_LABEL_LEN or len(value) > MAX_LABEL_LEN:
            raise InvalidArgument(
                f"labels[{key[:64]!r}]: keys must be 1-{MAX_LABEL_LEN} characters, values at most {MAX_LABEL_LEN}"
            )
    return AdapterSpecIn(name, base_model, pinned, description, labels, source_uri)


def parse_ref(ref: str) -> tuple[str, int]:
    """'name' -> (name, 0 = latest); 'name@3' -> (name, 3)."""
    name, sep, version = ref.partition("@")
    check_name(name, "adapter")
    if not sep:
        return name, 0
    if not version.isdigit() or int(version) < 1:
        raise InvalidArgument(f"adapter {ref!r}: the version after '@' must be a positive integer")
    return name, int(version)
