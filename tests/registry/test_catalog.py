"""The SQL owner on SQLite and on the real PostgreSQL: versions under contention, migrations, events."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

import pytest
from sqlalchemy import inspect, select, text
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from loramux.security import PermissionDenied, Principal, Role
from registry.catalog import _EVENT_LOCK_KEY, NOTIFY_CHANNEL, Catalog, NewVersion
from registry.db import AuditRow, make_engine, migrate
from registry.errors import AlreadyExists, Code, InvalidArgument, NotFound, RegistryError
from registry.types import MAX_VERSION, BaseModelInfo
from tests.registry.backends import fresh_postgres_database

CONFIG = '{"model_type": "llama", "hidden_size": 64}'
# registry.proto: page_size 0 = 100, at most 1000; page tokens over 1024 characters are not read. Spelled
# out here so that a test does not follow a changed constant of the code.
MAX_PAGE_SIZE = 1000
MAX_TOKEN_CHARS = 1024


@contextmanager
def open_catalog(url: str) -> Iterator[Catalog]:
    engine = make_engine(url)
    try:
        migrate(engine)
        migrate(engine)  # applying twice is a no-op
        cat = Catalog(engine)
        cat.register_base_model("base", CONFIG)
        yield cat
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def catalog(request, tmp_path):
    with ExitStack() as stack:
        url = stack.enter_context(fresh_postgres_database()) if request.param == "postgres" else f"sqlite:///{tmp_path}/r.db"
        yield stack.enter_context(open_catalog(url))


@pytest.fixture
def pg_catalog():
    with fresh_postgres_database() as url, open_catalog(url) as cat:
        yield cat


def version(digest: str, **changes) -> NewVersion:
    return NewVersion(digest.ljust(64, "0"), 8, 16.0, 2.0, ("q_proj",), 100, False, "", {}, **changes)


TEAM_A = Principal("pub-a", "team-a", Role.PUBLISHER)
TEAM_A_USER = Principal("user-a", "team-a", Role.USER)
TEAM_B = Principal("pub-b", "team-b", Role.PUBLISHER)
ADMIN = Principal("admin", "admin", Role.ADMIN)
ENGINE = Principal("engine", "", Role.ENGINE)


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


def test_registration_fields_round_trip_and_same_digest_is_not_a_new_version(catalog):
    new = NewVersion("d" * 64, 4, 8.0, 1.5, ("q_proj", "v_proj"), 1234, True, "a bot", {"team": "x", "a": "b"})
    first = catalog.add_version("bot", "base", new)
    assert (first.name, first.version, first.digest, first.base_model) == ("bot", 1, "d" * 64, "base")
    assert (first.rank, first.alpha, first.scaling, first.target_modules) == (4, 8.0, 1.5, ("q_proj", "v_proj"))
    assert (first.pinned, first.size_bytes, first.description, first.labels) == (True, 1234, "a bot", {"a": "b", "team": "x"})
    assert catalog.get("bot") == first and catalog.get("bot", 1) == first
    assert catalog.add_version("bot", "base", new) == first  # the same digest again: the same version
    second = catalog.add_version("bot", "base", version("e"))
    assert second.version == 2 and catalog.get("bot") == second and catalog.get("bot", 1) == first
    assert catalog.add_version("bot", "base", version("e")) == second
    assert catalog.add_version("bot", "base", new).version == 3  # an older digest is a new version
    assert catalog.referenced_digests() == {"d" * 64, version("e").digest}
    # each event carries the version as registered (what a watcher is told equals what get() says)
    events = catalog.events_after(0)
    assert [(e.kind, e.adapter) for e in events] == [
        ("REGISTERED", first), ("REGISTERED", second), ("REGISTERED", catalog.get("bot", 3))
    ]
    with pytest.raises(NotFound, match="bot@4"):
        catalog.get("bot", 4)
    with pytest.raises(NotFound, match="'nobody'"):
        catalog.get("nobody")
    with pytest.raises(NotFound, match="missing-base"):
        catalog.add_version("bot2", "missing-base", version("f"))
    assert [a.name for a in catalog.list()[0]] == ["bot"] * 3


def test_a_name_moves_to_another_base_model_only_when_empty(catalog):
    catalog.register_base_model("other", CONFIG)
    catalog.add_version("bot", "base", version("a"))
    catalog.delete("bot")
    assert catalog.add_version("bot", "other", version("b")).base_model == "other"
    assert catalog.add_version("bot", "other", version("c")).version == 3  # the name now lives on "other"
    with pytest.raises(AlreadyExists, match="another base model"):
        catalog.add_version("bot", "base", version("d"))


def test_delete_one_version_or_all_and_pinning(catalog):
    for digest in "abc":
        catalog.add_version("bot", "base", version(digest))
    catalog.add_version("keep", "base", version("k"))
    start = catalog.last_event_id()
    pinned = catalog.set_pinned("bot", 2, True)
    assert pinned.pinned and pinned.version == 2 and catalog.get("bot", 2).pinned and not catalog.get("bot", 3).pinned
    assert catalog.set_pinned("bot", 2, True) == pinned  # no change: no event
    assert not catalog.set_pinned("bot", 2, False).pinned and not catalog.get("bot", 2).pinned
    assert [e.kind for e in catalog.events_after(start)] == ["PINNED", "UNPINNED"]
    start = catalog.last_event_id()
    assert [a.ref for a in catalog.delete("bot", 2)] == ["bot@2"]
    with pytest.raises(NotFound, match="bot@2"):
        catalog.delete("bot", 2)
    with pytest.raises(NotFound, match="bot@2"):
        catalog.set_pinned("bot", 2, True)
    assert [a.ref for a in catalog.list()[0]] == ["bot@1", "bot@3", "keep@1"]
    assert [a.ref for a in catalog.delete("bot")] == ["bot@1", "bot@3"]
    assert [(e.kind, e.adapter.ref) for e in catalog.events_after(start)] == [
        ("DELETED", "bot@2"), ("DELETED", "bot@1"), ("DELETED", "bot@3")
    ]
    with pytest.raises(NotFound, match="'bot'"):
        catalog.delete("bot")
    assert [a.ref for a in catalog.list()[0]] == ["keep@1"]
    assert catalog.referenced_digests() == {version("k").digest}
    # one audit row per change, none for a pin that changed nothing or a refusal
    assert [(action, target) for action, target, _ in audited(catalog)] == [
        ("register_base_model", "base"),
        *[("register", ref) for ref in ("bot@1", "bot@2", "bot@3", "keep@1")],
        ("pin", "bot@2"), ("unpin", "bot@2"),
        *[("delete", ref) for ref in ("bot@2", "bot@1", "bot@3")],
    ]


def audited(catalog: Catalog) -> list[tuple[str, str, str]]:
    with Session(catalog.engine) as s:
        return [(r.action, r.target, r.tenant) for r in s.scalars(select(AuditRow).order_by(AuditRow.id))]


def test_events_after_an_id_and_of_one_base_model(catalog):
    assert catalog.last_event_id() == 0 and catalog.events_after(0) == []
    catalog.register_base_model("other", CONFIG)
    catalog.add_version("a", "base", version("a"))
    catalog.add_version("b", "other", version("b"))
    catalog.add_version("c", "base", version("c"))
    events = catalog.events_after(0)
    assert [e.adapter.name for e in events] == ["a", "b", "c"] and catalog.last_event_id() == events[-1].event_id
    assert catalog.events_after(events[0].event_id) == events[1:]
    assert [e.adapter.name for e in catalog.events_after(0, base_model="base")] == ["a", "c"]
    assert catalog.events_after(0, limit=2) == events[:2]


def test_base_models_listed_and_resolved(catalog):
    assert catalog.register_base_model("alpha", '{"model_type": "llama"}') == BaseModelInfo("alpha", '{"model_type": "llama"}')
    assert [(m.name, m.config_json) for m in catalog.list_base_models()] == [
        ("alpha", '{"model_type": "llama"}'), ("base", CONFIG)
    ]
    assert catalog.resolve_base_model("alpha").config_json == '{"model_type": "llama"}'
    assert catalog.resolve_base_model("base").name == "base"
    catalog.register_base_model("base", CONFIG, caller=TEAM_A)  # idempotent: no second row, no audit row
    assert audited(catalog) == [("register_base_model", "base", ""), ("register_base_model", "alpha", "")]


def test_resolving_the_only_base_model_needs_exactly_one(tmp_path):
    with open_catalog(f"sqlite:///{tmp_path}/r.db") as catalog:
        with Session(catalog.engine) as s, s.begin():
            s.execute(text("DELETE FROM base_models"))
        with pytest.raises(InvalidArgument, match="no base model is registered"):
            catalog.resolve_base_model("")
        catalog.register_base_model("only", CONFIG)
        assert catalog.resolve_base_model("").name == "only"


def names_of(catalog: Catalog, **kwargs) -> list[str]:
    return [a.ref for a in catalog.list(**kwargs)[0]]


def test_list_pages_filters_and_latest_only(catalog):
    catalog.register_base_model("other", CONFIG)
    for name, count in (("a", 3), ("b", 1), ("c", 2), ("d_x", 1), ("dax", 1)):
        for i in range(count):
            catalog.add_version(name, "other" if name == "d_x" else "base", version(f"{name}{i}".replace("_", "")))
    everything, token = catalog.list()
    assert token == ""
    assert [a.ref for a in everything] == ["a@1", "a@2", "a@3", "b@1", "c@1", "c@2", "d_x@1", "dax@1"]
    for size in (1, 2, 3, 4, 8):
        pages, token = [], ""
        for _ in range(len(everything)):
            page, token = catalog.list(page_size=size, page_token=token)
            assert 0 < len(page) <= size  # a next-page token always leads to more
            pages += page
            if not token:
                break
        assert pages == everything, size
    assert names_of(catalog, base_model="other") == ["d_x@1"]
    assert "d_x@1" not in names_of(catalog, base_model="base")
    assert names_of(catalog, name_prefix="d_") == ["d_x@1"]  # '_' is a character, not a LIKE wildcard
    assert names_of(catalog, name_prefix="a") == ["a@1", "a@2", "a@3"]
    assert names_of(catalog, latest_only=True) == ["a@3", "b@1", "c@2", "d_x@1", "dax@1"]
    assert names_of(catalog, latest_only=True, page_size=2, page_token=catalog.list(page_size=3)[1]) == ["b@1", "c@2"]
    assert len(catalog.list(page_size=MAX_PAGE_SIZE)[0]) == len(everything)
    with pytest.raises(InvalidArgument, match="page_size 1001 is over the maximum of 1000"):
        catalog.list(page_size=MAX_PAGE_SIZE + 1)


def test_list_default_page_size(catalog):
    for i in range(101):
        catalog.add_version("many", "base", version(f"{i:x}"))
    page, token = catalog.list()
    assert len(page) == 100 and page[-1].version == 100
    assert [a.version for a in catalog.list(page_token=token)[0]] == [101]


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode()


BAD_TOKENS = {
    "not base64": "not a token!",
    "a string": b64(b'"a"'),
    "one item": b64(b'["a"]'),
    "three items": b64(b'["a", 1, 2]'),
    "a number as name": b64(b"[1, 1]"),
    "a string as version": b64(b'["a", "1"]'),
    "a negative version": b64(b'["a", -1]'),
    "version 0": b64(b'["a", 0]'),  # versions start at 1: the registry never issues it
    "a version past the maximum": b64(json.dumps(["a", MAX_VERSION + 1]).encode()),
    "an object": b64(b'{"a": 1}'),
    "a nested list": b64(b'[["a"], 1]'),
    "deep nesting": b64(b"[" * 700),
    "a brace": b64(b'["{", 1]'),  # only a flat list without any object is parsed at all
}


def test_page_tokens_are_checked(catalog):
    for name in ("a", "b", "c"):
        catalog.add_version(name, "base", version(name))
    _, token = catalog.list(page_size=1)
    assert names_of(catalog, page_token=token) == ["b@1", "c@1"]
    for what, bad in BAD_TOKENS.items():
        with pytest.raises(InvalidArgument, match="page_token") as info:
            catalog.list(page_token=bad)
        assert info.value.code == Code.INVALID_ARGUMENT, what
    # up to MAX_TOKEN_CHARS a token is decoded (base64 skips the padding dots); one character more is refused
    longest = token + "." * (MAX_TOKEN_CHARS - len(token))
    assert names_of(catalog, page_token=longest) == ["b@1", "c@1"]
    with pytest.raises(InvalidArgument) as info:
        catalog.list(page_token=longest + ".")
    assert f"{longest[:64]!r}... ({MAX_TOKEN_CHARS + 1} characters)" in str(info.value)  # only its start is echoed


def test_tenants_see_and_change_only_what_they_may(catalog):
    secret = catalog.add_version("secret", "base", version("s"), caller=TEAM_A)
    catalog.add_version("shared", "base", version("p1", public=True), caller=TEAM_A)
    catalog.add_version("shared", "base", version("p2"), caller=TEAM_A)  # the newer version is private
    assert (secret.tenant, secret.public) == ("team-a", False)
    for caller in (TEAM_A, TEAM_A_USER, ADMIN, ENGINE):
        assert names_of(catalog, caller=caller) == ["secret@1", "shared@1", "shared@2"]
        assert catalog.get("shared", caller=caller).version == 2
    assert names_of(catalog, caller=TEAM_B) == ["shared@1"]
    assert names_of(catalog, caller=TEAM_B, latest_only=True) == ["shared@1"]  # its latest is the one it sees
    assert names_of(catalog, caller=TEAM_A, latest_only=True) == ["secret@1", "shared@2"]
    assert catalog.get("shared", caller=TEAM_B).version == 1
    for call in (
        lambda: catalog.get("secret", caller=TEAM_B),
        lambda: catalog.get("shared", 2, caller=TEAM_B),
        lambda: catalog.delete("secret", caller=TEAM_B),
        lambda: catalog.set_pinned("secret", 1, True, caller=TEAM_B),
    ):
        with pytest.raises(NotFound, match=r"secret|shared@2"):
            call()
    for call in (
        lambda: catalog.delete("shared", caller=TEAM_B),
        lambda: catalog.set_pinned("shared", 1, True, caller=TEAM_B),
        lambda: catalog.delete("secret", caller=TEAM_A_USER),
        lambda: catalog.set_pinned("secret", 1, True, caller=TEAM_A_USER),
        lambda: catalog.add_version("shared", "base", version("x"), caller=TEAM_B),
        lambda: catalog.add_version("secret", "base", version("x"), caller=TEAM_A_USER),
    ):
        with pytest.raises(PermissionDenied):
            call()
    # a name only another tenant's private versions hold: taken, without saying whose
    with pytest.raises(AlreadyExists, match="not available") as info:
        catalog.add_version("secret", "base", version("x"), caller=TEAM_B)
    assert "team-a" not in str(info.value)
    assert names_of(catalog) == ["secret@1", "shared@1", "shared@2"] and not catalog.get("shared", 1).pinned
    # the owner and an admin change them
    assert catalog.add_version("secret", "base", version("s2"), caller=TEAM_A).version == 2
    assert catalog.set_pinned("shared", 1, True, caller=TEAM_A).pinned
    assert catalog.add_version("shared", "base", version("p3"), caller=ADMIN).tenant == "team-a"
    assert [a.ref for a in catalog.delete("shared", caller=ADMIN)] == ["shared@1", "shared@2", "shared@3"]


def failing(errors: list[Exception]):
    """A transaction that raises each of `errors` in turn, then returns how many times it ran
    (`txn.calls` counts them too)."""

    def txn(_session):
        txn.calls += 1
        if txn.calls <= len(errors):
            raise errors[txn.calls - 1]
        return txn.calls

    txn.calls = 0
    return txn


def db_error(kind: type, message: str) -> Exception:
    return kind("INSERT ...", {}, Exception(message))


@pytest.mark.parametrize(
    "error",
    [
        db_error(IntegrityError, "duplicate key value violates unique constraint"),
        db_error(OperationalError, "database is locked"),
        db_error(OperationalError, "deadlock detected"),
        db_error(OperationalError, "could not serialize access due to concurrent update"),
    ],
)
def test_races_are_retried_then_reported_unavailable(error, tmp_path):
    with open_catalog(f"sqlite:///{tmp_path}/r.db") as catalog:
        assert catalog._run(failing([error] * 3)) == 4
        txn = failing([error] * 100)
        with pytest.raises(RegistryError, match="database conflict, try again") as info:
            catalog._run(txn)
        assert info.value.code == Code.UNAVAILABLE
        assert txn.calls == 8  # it gave up after 8 attempts


def test_other_database_errors_are_not_retried(tmp_path):
    with open_catalog(f"sqlite:///{tmp_path}/r.db") as catalog:
        txn = failing([db_error(OperationalError, "connection refused")])
        with pytest.raises(OperationalError, match="connection refused"):
            catalog._run(txn)
        assert txn.calls == 1


def test_postgres_event_writes_notify_listeners(pg_catalog):
    import psycopg

    url = pg_catalog.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        pg_catalog.add_version("bot", "base", version("a"))
        notified = list(listener.notifies(timeout=30, stop_after=1))
    assert [n.channel for n in notified] == [NOTIFY_CHANNEL]


def wait_until_blocked(holder, call: Future, locktype: str) -> None:
    """Until `call` waits on a lock of `locktype` in this database (it must not have finished)."""
    waiting = text(
        "SELECT count(*) FROM pg_locks WHERE locktype = :locktype AND NOT granted"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    )
    if locktype == "transactionid":  # these locks carry no database: waiters on this test's holder
        waiting = text("SELECT count(*) FROM pg_locks WHERE locktype = :locktype AND NOT granted"
                       " AND transactionid = pg_current_xact_id_if_assigned()::text::xid")
    for _ in range(3000):  # a hang guard only
        if holder.execute(waiting, {"locktype": locktype}).scalar() or call.done():
            break
        threading.Event().wait(0.01)
    assert not call.done(), call.result()


def test_postgres_event_writes_wait_for_the_event_lock(pg_catalog):
    """Event ids must commit in id order: a writer waits while another holds the event lock."""
    with pg_catalog.engine.connect() as holder, ThreadPoolExecutor(1) as pool:
        holder.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _EVENT_LOCK_KEY})
        holder.commit()
        registering = pool.submit(pg_catalog.add_version, "bot", "base", version("a"))
        wait_until_blocked(holder, registering, "advisory")
        holder.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _EVENT_LOCK_KEY})
        holder.commit()
        assert registering.result(timeout=60).version == 1


def test_postgres_concurrent_pin_and_delete_see_the_committed_row(pg_catalog):
    """A pin or delete racing another one waits for it and acts on what it committed: a pin of a row
    just pinned is no change (no second event), a delete of a row just deleted is NotFound."""
    pg_catalog.add_version("bot", "base", version("a"))
    pg_catalog.add_version("bot", "base", version("b"))
    start = pg_catalog.last_event_id()
    with pg_catalog.engine.connect() as holder, ThreadPoolExecutor(1) as pool:
        holder.execute(text("UPDATE adapters SET pinned = true WHERE name = 'bot' AND version = 1"))
        pinning = pool.submit(pg_catalog.set_pinned, "bot", 1, True)
        wait_until_blocked(holder, pinning, "transactionid")
        holder.commit()
        assert pinning.result(timeout=60).pinned
        holder.execute(text("DELETE FROM adapters WHERE name = 'bot' AND version = 2"))
        deleting = pool.submit(pg_catalog.delete, "bot", 2)
        wait_until_blocked(holder, deleting, "transactionid")
        holder.commit()
        with pytest.raises(NotFound, match="bot@2"):
            deleting.result(timeout=60)
    assert pg_catalog.events_after(start) == []
