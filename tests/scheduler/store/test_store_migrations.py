"""The store's schema under Alembic (services/scheduler/store/migrate.py), on
SQLite and on the real PostgreSQL test server:

- an empty database gets every revision; its tables are exactly store/schema.py's;
- a database made by the hand-written migrations this afe replaced (their
  SQL kept in tests/scheduler/legacy_schema/, applied the way the old store
  applied them) at version 10, with a row in every table, is adopted: opened
  by the new store, every row reads back through the repositories, events go
  on from the stored seq, and its tables are then schema.py's too;
- an afe before Alembic refuses the adopted database (schema_version 11), a
  database at an older hand-written version or at an unknown revision is
  refused with what to do, and schedulers opening one database together
  migrate it once.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from services.common.errors import FailedPrecondition
from services.scheduler.store import migrate, schema
from services.scheduler.store.base import EventRecord
from services.scheduler.store.github_records import PollCursor
from services.scheduler.store.store import Store

pytestmark = pytest.mark.timeout(120)

LEGACY = Path(__file__).parents[1] / "legacy_schema"
SHA = "c" * 40


def _legacy_scripts(backend: str) -> list[str]:
    """The old store's migration files of `backend`, comment lines removed (as its loader did)."""
    out = []
    for f in sorted((LEGACY / backend).glob("*.sql")):
        out.append("\n".join(line for line in f.read_text().splitlines() if not line.lstrip().startswith("--")))
    assert len(out) == 10
    return out


def legacy_sqlite(path: Path, upto: int = 10) -> None:
    """A SQLite store as the old SqliteStore left it at version `upto`."""
    db = sqlite3.connect(str(path), isolation_level=None)
    for i, script in enumerate(_legacy_scripts("sqlite")[:upto]):
        db.execute("BEGIN IMMEDIATE")
        for stmt in script.split(";"):
            if stmt.strip():
                db.execute(stmt)
        if i + 1 >= 2:
            db.execute("INSERT OR REPLACE INTO schema_version VALUES (?, '0.1.0', 0)", (i + 1,))
        db.execute(f"PRAGMA user_version={i + 1}")
        db.execute("COMMIT")
    db.close()


def legacy_pg(url: str, upto: int = 10) -> None:
    """A PostgreSQL store as the old PostgresStore left it at version `upto`."""
    with psycopg.connect(url, autocommit=True) as db:
        for i, script in enumerate(_legacy_scripts("postgresql")[:upto]):
            with db.transaction():
                db.execute(script)  # type: ignore[call-overload]
                db.execute("INSERT INTO schema_version VALUES (%s, '0.1.0', 0)", (i + 1,))


# One row in every table, in the old schema's columns (both databases take the same text).
ROWS = [
    "INSERT INTO tickets (id, workspace, workflow, title, body, inputs_json, state, created_at_ms, updated_at_ms, "
    "principal, error, tokens_used, awaiting_sha, origin_json, reopened_at_ms) VALUES ('t-old', 'ws', 'wf', "
    "'an old ticket', 'its body', '{\"k\": \"v\"}', 'waiting_approval', 1000, 2000, 'ana', '', 42, '" + SHA + "', "
    "'{\"source\": \"github\"}', 1500)",
    ("INSERT INTO node_runs (ticket_id, node_id, ord, kind, state, needs_json, attempt, started_at_ms, "
    "finished_at_ms, output, error, rounds, feedback) VALUES ('t-old', 'build', 0, 'run', 'succeeded', '[]', 1, "
    "1100, 1200, 'built', '', 2, 'try harder')"),
    "INSERT INTO events (ticket_id, seq, type, payload_json, at_ms) VALUES ('t-old', 1, 'ticket.created', '{}', 1000)",
    ("INSERT INTO events (ticket_id, seq, type, payload_json, at_ms) VALUES ('t-old', 2, 'node.output', "
    "'{\"text\": \"line\"}', 1100)"),
    "INSERT INTO events (ticket_id, seq, type, payload_json, at_ms) VALUES ('t-old', 3, 'node.finished', '{}', 1200)",
    "INSERT INTO approvals (ticket_id, principal, sha, granted, at_ms, reason, accepted_harness) VALUES "
    "('t-old', 'bo', '" + SHA + "', {true}, 1300, 'fine', '[\"conftest.py\"]')",
    "INSERT INTO pull_requests VALUES ('t-old', '7', 'https://forge/pr/7', 'afe/t-old', 'main', '" + SHA + "', "
    "'open', '')",
    "INSERT INTO github_once VALUES ('delivery-1', 1000)",
    ("INSERT INTO github_poll_cursors (workspace, etag, last_event_id, updated_at_ms, next_poll_ms) VALUES "
    "('ws', 'W/\"e\"', '99', 1000, 5000)"),
    "INSERT INTO ticket_diffs VALUES ('t-old', 'diff --git a b', {false}, 1400)",
    ("INSERT INTO ticket_followups (ticket_id, at_ms, author, source, text, path, line, url, state) VALUES "
    "('t-old', 1450, 'cy', 'operator', 'add a test', 'a.py', 3, '', 'pending')"),
    "INSERT INTO github_reports VALUES ('t-old', 'final', 'c-1', 'digest', 1500)",
    "INSERT INTO sandbox_placements VALUES ('t-old', 'broker-a', 1000)",
    "INSERT INTO github_work VALUES ('o/r', 5, 'fix', 'tok', 't-old', 1000)",
    "INSERT INTO run_records VALUES ('t-old', '" + SHA + "', 'request', '{\"payload\": \"x\"}', 1300)",
    "INSERT INTO ci_failures VALUES ('t-old', '" + SHA + "', '{\"claim\": \"k\", \"state\": \"round\"}', 1350)",
    "INSERT INTO verification_runs VALUES ('t-old', '" + SHA + "', 'base1', '', 'head', 1, '{\"passed\": true}', 1320)",
]


def _fill(execute: Callable[[str], object], true: str, false: str) -> None:
    for stmt in ROWS:
        execute(stmt.replace("{true}", true).replace("{false}", false))


def _schema_diffs(store: Store) -> list:
    """What differs between the database's tables and schema.py's. SQLite's old `TEXT PRIMARY KEY`
    columns were declared without NOT NULL (SQLite then allows a NULL key, a quirk of its own): kept
    as they were, not a difference of the schema."""
    with store.db.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        diffs = compare_metadata(ctx, schema.metadata)
    if store.db.dialect == "sqlite":
        pks = {(t.name, c.name) for t in schema.metadata.tables.values() for c in t.primary_key.columns}
        diffs = [d for d in diffs if not (isinstance(d, list) and d[0][0] == "modify_nullable"
                                          and (d[0][2], d[0][3]) in pks)]
    return diffs


def _reads_back(store: Store) -> None:
    """Every row of ROWS, through the repositories."""
    t = store.tickets.get("t-old")
    assert t is not None and (t.title, t.inputs, t.state, t.tokens_used, t.awaiting_sha, t.origin,
                              t.reopened_at_ms) == ("an old ticket", {"k": "v"}, "waiting_approval", 42, SHA,
                                                    {"source": "github"}, 1500)
    [n] = store.tickets.node_runs("t-old")
    assert (n.node_id, n.state, n.attempt, n.output, n.rounds, n.feedback) == ("build", "succeeded", 1, "built", 2,
                                                                              "try harder")
    assert [e.seq for e in store.events.read("t-old", 1)] == [1, 2, 3]
    assert store.events.last_seq("t-old") == 3
    a = store.approvals.latest_approval("t-old")
    assert a is not None and (a.principal, a.granted, a.accepted_harness_change) == ("bo", True, ["conftest.py"])
    pr = store.prs.get_pr("t-old")
    assert pr is not None and (pr.number, pr.head_sha) == ("7", SHA)
    assert store.diffs.final_diff("t-old") == ("diff --git a b", False)
    assert store.intake.poll_cursor("ws") == PollCursor('W/"e"', "99", 5000)
    assert not store.intake.claim_once("delivery-1", 2000)          # seen before the upgrade: still seen
    assert [f.text for f in store.followups.pending_followups("t-old")] == ["add a test"]
    assert store.reports.report("t-old", "final") == ("c-1", "digest")
    assert store.placements.sandbox_placement("t-old") == "broker-a"
    rec = store.run_records.run_record("t-old", SHA, "request")
    assert rec is not None and rec.envelope == '{"payload": "x"}'
    ci = store.ci.ci_failure("t-old", SHA)
    assert ci is not None and ci.state == "round"
    v = store.verifications.verification("t-old", SHA)
    assert v is not None and v.passed and v.base_sha == "base1"
    # the ticket's events go on from the stored seq, and only from there
    store.events.append([EventRecord("t-old", 4, "node.output", "{}", 2100)])
    with pytest.raises(FailedPrecondition, match="do not follow its stored events"):
        store.events.append([EventRecord("t-old", 4, "node.output", "{}", 2100)])
    assert store.events.last_seq("t-old") == 4


def test_empty_sqlite_gets_schema_py(tmp_path):
    store = Store.sqlite(tmp_path / "afe.db")
    try:
        assert _schema_diffs(store) == []
        with store.db.engine.connect() as conn:
            assert migrate.state(conn) == ("alembic", migrate.head())
            assert conn.exec_driver_sql("PRAGMA user_version").scalar() == 11
    finally:
        store.close()
    Store.sqlite(tmp_path / "afe.db").close()        # opened again: nothing to migrate


def test_sqlite_of_the_hand_written_migrations_is_adopted_with_every_row(tmp_path):
    path = tmp_path / "afe.db"
    legacy_sqlite(path)
    db = sqlite3.connect(str(path), isolation_level=None)
    _fill(db.execute, "1", "0")
    db.close()
    store = Store.sqlite(path)
    try:
        _reads_back(store)
        assert _schema_diffs(store) == []
        with store.db.engine.connect() as conn:
            assert migrate.state(conn) == ("alembic", migrate.head())
    finally:
        store.close()
    # An afe before Alembic (it reads PRAGMA user_version and schema_version) now finds a newer schema.
    db = sqlite3.connect(str(path))
    assert db.execute("PRAGMA user_version").fetchone()[0] == 11
    assert db.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] == 11
    db.close()


def test_pg_of_the_hand_written_migrations_is_adopted_with_every_row(pg_url):
    legacy_pg(pg_url)
    with psycopg.connect(pg_url, autocommit=True) as db:
        _fill(db.execute, "TRUE", "FALSE")  # type: ignore[arg-type]
        # the old PostgresStore kept event counters; the adoption must keep them
        db.execute("INSERT INTO event_counters VALUES ('t-old', 3)")
    store = Store.postgresql(pg_url, "the test database")
    try:
        _reads_back(store)
        assert _schema_diffs(store) == []
    finally:
        store.close()
    with psycopg.connect(pg_url) as db:
        assert db.execute("SELECT MAX(version) FROM schema_version").fetchone() == (11,)


def test_empty_pg_gets_schema_py_and_schedulers_starting_together_migrate_once(pg_url):
    stores: list[Store] = []
    errors: list[BaseException] = []

    def open_one() -> None:
        try:
            stores.append(Store.postgresql(pg_url, "the test database"))
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == [] and len(stores) == 4
        assert _schema_diffs(stores[0]) == []
        with stores[0].db.engine.connect() as conn:
            assert conn.execute(sa.text("SELECT COUNT(*) FROM schema_version")).scalar() == 1
            assert migrate.state(conn) == ("alembic", migrate.head())
    finally:
        for s in stores:
            s.close()


def test_an_older_hand_written_version_is_refused_with_what_to_do(tmp_path):
    path = tmp_path / "afe.db"
    legacy_sqlite(path, upto=9)
    with pytest.raises(FailedPrecondition, match=r"schema version 9 .* adopts only version 10"):
        Store.sqlite(path)
    db = sqlite3.connect(str(path))      # nothing was changed
    assert db.execute("PRAGMA user_version").fetchone()[0] == 9
    assert "alembic_version" not in {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
    db.close()


def test_a_revision_this_afe_does_not_know_is_refused_naming_the_release(tmp_path):
    path = tmp_path / "afe.db"
    Store.sqlite(path).close()
    db = sqlite3.connect(str(path), isolation_level=None)
    db.execute("UPDATE alembic_version SET version_num='9999'")
    db.execute("INSERT INTO schema_version VALUES (12, '9.8.7', 0)")
    db.close()
    with pytest.raises(FailedPrecondition, match=r"schema 9999, newer than this afe .* afe 9\.8\.7 or later"):
        Store.sqlite(path)


def test_check_reads_where_a_database_stands_changing_nothing(tmp_path):
    from services.scheduler.store.database import Database

    path = tmp_path / "afe.db"
    legacy_sqlite(path)
    db = Database.sqlite(path)
    try:
        assert "version 10 of the hand-written migrations; `afe up` adopts it" in migrate.check(db)
    finally:
        db.close()
    store = Store.sqlite(path)
    try:
        assert migrate.check(store.db).endswith(f"schema {migrate.head()} (current)")
    finally:
        store.close()
