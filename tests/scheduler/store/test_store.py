"""The store's repositories on SQLite (WAL mode) and PostgreSQL: the same
behaviour on both. Its migrations: test_store_migrations.py."""

from __future__ import annotations

import pytest

from services.scheduler.store.base import (
    ApprovalRecord,
    EventRecord,
    NodeRunRecord,
    PullRequestRecord,
    TicketRecord,
)
from services.scheduler.store.store import Store
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


def test_sqlite_is_wal_and_only_its_owner_reads_it(tmp_path):
    store = Store.sqlite(tmp_path / "afe.db")
    try:
        with store.db.transaction() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    finally:
        store.close()
    assert (tmp_path / "afe.db").stat().st_mode & 0o077 == 0


def test_tickets_nodes_prs_round_trip_and_paging(store):
    for i in range(5):
        store.tickets.create(_ticket(i), [NodeRunRecord(f"t-{i}", "a", "run"),
                                         NodeRunRecord(f"t-{i}", "b", "run", needs=("a",))], [])
    store.tickets.update("t-2", state="running")
    assert [t.id for t in store.tickets.list(["running"])] == ["t-2"]
    page1 = store.tickets.list(limit=2)
    page2 = store.tickets.list(limit=2, before_rowid=page1[-1].rowid)
    assert [t.id for t in page1 + page2] == ["t-4", "t-3", "t-2", "t-1"]
    assert [t.id for t in store.tickets.list(workspace="ws", limit=10)][-1] == "t-0"
    assert store.tickets.list(workspace="other") == []
    assert [t.id for t in store.tickets.in_states(("queued",))] == ["t-0", "t-1", "t-3", "t-4"]
    assert [n.needs for n in store.tickets.node_runs("t-0")] == [(), ("a",)]
    store.tickets.update_node("t-0", "a", state="succeeded", attempt=1, output="ok")
    first = store.tickets.node_runs("t-0")[0]
    assert (first.state, first.attempt, first.output) == ("succeeded", 1, "ok")
    store.prs.put_pr(PullRequestRecord("t-0", "7", head_sha="a" * 40))
    store.prs.put_pr(PullRequestRecord("t-0", "7", head_sha="a" * 40, state="merged", merge_sha="b" * 40))
    pr = store.prs.get_pr("t-0")
    assert pr is not None and pr.state == "merged" and pr.merge_sha == "b" * 40
    assert store.prs.get_pr("t-1") is None and store.tickets.get("nope") is None
    with pytest.raises(ValueError):
        store.tickets.update("t-0", title="not updatable")
    with pytest.raises(ValueError):
        store.tickets.update_node("t-0", "a", kind="not updatable")


def test_terminal_teardown_approvals_and_ticket_fields(store):
    t = _ticket(1)
    t.inputs = {"issue": "42", "ünïcode": "✓"}
    t.principal = "alice"
    store.tickets.create(t, [], [EventRecord("t-1", 1, "ticket.created", "{}", 5)])
    store.tickets.create(_ticket(2), [], [])
    store.tickets.update("t-1", state="succeeded", tokens_used=12345678901, awaiting_sha="c" * 40, error="e")
    assert [x.id for x in store.tickets.terminal_not_torn_down()] == ["t-1"]
    store.tickets.update("t-1", torn_down=True)
    assert store.tickets.terminal_not_torn_down() == []
    got = store.tickets.get("t-1")
    assert (got.inputs, got.principal, got.tokens_used, got.awaiting_sha, got.error, got.torn_down) == (
        {"issue": "42", "ünïcode": "✓"}, "alice", 12345678901, "c" * 40, "e", True)
    assert store.approvals.latest_approval("t-1") is None
    store.approvals.add_approval(ApprovalRecord("t-1", "bob", "c" * 40, False, 6, "not yet"))
    store.approvals.add_approval(ApprovalRecord("t-1", "bob", "c" * 40, True, 7))
    assert store.approvals.latest_approval("t-1") == ApprovalRecord("t-1", "bob", "c" * 40, True, 7, "")
    assert store.events.read("t-1", 1) == [EventRecord("t-1", 1, "ticket.created", "{}", 5)]
    assert store.events.last_seq("t-1") == 1 and store.events.last_seq("t-2") == 0
    assert store.ping()
