"""Plain records the registry's service layer hands to its servicer (protobuf stops at the servicer)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from loraformat.names import MAX_VERSION, check_name  # adapter identity belongs to the adapter format
from registry.errors import InvalidArgument, quote

MAX_DESCRIPTION_LEN = 4096
MAX_LABELS = 64
MAX_LABEL_LEN = 256
MAX_SOURCE_URI_LEN = 2048
MAX_EVENT_ID = (1 << 63) - 1  # a SQL BIGINT (uint64 on the wire)
# C0 and C1 control characters and DEL, newline and tab aside: PostgreSQL refuses NUL in text, and
# the others garble terminals and logs that print these fields.
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


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
    tenant: str = ""  # the owner ("" when registered without authentication)
    public: bool = False

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
    public: bool = False


@dataclass(frozen=True)
class AdapterFiles:
    """The two files of a PEFT adapter, spooled to local disk."""

    config_path: Path
    weights_path: Path


def check_version(version: int, field_name: str = "version") -> int:
    """0 (latest / every version) or a version a row can hold; checked before it reaches SQL."""
    if not 0 <= version <= MAX_VERSION:
        raise InvalidArgument(f"{field_name} {version} is out of range (0 to {MAX_VERSION})")
    return version


def check_text(value: str, field_name: str, max_len: int, min_len: int = 0) -> str:
    """A free-text field: min_len..max_len characters, no control characters but newline and tab."""
    if not min_len <= len(value) <= max_len:
        raise InvalidArgument(
            f"{field_name} has {len(value)} characters; expected {min_len} to {max_len}"
        )
    bad = _CONTROL_RE.search(value)
    if bad:
        raise InvalidArgument(
            f"{field_name} holds the control character U+{ord(bad.group()):04X} at index {bad.start()}"
        )
    return value


def make_spec(
    name: str,
    base_model: str = "",
    pinned: bool = False,
    description: str = "",
    labels: dict[str, str] | None = None,
    source_uri: str = "",
    public: bool = False,
) -> AdapterSpecIn:
    """Validate the fields of an AdapterSpec; raises InvalidArgument naming the bad field."""
    check_name(name)
    if base_model:
        check_name(base_model, "base_model")
    check_text(description, "description", MAX_DESCRIPTION_LEN)
    check_text(source_uri, "source_uri", MAX_SOURCE_URI_LEN)
    labels = dict(labels or {})
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(f"labels: more than {MAX_LABELS} entries")
    for key, value in labels.items():
        check_text(key, f"labels key {quote(key, 40)}", MAX_LABEL_LEN, min_len=1)
        check_text(value, f"labels[{quote(key, 40)}]", MAX_LABEL_LEN)
    return AdapterSpecIn(name, base_model, pinned, description, labels, source_uri, public)
