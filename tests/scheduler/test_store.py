"""The SQLite store: WAL mode, versioned migrations, refusal of a newer schema."""

from __future__ import annotations

import sqlite3

import pytest

from services.common.errors import FailedPrecondition
from services.scheduler.sqlite_store import SCHEMA_VERSION, SqliteStore
from services.scheduler.store import NodeRunRecord, PullRequestRecord, TicketRecord


def _ticket(i: int) -> TicketRecord:
    return TicketRecord(id=f"t-{i}", workspace="ws", workflow="wf", title=f"title {i}", body="", inputs={},
                        state="queued", created_at_ms=i, updated_at_ms=i)


def test_wal_and_schema_version(tmp_path):
    store = SqliteStore(tmp_path / "afe.db")
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    store.close()
    SqliteStore(tmp_path / "afe.db").close()  # reopening migrates nothing and keeps the data
    assert (tmp_path / "afe.db").stat().st_mode & 0o077 == 0


def test_newer_schema_is_refused_with_a_clear_message(tmp_path):
    db = sqlite3.connect(str(tmp_path / "afe.db"))
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(FailedPrecondition, match="newer than this afe"):
        SqliteStore(tmp_path / "afe.db")


def test_tickets_nodes_prs_round_trip_and_paging(tmp_path):
    store = SqliteStore(tmp_path / "afe.db")
    for i in range(5):
        store.create_ticket(_ticket(i), [NodeRunRecord(f"t-{i}", "a", "run"),
                                         NodeRunRecord(f"t-{i}", "b", "run", needs=("a",))], [])
    store.update_ticket("t-2", state="running")
    assert [t.id for t in store.list_tickets(["running"])] == ["t-2"]
    page1 = store.list_tickets(limit=2)
    page2 = store.list_tickets(limit=2, before_rowid=page1[-1].rowid)
    assert [t.id for t in page1 + page2] == ["t-4", "t-3", "t-2", "t-1"]
    assert [t.id for t in store.tickets_in_states(("queued",))] == ["t-0", "t-1", "t-3", "t-4"]
    assert [n.needs for n in store.node_runs("t-0")] == [(), ("a",)]
    store.put_pr(PullRequestRecord("t-0", "7", head_sha="a" * 40))
    store.put_pr(PullRequestRecord("t-0", "7", head_sha="a" * 40, state="merged", merge_sha="b" * 40))
    pr = store.get_pr("t-0")
    assert pr is not None and pr.state == "merged" and pr.merge_sha == "b" * 40
    with pytest.raises(ValueError):
        store.update_ticket("t-0", title="not updatable")
