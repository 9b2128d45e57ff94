"""SQL schema and engine setup of the registry (SQLAlchemy 2; SQLite by default, PostgreSQL by URL).

Invariants:
- `adapters` holds one row per live (name, version); versions are never reused, because
  `adapter_names.last_version` survives deletion (a name's tombstone).
- `adapter_events` rows are written in the same transaction as the change they describe, so a
  watcher that reads events in id order sees every committed change exactly once.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy import (
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# SQLite only auto-increments an INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    pass


class BaseModelRow(Base):
    __tablename__ = "base_models"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    config_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)


class AdapterNameRow(Base):
    """One row per adapter name ever registered: the lock target and version counter of a name."""

    __tablename__ = "adapter_names"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    base_model_id: Mapped[int] = mapped_column(ForeignKey("base_models.id"))
    last_version: Mapped[int] = mapped_column(Integer, default=0)
    tenant: Mapped[str] = mapped_column(String(64), default="")  # the owner, set by the first registration


class AdapterRow(Base):
    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("name", "version", name="uq_adapters_name_version"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), ForeignKey("adapter_names.name"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    digest: Mapped[str] = mapped_column(String(64), index=True)
    base_model_id: Mapped[int] = mapped_column(ForeignKey("base_models.id"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[float] = mapped_column(Float)
    scaling: Mapped[float] = mapped_column(Float)
    target_modules: Mapped[str] = mapped_column(Text)  # comma-separated, DESIGN module order
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[float] = mapped_column(Float)
    description: Mapped[str] = mapped_column(Text, default="")
    labels_json: Mapped[str] = mapped_column(Text, default="{}")
    tenant: Mapped[str] = mapped_column(String(64), default="", index=True)  # = its name's tenant
    public: Mapped[bool] = mapped_column(Boolean, default=False)


class AdapterEventRow(Base):
    __tablename__ = "adapter_events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(16))
    base_model: Mapped[str] = mapped_column(String(128), index=True)
    adapter_json: Mapped[str] = mapped_column(Text)  # snapshot of the adapter as of the event
    created_at: Mapped[float] = mapped_column(Float)


class ApiKeyRow(Base):
    """An API key: only the sha256 of its secret is kept (loramux/security.py)."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    key_id: Mapped[str] = mapped_column(String(16), unique=True)
    secret_sha256: Mapped[str] = mapped_column(String(64))
    tenant: Mapped[str] = mapped_column(String(64))
    role: Mapped[str] = mapped_column(String(16))
    description: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class AuditRow(Base):
    """One mutation or refusal; written in the same transaction as the change it describes."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    at: Mapped[float] = mapped_column(Float)
    key_id: Mapped[str] = mapped_column(String(16))
    tenant: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(32))
    target: Mapped[str] = mapped_column(String(256))
    outcome: Mapped[str] = mapped_column(String(32))  # OK or the refusal's status name


def make_engine(url: str) -> Engine:
    """Create the SQLAlchemy engine; SQLite gets WAL, a busy timeout and immediate transactions."""
    if not url.startswith("sqlite"):
        # A bounded connect: an unreachable server must fail a request (UNAVAILABLE), not hang it.
        return create_engine(url, pool_pre_ping=True, future=True, connect_args={"connect_timeout": 5})
    path = url.split("///", 1)[-1]
    if path and path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})
    _make_sqlite_transactions_immediate(engine)
    return engine


def _make_sqlite_transactions_immediate(engine: Engine) -> None:
    # pysqlite's deferred BEGIN lets two writers both read the old version counter and then fail
    # with SQLITE_BUSY on upgrade; BEGIN IMMEDIATE takes the write lock up front and the busy
    # timeout queues the second writer instead.
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection):
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def migrate(engine: Engine) -> None:
    """Apply every Alembic migration (registry/migrations) up to head."""
    from alembic import command
    from alembic.config import Config

    # Alembic logs every step at INFO ("Context impl", "Will assume transactional DDL", each upgrade):
    # seven lines at every start say nothing to an operator. Warnings still show.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
    with engine.begin() as connection:
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, "head")
