"""Registry backends for tests: SQLite or the real PostgreSQL, a local dir or S3 (moto) on loopback."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy

PG_ADMIN_URL = os.environ.get("LORAMUX_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def postgres_available() -> bool:
    try:
        engine = sqlalchemy.create_engine(PG_ADMIN_URL, connect_args={"connect_timeout": 3})
        with engine.connect():
            pass
        engine.dispose()
        return True
    except sqlalchemy.exc.OperationalError:
        return False


def require_postgres() -> None:
    """Skip without PostgreSQL on a developer machine; fail in CI, where it must run."""
    if postgres_available():
        return
    if os.environ.get("CI"):
        pytest.fail(f"PostgreSQL is not reachable at {PG_ADMIN_URL}; .ci/run starts it")
    pytest.skip(f"PostgreSQL is not reachable at {PG_ADMIN_URL}")


@contextmanager
def fresh_postgres_database() -> Iterator[str]:
    """A new empty database for one test; dropped afterwards."""
    require_postgres()
    name = f"loramux_t_{uuid.uuid4().hex[:12]}"
    admin = sqlalchemy.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()
