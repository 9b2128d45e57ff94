"""The registry's SQL owner: base models, adapter versions and the event log.

Every method is one transaction. Registering a version locks the name's `adapter_names` row
(SELECT ... FOR UPDATE on PostgreSQL, BEGIN IMMEDIATE on SQLite), so concurrent registrations of
one name get consecutive versions and an identical re-registration returns the existing version.

Tenancy: a name belongs to the tenant that first registered it; each version is private to that
tenant unless registered public. Reads see only what `caller` may see ("latest" is the latest version
the caller can see); a version it cannot see is NotFound, never PermissionDenied, so names do not
leak. Every change writes its audit row in the change's own transaction (registry/access.py).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import itertools
import json
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import Select, bindparam, exists, func, select, text
from sqlalchemy.engine import Connection, Engine, Row
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session, aliased

from loramux.security import ANONYMOUS, PermissionDenied, Principal
from registry.access import audit_in
from registry.db import AdapterEventRow, AdapterNameRow, AdapterRow, BaseModelRow
from registry.errors import AlreadyExists, Code, InvalidArgument, NotFound, RegistryError, quote
from registry.types import MAX_VERSION, AdapterEventInfo, AdapterInfo, BaseModelInfo

MAX_PAGE_SIZE = 1000
MAX_TOKEN_CHARS = 1024
DEFAULT_PAGE_SIZE = 100
_RETRIES = 8
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class NewVersion:
    """What a compiled adapter contributes to its row."""

    digest: str
    rank: int
    alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    size_bytes: int
    pinned: bool
    description: str
    labels: dict[str, str]
    public: bool = False


class Catalog:
    def __init__(self, engine: Engine):
        self.engine = engine

    # ---- base models -------------------------------------------------------------------------

    def register_base_model(self, name: str, config_json: str, caller: Principal = ANONYMOUS) -> BaseModelInfo:
        """Insert a base model; idempotent for an identical config (compared as parsed JSON)."""
        parsed = json.loads(config_json)

        def txn(s: Session) -> BaseModelInfo:
            row = s.scalar(select(BaseModelRow).where(BaseModelRow.name == name))
            if row is None:
                s.add(BaseModelRow(name=name, config_json=config_json, created_at=time.time()))
                audit_in(s, caller, "register_base_model", name)
                return BaseModelInfo(name, config_json)
            if json.loads(row.config_json) != parsed:
                raise AlreadyExists(f"base model {name!r} is already registered with a different config")
            return BaseModelInfo(row.name, row.config_json)

        return self._run(txn)

    def list_base_models(self) -> list[BaseModelInfo]:
        with Session(self.engine) as s:
            rows = s.scalars(select(BaseModelRow).order_by(BaseModelRow.name))
            return [BaseModelInfo(r.name, r.config_json) for r in rows]

    def resolve_base_model(self, name: str) -> BaseModelInfo:
        """'' means the only base model (INVALID_ARGUMENT when there are none or several)."""
        with Session(self.engine) as s:
            if name:
                row = s.scalar(select(BaseModelRow).where(BaseModelRow.name == name))
                if row is None:
                    raise NotFound(f"base_model {name!r} is not registered")
                return BaseModelInfo(row.name, row.config_json)
            rows = s.scalars(select(BaseModelRow).limit(2)).all()
        if len(rows) != 1:
            found = "no base model is" if not rows else "several base models are"
            raise InvalidArgument(f"base_model is empty and {found} registered: name one")
        return BaseModelInfo(rows[0].name, rows[0].config_json)

    # ---- adapters ----------------------------------------------------------------------------

    def add_version(
        self, name: str, base_model: str, new: NewVersion, caller: Principal = ANONYMOUS
    ) -> AdapterInfo:
        """Commit a new version of `name`, or return the latest when its digest equals new.digest."""

        def txn(s: Session) -> AdapterInfo:
            base = s.scalar(select(BaseModelRow).where(BaseModelRow.name == base_model))
            if base is None:
                raise NotFound(f"base_model {base_model!r} is not registered")
            name_row = s.get(AdapterNameRow, name, with_for_update=True)
            if name_row is None:
                name_row = AdapterNameRow(name=name, base_model_id=base.id, last_version=0, tenant=caller.tenant)
                s.add(name_row)
                s.flush()  # a concurrent first registration fails here and is retried
            _check_owner(s, name_row, caller)
            latest = s.scalar(_live(name).order_by(AdapterRow.version.desc()).limit(1))
            if name_row.base_model_id != base.id:
                if latest is not None:
                    raise AlreadyExists(f"adapter {name!r} already exists for another base model")
                name_row.base_model_id = base.id
            if latest is not None and latest.digest == new.digest:
                return _info(latest, base.name)
            name_row.last_version += 1
            row = _new_row(name, name_row.last_version, base.id, new, name_row.tenant)
            s.add(row)
            s.flush()
            info = _info(row, base.name)
            _log_event(s, "REGISTERED", info)
            audit_in(s, caller, "register", info.ref)
            return info

        return self._run(txn)

    def get(self, name: str, version: int = 0, caller: Principal = ANONYMOUS) -> AdapterInfo:
        """The version `caller` sees (the latest when version is 0), or NotFound. Engines resolve each
        request's adapter through this: its statement is built once (_LOOKUPS), not per call."""
        with self.engine.connect() as c:  # rows, not ORM objects: nothing here is changed
            found = _first_visible(c, _LOOKUPS, name, version, caller)
        return _info(found, found.base_model_name)

    def referenced_digests(self) -> set[str]:
        with Session(self.engine) as s:
            return set(s.scalars(select(AdapterRow.digest).distinct()))

    def list(
        self,
        base_model: str = "",
        name_prefix: str = "",
        page_size: int = 0,
        page_token: str = "",
        latest_only: bool = False,
        caller: Principal = ANONYMOUS,
    ) -> tuple[list[AdapterInfo], str]:
        """A page of the adapters `caller` sees, ordered by (name, version), and the token of the next
        page ('' at the end). latest_only: the latest version of each name the caller sees."""
        size = page_size or DEFAULT_PAGE_SIZE
        if size > MAX_PAGE_SIZE:
            raise InvalidArgument(f"page_size {page_size} is over the maximum of {MAX_PAGE_SIZE}")
        query = _visible(_with_base(select(AdapterRow, BaseModelRow.name)), AdapterRow, caller)
        if base_model:
            query = query.where(BaseModelRow.name == base_model)
        if name_prefix:
            query = query.where(AdapterRow.name.startswith(name_prefix, autoescape=True))
        if latest_only:
            newer = aliased(AdapterRow)
            query = query.where(
                ~_visible(exists(), newer, caller).where(newer.name == AdapterRow.name, newer.version > AdapterRow.version)
            )
        if page_token:
            after_name, after_version = _decode_token(page_token)
            query = query.where(
                (AdapterRow.name > after_name)
                | ((AdapterRow.name == after_name) & (AdapterRow.version > after_version))
            )
        query = query.order_by(AdapterRow.name, AdapterRow.version).limit(size + 1)
        with Session(self.engine) as s:
            rows = s.execute(query).all()
        infos = [_info(row, base) for row, base in rows[:size]]
        next_token = _encode_token(infos[-1]) if len(rows) > size else ""
        return infos, next_token

    def delete(self, name: str, version: int = 0, caller: Principal = ANONYMOUS) -> list[AdapterInfo]:
        """Delete one version, or every version the caller sees when version is 0; a DELETED event each."""

        def txn(s: Session) -> list[AdapterInfo]:
            query = _with_base(select(AdapterRow, BaseModelRow.name)).where(AdapterRow.name == name)
            if version:
                query = query.where(AdapterRow.version == version)
            query = _visible(query, AdapterRow, caller)
            rows = s.execute(query.order_by(AdapterRow.version).with_for_update()).all()
            if not rows:
                raise NotFound(f"adapter {_ref(name, version)!r} is not registered")
            _check_may_change(rows[0][0].tenant, caller, _ref(name, version))
            infos = [_info(row, base) for row, base in rows]
            for (row, _), info in zip(rows, infos, strict=True):
                s.delete(row)
                _log_event(s, "DELETED", info)
                audit_in(s, caller, "delete", info.ref)
            return infos

        return self._run(txn)

    def set_pinned(self, name: str, version: int, pinned: bool, caller: Principal = ANONYMOUS) -> AdapterInfo:
        def txn(s: Session) -> AdapterInfo:
            row, base = self._get_row(s, name, version, caller)
            _check_may_change(row.tenant, caller, _ref(name, version))
            if row.pinned == pinned:
                return _info(row, base)
            row.pinned = pinned
            info = _info(row, base)
            _log_event(s, "PINNED" if pinned else "UNPINNED", info)
            audit_in(s, caller, "pin" if pinned else "unpin", info.ref)
            return info

        return self._run(txn)

    # ---- events ------------------------------------------------------------------------------

    def events_after(self, event_id: int, base_model: str = "", limit: int = 500) -> list[AdapterEventInfo]:
        query = select(AdapterEventRow).where(AdapterEventRow.id > event_id)
        if base_model:
            query = query.where(AdapterEventRow.base_model == base_model)
        with Session(self.engine) as s:
            rows = s.scalars(query.order_by(AdapterEventRow.id).limit(limit)).all()
            return [AdapterEventInfo(r.id, r.kind, _info_from_json(r.adapter_json)) for r in rows]

    def ping(self) -> None:
        """One round trip to the database; raises when it cannot be reached."""
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    def last_event_id(self) -> int:
        with Session(self.engine) as s:
            return s.scalar(select(func.max(AdapterEventRow.id))) or 0

    # ---- helpers -----------------------------------------------------------------------------

    def _get_row(self, s: Session, name: str, version: int, caller: Principal):
        """(ORM row, base model name) of the version `caller` sees, locked for update."""
        return _first_visible(s, _ROW_LOOKUPS_FOR_UPDATE, name, version, caller)

    def _run(self, txn: Callable[[Session], T]) -> T:
        """Run txn in its own transaction, retrying races on unique keys and SQLite's busy lock."""
        for attempt in range(_RETRIES):
            try:
                with Session(self.engine, expire_on_commit=False) as s, s.begin():
                    return txn(s)
            except (IntegrityError, OperationalError) as exc:
                if not _is_retryable(exc):
                    raise  # e.g. the database is down: registry.faults says UNAVAILABLE
                if attempt == _RETRIES - 1:
                    raise RegistryError(
                        f"database conflict, try again: {exc.orig}", Code.UNAVAILABLE
                    ) from exc
                time.sleep(0.01 * (attempt + 1))
        raise AssertionError("unreachable")


def _is_retryable(exc: Exception) -> bool:
    if isinstance(exc, IntegrityError):
        return True
    text = str(exc).lower()
    return "locked" in text or "deadlock" in text or "could not serialize" in text


def _live(name: str) -> Select:
    return select(AdapterRow).where(AdapterRow.name == name)


def _visible(query, table, caller: Principal):
    """Only rows `caller` may see (its tenant's and public ones; every row for admins and engines)."""
    if caller.sees_all:
        return query
    return query.where(_seen_by(table, caller.tenant))


def _seen_by(table, tenant):
    """The rows a tenant's caller sees (`tenant`: a value or a bound parameter)."""
    return (table.tenant == tenant) | table.public


def _check_may_change(tenant: str, caller: Principal, ref: str) -> None:
    if not caller.can_change(tenant):
        raise PermissionDenied(f"adapter {ref!r}: this key ({caller.role.value}) may not change it")


def _check_owner(s: Session, name_row: AdapterNameRow, caller: Principal) -> None:
    """Only the name's tenant (or an admin) adds versions. When the caller sees no version of a name
    another tenant holds, the refusal must not say whose it is or what it holds: a name is global, so
    its being taken cannot be hidden from someone who wants it, but nothing more is told."""
    if caller.can_change(name_row.tenant):
        return
    if name_row.tenant != caller.tenant:
        seen = s.scalar(_visible(select(AdapterRow.id), AdapterRow, caller).where(AdapterRow.name == name_row.name).limit(1))
        if seen is None:
            raise AlreadyExists(f"adapter name {name_row.name!r} is not available; choose another")
    raise PermissionDenied(f"adapter {name_row.name!r}: this key ({caller.role.value}) may not register versions of it")


def _with_base(query: Select) -> Select:
    return query.join(BaseModelRow, AdapterRow.base_model_id == BaseModelRow.id)


def _lookups(columns: tuple, for_update: bool = False) -> dict[tuple[bool, bool], Select]:
    """The query of one adapter version a caller sees, the latest when no version is asked for, built
    once for each (caller sees all, version asked for): its values are parameters (name; tenant unless
    the caller sees all; version), which _first_visible fills."""
    lookups = {}
    for sees_all, versioned in itertools.product((False, True), repeat=2):
        query = _with_base(select(*columns)).where(AdapterRow.name == bindparam("name"))
        if not sees_all:
            query = query.where(_seen_by(AdapterRow, bindparam("tenant")))
        if versioned:
            query = query.where(AdapterRow.version == bindparam("version"))
        query = query.order_by(AdapterRow.version.desc()).limit(1)
        lookups[sees_all, versioned] = query.with_for_update() if for_update else query
    return lookups


# plain rows for reads (Catalog.get: every request's resolution); ORM rows, locked, for changes
_LOOKUPS = _lookups((*AdapterRow.__table__.columns, BaseModelRow.name.label("base_model_name")))
_ROW_LOOKUPS_FOR_UPDATE = _lookups((AdapterRow, BaseModelRow.name), for_update=True)


def _first_visible(executor: Session | Connection, lookups: dict[tuple[bool, bool], Select], name: str, version: int, caller: Principal):
    """The row of `lookups` for name@version as `caller` sees it, or NotFound."""
    params = {"name": name} | ({"version": version} if version else {}) | ({} if caller.sees_all else {"tenant": caller.tenant})
    found = executor.execute(lookups[caller.sees_all, bool(version)], params).first()
    if found is None:
        raise NotFound(f"adapter {_ref(name, version)!r} is not registered")
    return found


def _ref(name: str, version: int) -> str:
    return f"{name}@{version}" if version else name


def _new_row(name: str, version: int, base_model_id: int, new: NewVersion, tenant: str) -> AdapterRow:
    return AdapterRow(
        tenant=tenant,
        public=new.public,
        name=name,
        version=version,
        digest=new.digest,
        base_model_id=base_model_id,
        rank=new.rank,
        alpha=new.alpha,
        scaling=new.scaling,
        target_modules=",".join(new.target_modules),
        pinned=new.pinned,
        size_bytes=new.size_bytes,
        created_at=time.time(),
        description=new.description,
        labels_json=json.dumps(new.labels, sort_keys=True),
    )


def _info(row: AdapterRow | Row, base_model: str) -> AdapterInfo:
    """An adapter version's info from its ORM row, or from a plain row of the same columns."""
    return AdapterInfo(
        name=row.name,
        version=row.version,
        digest=row.digest,
        base_model=base_model,
        rank=row.rank,
        alpha=row.alpha,
        scaling=row.scaling,
        target_modules=tuple(m for m in row.target_modules.split(",") if m),
        pinned=row.pinned,
        size_bytes=row.size_bytes,
        created_at=row.created_at,
        description=row.description,
        labels=json.loads(row.labels_json),
        tenant=row.tenant,
        public=row.public,
    )


def _info_from_json(text: str) -> AdapterInfo:
    data = json.loads(text)
    data["target_modules"] = tuple(data["target_modules"])
    return AdapterInfo(**data)


# Event ids come from a sequence when the row is inserted, but transactions may commit in another
# order; a watcher that has seen id 11 would then never see a later-committed id 10. One transaction-
# scoped advisory lock around event writes makes ids commit in id order (SQLite's BEGIN IMMEDIATE
# already serializes writers).
_EVENT_LOCK_KEY = 0x6C6F7261  # "lora"
NOTIFY_CHANNEL = "loramux_events"


def _log_event(s: Session, kind: str, info: AdapterInfo) -> None:
    if s.get_bind().dialect.name == "postgresql":
        s.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _EVENT_LOCK_KEY})
        # delivered at commit to every replica's LISTEN connection (registry/event_feed.py)
        s.execute(text("SELECT pg_notify(:channel, '')"), {"channel": NOTIFY_CHANNEL})
    snapshot = json.dumps(dataclasses.asdict(info), sort_keys=True)
    s.add(
        AdapterEventRow(kind=kind, base_model=info.base_model, adapter_json=snapshot, created_at=time.time())
    )


def _encode_token(last: AdapterInfo) -> str:
    raw = json.dumps([last.name, last.version]).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _decode_token(token: str) -> tuple[str, int]:
    try:
        if len(token) <= MAX_TOKEN_CHARS:
            # json.loads recurses on nesting: only a flat [name, version] list is parsed at all.
            raw = base64.urlsafe_b64decode(token.encode())
            if raw.count(b"[") == 1 and b"{" not in raw:
                name, version = json.loads(raw)
                if isinstance(name, str) and isinstance(version, int) and 1 <= version <= MAX_VERSION:
                    return name, version
    except (binascii.Error, ValueError, TypeError):
        pass
    raise InvalidArgument(f"page_token {quote(token, 64)} is not a token this registry issued")
