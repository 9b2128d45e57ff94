"""The SQL owner on SQLite and on the real PostgreSQL: versions under contention, migrations, events."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import pytest
from sqlalchemy import inspect

from registry.catalog import Catalog, NewVersion
from registry.db import make_engine, migrate
from registry.errors import AlreadyExists, InvalidArgument, NotFound
from tests.registry.backends import fresh_postgres_database

CONFIG = '{"model_type": "llama", "hidden_size": 64}'


@pytest.fixture(params=["sqlite", "postgres"])
def catalog(request, tmp_path):
    with ExitStack() as stack:
        url = stack.enter_context(fresh_postgres_database()) if request.param == "postgres" else f"sqlite:///{tmp_path}/r.db"
        engine = make_engine(url)
        migrate(engine)
        migrate(engine)  # applying twice is a no-op
        cat = Catalog(engine)
        cat.register_base_model("base", CONFIG)
        yield cat
        engine.dispose()


def version(digest: str) -> NewVersion:
    return NewVersion(digest, 8, 16.0, 2.0, ("q_proj",), 100, False, "", {})


def test_migrations_create_every_table(catalog):
    tables = set(inspect(catalog.engine).get_table_names())
    assert {"base_models", "adapter_names", "adapters", "adapter_events", "alembic_version"} <= tables


def test_racing_registrations_get_distinct_consecutive_versions(catalog):
    num_threads = 8
    barrier = threading.Barrier(num_threads)

    def register(i: int) -> int:
        barrier.wait()
        return catalog.add_version("race", "base", version(f"{i:064x}")).version

    with ThreadPoolExecutor(num_threads) as pool:
        versions = list(pool.map(register, range(num_threads)))
    assert sorted(versions) == list(range(1, num_threads + 1))
    rows, _ = catalog.list(name_prefix="race")
    assert sorted(r.version for r in rows) == list(range(1, num_threads + 1))
    events = catalog.events_after(0)
    assert sorted(e.adapter.version for e in events) == list(range(1, num_threads + 1))


def test_racing_identical_registrations_make_one_version(catalog):
    barrier = threading.Barrier(6)

    def register(_: int) -> int:
        barrier.wait()
        return catalog.add_version("same", "base", version("a" * 64)).version

    with ThreadPoolExecutor(6) as pool:
        assert set(pool.map(register, range(6))) == {1}
    assert len(catalog.events_after(0)) == 1


def test_name_is_bound_to_its_base_model(catalog):
    catalog.register_base_model("other", CONFIG)
    catalog.add_version("bot", "base", version("a" * 64))
    with pytest.raises(AlreadyExists, match="bot"):
        catalog.add_version("bot", "other", version("b" * 64))
    catalog.delete("bot")
    assert catalog.add_version("bot", "other", version("b" * 64)).version == 2


def test_base_model_resolution_and_idempotence(catalog):
    assert catalog.resolve_base_model("").name == "base"
    assert catalog.register_base_model("base", '{"hidden_size": 64, "model_type": "llama"}').name == "base"
    with pytest.raises(AlreadyExists):
        catalog.register_base_model("base", '{"model_type": "llama", "hidden_size": 65}')
    with pytest.raises(NotFound, match="nope"):
        catalog.resolve_base_model("nope")
    catalog.register_base_model("second", CONFIG)
    with pytest.raises(InvalidArgument, match="several"):
        catalog.resolve_base_model("")


def test_events_snapshot_deleted_adapters(catalog):
    catalog.add_version("bot", "base", version("a" * 64))
    catalog.set_pinned("bot", 0, True)
    catalog.set_pinned("bot", 0, True)  # no change, no event
    catalog.delete("bot")
    events = catalog.events_after(0)
    assert [e.kind for e in events] == ["REGISTERED", "PINNED", "DELETED"]
    assert events[-1].adapter.pinned and events[-1].adapter.digest == "a" * 64
    assert catalog.events_after(events[0].event_id, base_model="other") == []
    assert catalog.last_event_id() == events[-1].event_id
