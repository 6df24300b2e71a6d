"""The stores behind `Store`: SQLite (WAL mode) and PostgreSQL, the same
behaviour on both; versioned migrations and refusal of a newer schema with
the afe release it needs."""

from __future__ import annotations

import sqlite3

import pytest

from services.common.errors import FailedPrecondition
from services.scheduler.store import postgres as pg_store
from services.scheduler.store.base import (
    ApprovalRecord,
    EventRecord,
    NodeRunRecord,
    PullRequestRecord,
    TicketRecord,
)
from services.scheduler.store.sqlite import SCHEMA_VERSION, SqliteStore
from tests.support.postgres import open_store_url


def _ticket(i: int) -> TicketRecord:
    return TicketRecord(id=f"t-{i}", workspace="ws", workflow="wf", title=f"title {i}", body="", inputs={},
                        state="queued", created_at_ms=i, updated_at_ms=i)


@pytest.fixture
def store(store_url, tmp_path):
    s = open_store_url(store_url, tmp_path)
    try:
        yield s
    finally:
        s.close()


def test_wal_and_schema_version(tmp_path):
    store = SqliteStore(tmp_path / "afe.db")
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert store.db.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] == SCHEMA_VERSION
    store.close()
    SqliteStore(tmp_path / "afe.db").close()  # reopening migrates nothing and keeps the data
    assert (tmp_path / "afe.db").stat().st_mode & 0o077 == 0


def test_sqlite_version_1_file_is_migrated_and_keeps_its_rows(tmp_path):
    from services.scheduler.store.sqlite import MIGRATIONS

    db = sqlite3.connect(str(tmp_path / "afe.db"))
    db.executescript(MIGRATIONS[0] + ";PRAGMA user_version=1;")
    db.execute("INSERT INTO tickets (id, workspace, workflow, title, body, inputs_json, state, created_at_ms, "
               "updated_at_ms) VALUES ('t-old','ws','wf','old','','{}','queued',1,1)")
    db.commit()
    db.close()
    store = SqliteStore(tmp_path / "afe.db")
    assert store.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert store.get_ticket("t-old").title == "old"


def test_newer_schema_is_refused_with_a_clear_message(tmp_path):
    SqliteStore(tmp_path / "afe.db").close()
    db = sqlite3.connect(str(tmp_path / "afe.db"))
    db.execute("INSERT INTO schema_version VALUES (?, '9.8.7', 0)", (SCHEMA_VERSION + 1,))
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.commit()
    db.close()
    with pytest.raises(FailedPrecondition, match="newer than this afe") as exc:
        SqliteStore(tmp_path / "afe.db")
    assert "afe 9.8.7 or later" in str(exc.value)


def test_postgresql_schema_version_and_reopen(pg_url):
    store = open_store_url(pg_url)
    assert isinstance(store, pg_store.PostgresStore)
    rows = store.db.execute("SELECT version, afe_version FROM schema_version ORDER BY version").fetchall()
    assert [r[0] for r in rows] == list(range(1, pg_store.SCHEMA_VERSION + 1)) and all(r[1] for r in rows)
    # Reserved for scheduler leases (not used yet): every ticket starts unowned.
    cols = {r[0] for r in store.db.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name='tickets'")}
    assert {"owner", "lease_until_ms"} <= cols
    store.create_ticket(_ticket(1), [], [])
    store.close()
    again = open_store_url(pg_url)   # reopening migrates nothing and keeps the data
    assert again.get_ticket("t-1").title == "title 1"
    assert again.db.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == pg_store.SCHEMA_VERSION
    again.close()


def test_postgresql_newer_schema_is_refused_with_the_release_it_needs(pg_url):
    open_store_url(pg_url).close()
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as db:
        db.execute("INSERT INTO schema_version VALUES (%s, '9.8.7', 0)", (pg_store.SCHEMA_VERSION + 1,))
    with pytest.raises(FailedPrecondition, match="newer than this afe") as exc:
        open_store_url(pg_url)
    assert "afe 9.8.7 or later" in str(exc.value) and "afe_app" not in str(exc.value)


def test_postgresql_two_schedulers_starting_together_migrate_once(pg_url):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        stores = list(pool.map(lambda _: open_store_url(pg_url), range(4)))
    n = stores[0].db.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0]
    for s in stores:
        s.close()
    assert n == pg_store.SCHEMA_VERSION


def test_tickets_nodes_prs_round_trip_and_paging(store):
    for i in range(5):
        store.create_ticket(_ticket(i), [NodeRunRecord(f"t-{i}", "a", "run"),
                                         NodeRunRecord(f"t-{i}", "b", "run", needs=("a",))], [])
    store.update_ticket("t-2", state="running")
    assert [t.id for t in store.list_tickets(["running"])] == ["t-2"]
    page1 = store.list_tickets(limit=2)
    page2 = store.list_tickets(limit=2, before_rowid=page1[-1].rowid)
    assert [t.id for t in page1 + page2] == ["t-4", "t-3", "t-2", "t-1"]
    assert [t.id for t in store.list_tickets(workspace="ws", limit=10)][-1] == "t-0"
    assert store.list_tickets(workspace="other") == []
    assert [t.id for t in store.tickets_in_states(("queued",))] == ["t-0", "t-1", "t-3", "t-4"]
    assert [n.needs for n in store.node_runs("t-0")] == [(), ("a",)]
    store.update_node("t-0", "a", state="succeeded", attempt=1, output="ok")
    first = store.node_runs("t-0")[0]
    assert (first.state, first.attempt, first.output) == ("succeeded", 1, "ok")
    store.put_pr(PullRequestRecord("t-0", "7", head_sha="a" * 40))
    store.put_pr(PullRequestRecord("t-0", "7", head_sha="a" * 40, state="merged", merge_sha="b" * 40))
    pr = store.get_pr("t-0")
    assert pr is not None and pr.state == "merged" and pr.merge_sha == "b" * 40
    assert store.get_pr("t-1") is None and store.get_ticket("nope") is None
    with pytest.raises(ValueError):
        store.update_ticket("t-0", title="not updatable")
    with pytest.raises(ValueError):
        store.update_node("t-0", "a", kind="not updatable")


def test_terminal_teardown_approvals_and_ticket_fields(store):
    t = _ticket(1)
    t.inputs = {"issue": "42", "ünïcode": "✓"}
    t.principal = "alice"
    store.create_ticket(t, [], [EventRecord("t-1", 1, "ticket.created", "{}", 5)])
    store.create_ticket(_ticket(2), [], [])
    store.update_ticket("t-1", state="succeeded", tokens_used=12345678901, awaiting_sha="c" * 40, error="e")
    assert [x.id for x in store.terminal_not_torn_down()] == ["t-1"]
    store.update_ticket("t-1", torn_down=True)
    assert store.terminal_not_torn_down() == []
    got = store.get_ticket("t-1")
    assert (got.inputs, got.principal, got.tokens_used, got.awaiting_sha, got.error, got.torn_down) == (
        {"issue": "42", "ünïcode": "✓"}, "alice", 12345678901, "c" * 40, "e", True)
    assert store.latest_approval("t-1") is None
    store.add_approval(ApprovalRecord("t-1", "bob", "c" * 40, False, 6, "not yet"))
    store.add_approval(ApprovalRecord("t-1", "bob", "c" * 40, True, 7))
    assert store.latest_approval("t-1") == ApprovalRecord("t-1", "bob", "c" * 40, True, 7, "")
    assert store.events("t-1", 1) == [EventRecord("t-1", 1, "ticket.created", "{}", 5)]
    assert store.last_seq("t-1") == 1 and store.last_seq("t-2") == 0
    assert store.ping()
