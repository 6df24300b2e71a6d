"""The store side of one ticket per piece of work from GitHub and of queued
follow-ups (migration 0007, docs/GITHUB.md), on SQLite and PostgreSQL: the
work claim is one row taken atomically and taken over only when it blocks
nothing any more; concurrent claimers on one PostgreSQL database get one
winner per key; follow-ups are given to one re-run only."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from services.scheduler.store import pg_records
from services.scheduler.store.base import (
    CANCELLED,
    FOLLOWUP_PENDING,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    FollowUpRecord,
    TicketRecord,
)
from tests.support.postgres import open_store_url

pytestmark = pytest.mark.timeout(120)

GRACE = 60_000


@pytest.fixture
def store(store_url, tmp_path):
    s = open_store_url(store_url, tmp_path)
    try:
        yield s
    finally:
        s.close()


def _ticket(store, tid: str, state: str = QUEUED) -> None:
    store.create_ticket(TicketRecord(tid, "ws", "fix", "t", "b", {}, state, 1, 1), [], [])


def _now(store) -> int:
    """The store's clock: PostgreSQL's claim uses the database's, so the test takes it from there."""
    db = getattr(store, "db", None)
    if db is not None and hasattr(db, "pgconn"):
        return int(db.execute("SELECT (extract(epoch from clock_timestamp()) * 1000)::bigint").fetchone()[0])
    import time
    return int(time.time() * 1000)


def test_a_work_claim_is_held_while_its_ticket_lives_and_taken_over_after(store):
    key = ("o/r", 7, "fix-issues")
    now = _now(store)
    first = store.claim_work(*key, "A", now, GRACE)
    assert (first.claim, first.ticket_id) == ("A", "")
    # Another claimer while A creates the ticket: A holds it (no ticket id yet).
    assert store.claim_work(*key, "B", now, GRACE).claim == "A"
    _ticket(store, "t-1")
    assert store.set_work_ticket(*key, "A", "t-1")
    assert not store.set_work_ticket(*key, "B", "t-x")            # only the holder records its ticket
    for state in (QUEUED, RUNNING):
        store.update_ticket("t-1", state=state)
        held = store.claim_work(*key, "B", now, GRACE)
        assert (held.claim, held.ticket_id) == ("A", "t-1")        # live: B joins t-1
    # Other keys are other work.
    assert store.claim_work("o/r", 8, "fix-issues", "C", now, GRACE).claim == "C"
    assert store.claim_work("o/r", 7, "other-trigger", "D", now, GRACE).claim == "D"
    assert store.claim_work("o/other", 7, "fix-issues", "E", now, GRACE).claim == "E"
    # The ticket ended: the next claimer takes the work over.
    for ended in (SUCCEEDED, CANCELLED):
        store.update_ticket("t-1", state=ended)
        held = store.claim_work(*key, f"F-{ended}", now, GRACE)
        assert (held.claim, held.ticket_id) == (f"F-{ended}", "")
        assert store.set_work_ticket(*key, f"F-{ended}", "t-1")


def test_a_claim_left_by_a_crash_blocks_nothing_for_long(store):
    key = ("o/r", 9, "fix-issues")
    now = _now(store)
    # A claim whose ticket does not exist (never created, or gone): held for the grace period (the
    # ticket may be one a claimer's snapshot does not show yet, below), then taken over.
    store.claim_work(*key, "A", now, GRACE)
    store.set_work_ticket(*key, "A", "t-never-stored")
    assert store.claim_work(*key, "B", now, GRACE).claim == "A"
    store.release_work(*key, "A")
    store.claim_work(*key, "A", now, GRACE)
    store.set_work_ticket(*key, "A", "t-never-stored")
    assert store.claim_work(*key, "B", now + 2 * GRACE, 0).claim == "B"
    # A claim without a ticket (its creator died between claim and create): held for the grace
    # period, then taken over.
    assert store.claim_work(*key, "C", now, GRACE).claim == "B"
    assert store.claim_work(*key, "C", now + 4 * GRACE, 0).claim == "C"
    # A released claim (the ticket could not be created) frees the work; a stranger cannot release it.
    store.release_work(*key, "not-the-holder")
    assert store.claim_work(*key, "D", now, GRACE).claim == "C"
    store.release_work(*key, "C")
    assert store.claim_work(*key, "D", now, GRACE).claim == "D"


def test_followups_wait_pending_then_go_to_one_rerun_or_are_dropped(store):
    _ticket(store, "t-1")
    _ticket(store, "t-2")
    store.add_followup(FollowUpRecord("t-1", 5, "op", "operator", "given one"))
    for i, text in enumerate(("review", "comment a", "comment b")):
        store.add_followup(FollowUpRecord("t-1", 10 + i, "octo", "github:review", text, state=FOLLOWUP_PENDING))
    store.add_followup(FollowUpRecord("t-2", 10, "octo", "github:review", "other", state=FOLLOWUP_PENDING))
    # Pending follow-ups are no instruction of any run yet.
    assert [f.text for f in store.followups("t-1", 0)] == ["given one"]
    assert [f.text for f in store.pending_followups("t-1")] == ["review", "comment a", "comment b"]
    assert sorted(store.tickets_with_pending_followups()) == ["t-1", "t-2"]
    assert store.give_followups("t-1", 100) == 3
    assert store.give_followups("t-1", 200) == 0                  # given once
    assert [(f.text, f.at_ms) for f in store.followups("t-1", 100)] == [
        ("review", 100), ("comment a", 100), ("comment b", 100)]
    assert store.pending_followups("t-1") == [] and store.tickets_with_pending_followups() == ["t-2"]
    [dropped] = store.drop_followups("t-2")
    assert (dropped.text, dropped.state) == ("other", "dropped")
    assert store.drop_followups("t-2") == [] and store.followups("t-2", 0) == []
    assert store.tickets_with_pending_followups() == []


def test_concurrent_claimers_on_one_postgresql_database_have_one_winner(pg_url):
    """Eight schedulers (a store, so a connection, each) claim the same work at
    the same moment, round after round: exactly one holds it, every other one
    is told that one's token. Positive control: the same race on a table
    without the primary key (read, then insert) lets several win."""
    open_store_url(pg_url).close()
    n, rounds = 8, 30
    stores = [open_store_url(pg_url) for _ in range(n)]
    start = threading.Barrier(n)
    seen: list[list[str]] = [[] for _ in range(rounds)]
    lock = threading.Lock()

    def claim(i: int) -> None:
        now = _now(stores[i])
        for r in range(rounds):
            start.wait()
            held = stores[i].claim_work("o/r", r, "fix", f"s{i}", now, GRACE)
            with lock:
                seen[r].append(held.claim)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(rounds):
        assert len(seen[r]) == n and len(set(seen[r])) == 1, (r, seen[r])
    # Positive control: read-then-write on the same connections races.
    stores[0].db.execute("CREATE TABLE naive (number BIGINT, claim TEXT)")
    winners = [0] * rounds

    def naive(i: int) -> None:
        db = stores[i].db
        for r in range(rounds):
            start.wait()
            if db.execute("SELECT 1 FROM naive WHERE number=%s", (r,)).fetchone() is None:
                db.execute("INSERT INTO naive VALUES (%s, %s)", (r, f"s{i}"))
                with lock:
                    winners[r] += 1

    threads = [threading.Thread(target=naive, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(winners) > 1, winners
    for s in stores:
        s.close()


# The claim as first written: a row naming a ticket that is not live (in the claimer's view) was
# taken over at once.
OLD_CLAIM_WORK = (
    "INSERT INTO github_work (repo, number, trigger_name, claim, ticket_id, claimed_at_ms) "
    "VALUES (%s,%s,%s,%s,'',{now}) ON CONFLICT (repo, number, trigger_name) DO UPDATE SET "
    "claim=excluded.claim, ticket_id='', claimed_at_ms=excluded.claimed_at_ms "
    "WHERE (github_work.ticket_id='' AND github_work.claimed_at_ms<{now}-%s) OR (github_work.ticket_id<>'' "
    "AND NOT EXISTS (SELECT 1 FROM tickets t WHERE t.id=github_work.ticket_id AND t.state IN (%s,%s,%s)))")


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "positive-control-first-claim"])
def test_a_claimer_whose_snapshot_predates_the_holders_ticket_joins_it(pg_url, monkeypatch, fixed):
    """The interleaving two schedulers can hit: B's claim starts while A holds
    the row (recording its ticket), A's ticket is committed after B's statement
    began, then A's row. PostgreSQL gives B the row's newest version (naming
    the ticket) but reads `tickets` in B's older snapshot, where the ticket is
    not there yet. B must join A's ticket, not take the claim over."""
    if not fixed:
        monkeypatch.setattr(pg_records, "CLAIM_WORK", OLD_CLAIM_WORK)
    open_store_url(pg_url).close()
    a, b, c = (open_store_url(pg_url) for _ in range(3))
    key = ("o/r", 5, "fix")
    assert a.claim_work(*key, "A", 0, GRACE).claim == "A"
    holder = psycopg.connect(pg_url)                        # A records its ticket in a transaction ...
    holder.execute("UPDATE github_work SET ticket_id='t-a' WHERE claim='A'")
    got: list = []
    blocked = threading.Thread(target=lambda: got.append(b.claim_work(*key, "B", 0, GRACE)))
    blocked.start()                                          # ... B's claim waits for that row
    end = time.monotonic() + 10
    while not c.db.execute("SELECT 1 FROM pg_stat_activity WHERE wait_event_type='Lock' AND "
                           "query LIKE 'INSERT INTO github_work%%'").fetchone():
        assert time.monotonic() < end, "B's claim never waited for A's row"
        time.sleep(0.01)
    _ticket(c, "t-a")                                        # A's ticket, committed after B's statement began
    holder.commit()                                          # then A's row
    blocked.join(10)
    [held] = got
    if fixed:
        assert (held.claim, held.ticket_id) == ("A", "t-a")   # B joins A's ticket
    else:
        assert held.claim == "B"                               # B took the work over: a second ticket
    holder.close()
    for s in (a, b, c):
        s.close()
