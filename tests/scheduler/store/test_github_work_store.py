"""The store side of one ticket per piece of work from GitHub and of queued
follow-ups (migration 0007, docs/GITHUB.md), on SQLite and PostgreSQL: the
work claim is one row taken atomically and taken over only when it blocks
nothing any more; follow-ups are given to one re-run only. Concurrent
claimers on one PostgreSQL database: test_store_record_repos.py."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from services.scheduler.store.base import (
    CANCELLED,
    FOLLOWUP_PENDING,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    FollowUpRecord,
    TicketRecord,
)
from services.scheduler.store.database import db_now_ms
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
    store.tickets.create(TicketRecord(tid, "ws", "fix", "t", "b", {}, state, 1, 1), [], [])


def _now(store) -> int:
    """The store's clock: PostgreSQL's claim uses the database's, so the test takes it from there."""
    if store.db.dialect == "postgresql":
        with store.db.transaction() as conn:
            return int(conn.execute(sa.select(db_now_ms())).scalar())
    return int(time.time() * 1000)


def test_a_work_claim_is_held_while_its_ticket_lives_and_taken_over_after(store):
    key = ("o/r", 7, "fix-issues")
    now = _now(store)
    first = store.intake.claim_work(*key, "A", now, GRACE)
    assert (first.claim, first.ticket_id) == ("A", "")
    # Another claimer while A creates the ticket: A holds it (no ticket id yet).
    assert store.intake.claim_work(*key, "B", now, GRACE).claim == "A"
    _ticket(store, "t-1")
    assert store.intake.set_work_ticket(*key, "A", "t-1")
    assert not store.intake.set_work_ticket(*key, "B", "t-x")            # only the holder records its ticket
    for state in (QUEUED, RUNNING):
        store.tickets.update("t-1", state=state)
        held = store.intake.claim_work(*key, "B", now, GRACE)
        assert (held.claim, held.ticket_id) == ("A", "t-1")        # live: B joins t-1
    # Other keys are other work.
    assert store.intake.claim_work("o/r", 8, "fix-issues", "C", now, GRACE).claim == "C"
    assert store.intake.claim_work("o/r", 7, "other-trigger", "D", now, GRACE).claim == "D"
    assert store.intake.claim_work("o/other", 7, "fix-issues", "E", now, GRACE).claim == "E"
    # The ticket ended: the next claimer takes the work over.
    for ended in (SUCCEEDED, CANCELLED):
        store.tickets.update("t-1", state=ended)
        held = store.intake.claim_work(*key, f"F-{ended}", now, GRACE)
        assert (held.claim, held.ticket_id) == (f"F-{ended}", "")
        assert store.intake.set_work_ticket(*key, f"F-{ended}", "t-1")


def test_a_claim_left_by_a_crash_blocks_nothing_for_long(store):
    key = ("o/r", 9, "fix-issues")
    now = _now(store)
    # A claim whose ticket does not exist (never created, or gone): held for the grace period (the
    # ticket may be one a claimer's snapshot does not show yet, below), then taken over.
    store.intake.claim_work(*key, "A", now, GRACE)
    store.intake.set_work_ticket(*key, "A", "t-never-stored")
    assert store.intake.claim_work(*key, "B", now, GRACE).claim == "A"
    store.intake.release_work(*key, "A")
    store.intake.claim_work(*key, "A", now, GRACE)
    store.intake.set_work_ticket(*key, "A", "t-never-stored")
    assert store.intake.claim_work(*key, "B", now + 2 * GRACE, 0).claim == "B"
    # A claim without a ticket (its creator died between claim and create): held for the grace
    # period, then taken over.
    assert store.intake.claim_work(*key, "C", now, GRACE).claim == "B"
    assert store.intake.claim_work(*key, "C", now + 4 * GRACE, 0).claim == "C"
    # A released claim (the ticket could not be created) frees the work; a stranger cannot release it.
    store.intake.release_work(*key, "not-the-holder")
    assert store.intake.claim_work(*key, "D", now, GRACE).claim == "C"
    store.intake.release_work(*key, "C")
    assert store.intake.claim_work(*key, "D", now, GRACE).claim == "D"


def test_followups_wait_pending_then_go_to_one_rerun_or_are_dropped(store):
    _ticket(store, "t-1")
    _ticket(store, "t-2")
    store.followups.add_followup(FollowUpRecord("t-1", 5, "op", "operator", "given one"))
    for i, text in enumerate(("review", "comment a", "comment b")):
        store.followups.add_followup(FollowUpRecord("t-1", 10 + i, "octo", "github:review", text, state=FOLLOWUP_PENDING))
    store.followups.add_followup(FollowUpRecord("t-2", 10, "octo", "github:review", "other", state=FOLLOWUP_PENDING))
    # Pending follow-ups are no instruction of any run yet.
    assert [f.text for f in store.followups.followups("t-1", 0)] == ["given one"]
    assert [f.text for f in store.followups.pending_followups("t-1")] == ["review", "comment a", "comment b"]
    assert sorted(store.followups.tickets_with_pending_followups()) == ["t-1", "t-2"]
    assert store.followups.give_followups("t-1", 100) == 3
    assert store.followups.give_followups("t-1", 200) == 0                  # given once
    assert [(f.text, f.at_ms) for f in store.followups.followups("t-1", 100)] == [
        ("review", 100), ("comment a", 100), ("comment b", 100)]
    assert store.followups.pending_followups("t-1") == [] and store.followups.tickets_with_pending_followups() == ["t-2"]
    [dropped] = store.followups.drop_followups("t-2")
    assert (dropped.text, dropped.state) == ("other", "dropped")
    assert store.followups.drop_followups("t-2") == [] and store.followups.followups("t-2", 0) == []
    assert store.followups.tickets_with_pending_followups() == []
