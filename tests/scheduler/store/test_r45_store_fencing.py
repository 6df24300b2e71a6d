"""R45 (only the current owner writes) and R37 (only the current owner of a
ticket performs its side effects) in the store: every write of a ticket a
scheduler holds checks its owner and fence in the write's own transaction
(services/scheduler/store/leases.py). Two stores on one database play two
schedulers, on SQLite and on the real PostgreSQL test server.

A write by a scheduler whose lease was taken over fails with `LeaseLost`
and leaves no row: its events are not renumbered in after the new owner's.
The positive control runs the same writes through a store that does not
hold the ticket (no fence to check): they land, so it is the fence that
stops the old owner, not the database refusing the rows.
"""

from __future__ import annotations

import pytest

from services.scheduler.store.base import (
    QUEUED,
    RUNNING,
    EventRecord,
    LeaseLost,
    NodeRunRecord,
    PullRequestRecord,
    TicketRecord,
)
from services.scheduler.store.run_records import RunRecord
from services.scheduler.store.store import Store

pytestmark = pytest.mark.timeout(120)

TID = "t-fenced"
SHA = "d" * 40


@pytest.fixture
def two(store_url, tmp_path):
    """(a, b): two schedulers' stores on one database; the ticket exists, queued."""
    def open_one(owner: str) -> Store:
        if store_url.startswith("sqlite:"):
            return Store.sqlite(tmp_path / "afe.db", owner=owner)
        return Store.postgresql(store_url, "the test database", owner=owner)

    a, b = open_one("sched-a"), open_one("sched-b")
    t = TicketRecord(id=TID, workspace="ws", workflow="wf", title="t", body="", inputs={}, state=QUEUED,
                     created_at_ms=1, updated_at_ms=1)
    a.tickets.create(t, [NodeRunRecord(TID, "build", "run")], [EventRecord(TID, 1, "ticket.created", "{}", 1)])
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _take_over(a: Store, b: Store) -> int:
    """a claims the ticket with a lease that ends at once; b takes it over (a new fence)."""
    assert a.leases.claim(TID, (QUEUED,), lease_ms=0) == 1
    a.tickets.update(TID, state=RUNNING, updated_at_ms=2)
    fence = b.leases.claim(TID, (RUNNING,), lease_ms=60_000)
    assert fence == 2
    return fence


def _writes(store: Store, seq: int) -> dict[str, object]:
    """One of every kind of write of a held ticket's rows, each as a thunk."""
    return {
        "ticket": lambda: store.tickets.update(TID, error="stale", updated_at_ms=9),
        "node": lambda: store.tickets.update_node(TID, "build", state="failed", output="stale"),
        "events": lambda: store.events.append([EventRecord(TID, seq, "node.output", '{"text":"stale"}', 9),
                                               EventRecord(TID, seq + 1, "node.output", '{"text":"stale2"}', 9)]),
        "pr": lambda: store.prs.put_pr(PullRequestRecord(TID, "9", "u", "afe/x", "main", SHA)),
        "diff": lambda: store.diffs.put_final_diff(TID, "stale diff", False, 9),
        "report": lambda: store.reports.put_report(TID, "final", "c-9", "stale", 9),
        "placement": lambda: store.placements.place_sandbox(TID, "broker-stale", 9),
        "run_record": lambda: store.run_records.put_run_record(RunRecord(TID, SHA, "request", "{}", 9)),
        "verification": lambda: store.verifications.put_verification(TID, SHA, True, {}, 9),
    }


def _nothing_stale(reader: Store) -> None:
    t = reader.tickets.get(TID)
    assert t is not None and t.error == ""
    assert reader.tickets.node_runs(TID)[0].output == ""
    assert reader.prs.get_pr(TID) is None
    assert reader.diffs.final_diff(TID) is None
    assert reader.reports.report(TID, "final") is None
    assert reader.placements.sandbox_placement(TID) is None
    assert reader.run_records.run_record(TID, SHA, "request") is None
    assert reader.verifications.verification(TID, SHA) is None


def test_r45_writes_of_a_taken_over_owner_fail_and_leave_no_row(two):
    a, b = two
    _take_over(a, b)
    b.events.append([EventRecord(TID, 2, "ticket.takeover", '{"from":"sched-a"}', 3)])
    for name, write in _writes(a, 2).items():
        with pytest.raises(LeaseLost):
            write()  # type: ignore[operator]
        assert TID in a.leases.lost, name
    _nothing_stale(b)
    # the new owner's events stand as written; the old owner's were not renumbered in after them
    assert [(e.seq, e.type) for e in b.events.read(TID, 1)] == [(1, "ticket.created"), (2, "ticket.takeover")]
    assert b.events.last_seq(TID) == 2
    # and the new owner writes on
    b.tickets.update_node(TID, "build", state="running")
    b.events.append([EventRecord(TID, 3, "node.started", "{}", 4)])


def test_r45_positive_control_the_same_writes_unfenced_land(two, store_url, tmp_path):
    """Without the fence (a store that never claimed the ticket, as the old PostgreSQL store was
    for a ticket whose fence it had dropped), every one of those writes lands."""
    a, b = two
    _take_over(a, b)
    b.events.append([EventRecord(TID, 2, "ticket.takeover", "{}", 3)])
    if store_url.startswith("sqlite:"):
        unfenced = Store.sqlite(tmp_path / "afe.db", owner="sched-a")
    else:
        unfenced = Store.postgresql(store_url, "the test database", owner="sched-a")
    try:
        for write in _writes(unfenced, 3).values():
            write()  # type: ignore[operator]
        t = b.tickets.get(TID)
        assert t is not None and t.error == "stale"
        assert b.tickets.node_runs(TID)[0].output == "stale"
        assert b.prs.get_pr(TID) is not None and b.diffs.final_diff(TID) == ("stale diff", False)
        assert [e.type for e in b.events.read(TID, 1)] == ["ticket.created", "ticket.takeover", "node.output",
                                                           "node.output"]
    finally:
        unfenced.close()


def test_r45_a_lost_lease_stays_marked_lost_until_released_or_forgotten(two):
    a, b = two
    _take_over(a, b)
    with pytest.raises(LeaseLost):
        a.tickets.update(TID, error="stale")
    assert TID not in a.leases.fences and TID in a.leases.lost
    assert a.leases.renew([TID], 60_000) == []             # a lost lease is never renewed
    # b gives the ticket up: the row would take a's write again, but a's entry still refuses it
    b.leases.release(TID)
    with pytest.raises(LeaseLost):
        a.tickets.update_node(TID, "build", output="stale")
    a.leases.forget(TID)
    assert TID not in a.leases.lost
    # a's own lease loss, said by its clock (self-fencing), is kept the same way
    assert a.leases.claim(TID, (RUNNING,), 60_000) == 3
    a.leases.lose(TID)
    with pytest.raises(LeaseLost):
        a.events.append([EventRecord(TID, 2, "node.output", "{}", 5)])
    assert a.events.last_seq(TID) == 1


def test_r45_requests_of_a_non_owner_stay_unfenced(two):
    """A cancel asked through another scheduler sets only cancel_by; the owner sees it on renewal."""
    a, b = two
    assert a.leases.claim(TID, (QUEUED,), 60_000) == 1
    b.leases.request_cancel(TID, "ana")
    [lease] = a.leases.renew([TID], 60_000)
    assert (lease.fence, lease.cancel_by) == (1, "ana")
    a.tickets.update(TID, state=RUNNING)                   # the owner's fence is untouched by the request


def test_r37_a_claim_cannot_slip_between_the_check_and_the_write(pg_url):
    """PostgreSQL: the fence check holds the ticket row (FOR SHARE) until the write commits; a claim
    meanwhile skips the row (FOR UPDATE SKIP LOCKED) and gets nothing. Positive control: with no write
    in flight the same claim takes the expired lease."""
    a = Store.postgresql(pg_url, "the test database", owner="sched-a")
    b = Store.postgresql(pg_url, "the test database", owner="sched-b")
    try:
        t = TicketRecord(id=TID, workspace="ws", workflow="wf", title="t", body="", inputs={}, state=QUEUED,
                         created_at_ms=1, updated_at_ms=1)
        a.tickets.create(t, [], [EventRecord(TID, 1, "ticket.created", "{}", 1)])
        assert a.leases.claim(TID, (QUEUED,), lease_ms=0) == 1          # expired at once
        with a.db.transaction(write=True) as conn:
            a.leases.guard(conn, TID)
            assert b.leases.claim(TID, (QUEUED,), 60_000) is None        # the write's check holds the row
            a.events.append([EventRecord(TID, 2, "node.output", "{}", 2)])   # joins this transaction
        assert b.leases.claim(TID, (QUEUED,), 60_000) == 2                 # control: now it is taken
        with pytest.raises(LeaseLost):
            a.events.append([EventRecord(TID, 3, "node.output", "{}", 3)])
        assert a.events.last_seq(TID) == 2
    finally:
        a.close()
        b.close()


def test_r45_the_lost_attempts_count_reaches_the_new_owner_once(two):
    """The old owner may no longer write the ticket, but it reports how many events its attempt
    could not store (unfenced, its own row); only the current owner takes the report (fenced)."""
    a, b = two
    _take_over(a, b)
    a.events.report_lost(TID, 1, 17)
    a.events.report_lost(TID, 1, 23)                      # the attempt's later, larger count replaces it
    with pytest.raises(LeaseLost):
        a.events.take_lost_reports(TID)                   # the old owner cannot take (or delete) them
    assert b.events.take_lost_reports(TID) == [(1, 23)]
    assert b.events.take_lost_reports(TID) == []          # taken once
