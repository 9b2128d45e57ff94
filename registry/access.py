"""The SQL owner of API keys and the audit log.

Keys are stored as (key id, sha256 of the secret, tenant, role); the full key exists only in the
answer to its creation. Audit rows of a change are written inside the change's own transaction
(`audit_in`, called by the catalog and by the key methods here); refusals, which change nothing, get
a transaction of their own (`record_refusal`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from loramux.security import (
    Principal,
    Role,
    check_tenant,
    new_key,
    parse_role,
    same_hash,
    split_key,
    write_secret_file,
)
from registry.db import ApiKeyRow, AuditRow
from registry.errors import InvalidArgument, NotFound
from registry.types import check_text

MAX_AUDIT_LIMIT = 10_000
MAX_KEY_DESCRIPTION_LEN = 256
_TARGET_CHARS = 256


@dataclass(frozen=True)
class KeyInfo:
    key_id: str
    tenant: str
    role: str
    description: str
    created_at: float
    revoked_at: float | None


@dataclass(frozen=True)
class AuditInfo:
    id: int
    at: float
    key_id: str
    tenant: str
    action: str
    target: str
    outcome: str


def audit_in(s: Session, caller: Principal, action: str, target: str, outcome: str = "OK") -> None:
    """Add an audit row to the open transaction `s`."""
    s.add(
        AuditRow(
            at=time.time(),
            key_id=caller.key_id,
            tenant=caller.tenant,
            action=action,
            target=target[:_TARGET_CHARS],
            outcome=outcome,
        )
    )


class AccessStore:
    def __init__(self, engine: Engine):
        self.engine = engine

    # ---- keys --------------------------------------------------------------------------------

    def create_key(self, caller: Principal, tenant: str, role: str, description: str = "") -> tuple[str, KeyInfo]:
        """(the full key, shown once; its record)."""
        check_tenant(tenant)
        parsed = parse_role(role)
        check_text(description, "description", MAX_KEY_DESCRIPTION_LEN)
        key, key_id, secret_hash = new_key()
        row = ApiKeyRow(
            key_id=key_id,
            secret_sha256=secret_hash,
            tenant=tenant,
            role=parsed.value,
            description=description,
            created_at=time.time(),
            revoked_at=None,
        )
        with Session(self.engine, expire_on_commit=False) as s, s.begin():
            s.add(row)
            audit_in(s, caller, "key_create", f"{key_id} {tenant} {parsed.value}")
        return key, _key_info(row)

    def list_keys(self) -> list[KeyInfo]:
        with Session(self.engine) as s:
            return [_key_info(r) for r in s.scalars(select(ApiKeyRow).order_by(ApiKeyRow.id))]

    def revoke_key(self, caller: Principal, key_id: str) -> KeyInfo:
        with Session(self.engine, expire_on_commit=False) as s, s.begin():
            row = s.scalar(select(ApiKeyRow).where(ApiKeyRow.key_id == key_id[:16]).with_for_update())
            if row is None:
                raise NotFound(f"key {key_id[:16]!r} does not exist")
            if row.revoked_at is None:
                row.revoked_at = time.time()
                audit_in(s, caller, "key_revoke", row.key_id)
            return _key_info(row)

    def authenticate(self, key: str) -> Principal | None:
        """The principal of a valid, unrevoked key; None otherwise."""
        parts = split_key(key)
        if parts is None:
            return None
        key_id, secret_hash = parts
        with Session(self.engine) as s:
            row = s.scalar(select(ApiKeyRow).where(ApiKeyRow.key_id == key_id))
        if row is None or row.revoked_at is not None or not same_hash(row.secret_sha256, secret_hash):
            return None
        return Principal(row.key_id, row.tenant, Role(row.role))

    def ensure_key_file(self, path: Path, tenant: str, role: Role, system: Principal) -> bool:
        """Make sure the key in `path` exists; True when a new key was made and written.

        No file: a new key is created and written there (mode 0600); two processes starting together
        both write at most once, and the loser's key is revoked at once. A file that holds a key this
        database does not know (an operator's Secret, a replica's shared file) is adopted with
        `tenant` and `role`; a revoked key stays revoked."""
        if path.exists():
            self._adopt(path.read_text().strip(), tenant, role, system, path)
            return False
        key, info = self.create_key(system, tenant, role.value, f"written to {path.name} at first start")
        if write_secret_file(path, key):
            return True
        self.revoke_key(system, info.key_id)
        self._adopt(path.read_text().strip(), tenant, role, system, path)
        return False

    def _adopt(self, key: str, tenant: str, role: Role, system: Principal, path: Path) -> None:
        parts = split_key(key)
        if parts is None:
            raise ValueError(f"{path} does not hold a loramux key (lmx_<12 hex digits>_<43 characters>)")
        key_id, secret_hash = parts
        with Session(self.engine, expire_on_commit=False) as s, s.begin():
            row = s.scalar(select(ApiKeyRow).where(ApiKeyRow.key_id == key_id).with_for_update())
            if row is not None:
                if not same_hash(row.secret_sha256, secret_hash):
                    raise ValueError(f"{path}: key {key_id} exists with another secret")
                return
            s.add(
                ApiKeyRow(
                    key_id=key_id, secret_sha256=secret_hash, tenant=check_tenant(tenant), role=role.value,
                    description=f"adopted from {path.name}", created_at=time.time(), revoked_at=None,
                )
            )
            audit_in(s, system, "key_create", f"{key_id} {tenant} {role.value} (from {path.name})")

    # ---- audit -------------------------------------------------------------------------------

    def record_refusal(self, caller: Principal, action: str, target: str, outcome: str) -> None:
        with Session(self.engine) as s, s.begin():
            audit_in(s, caller, action, target, outcome)

    def list_audit(self, limit: int = 100) -> list[AuditInfo]:
        """The newest `limit` rows, newest first."""
        if not 1 <= limit <= MAX_AUDIT_LIMIT:
            raise InvalidArgument(f"limit {limit} is out of range (1 to {MAX_AUDIT_LIMIT})")
        with Session(self.engine) as s:
            rows = s.scalars(select(AuditRow).order_by(AuditRow.id.desc()).limit(limit))
            return [
                AuditInfo(r.id, r.at, r.key_id, r.tenant, r.action, r.target, r.outcome) for r in rows
            ]


def _key_info(row: ApiKeyRow) -> KeyInfo:
    return KeyInfo(row.key_id, row.tenant, row.role, row.description, row.created_at, row.revoked_at)
