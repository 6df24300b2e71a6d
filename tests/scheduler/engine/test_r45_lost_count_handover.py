"""The count of events a lost attempt could not store travels from the
scheduler that lost the ticket to the one that took it over (R45; docs/SCALE.md
"A takeover is a new attempt"): engine/handover.py over the rebuilt store's
`lost_events` (store/events.py), two schedulers' stores on the real
PostgreSQL test server.

The engine's event log and leases are stood in for by what Handover reads of
them (how many events the old attempt dropped, that the ticket was lost);
the database round trip is the real one.

- reported before the takeover: the new attempt starts with the count;
- reported after it (the old owner was cut off from the database when the
  takeover happened): the new owner says it on its heartbeat, once;
- positive control: a store that carries no reports (the store before the
  rebuild) leaves the new attempt without the count.
"""

from __future__ import annotations

import pytest

from services.scheduler.engine.handover import Handover
from services.scheduler.engine.leases import TAKEN_OVER
from services.scheduler.events.writes import LOST_EVENT
from services.scheduler.executor.attempts import TAKEOVER
from services.scheduler.store.base import QUEUED, RUNNING, EventRecord, NodeRunRecord, TicketRecord
from services.scheduler.store.store import Store

pytestmark = pytest.mark.timeout(60)

TID = "t-handover"


class DroppedEvents:
    """What Handover asks of the event log: `dropped` events of the lost attempt, and what it appends."""

    def __init__(self, dropped: int) -> None:
        self.dropped = dropped
        self.appended: list[tuple[str, str, dict]] = []

    def holds_unstored(self, ticket_id: str) -> bool:
        return False

    def unfence(self, ticket_id: str) -> int:
        n, self.dropped = self.dropped, 0
        return n

    def append(self, ticket_id: str, type_: str, payload: dict) -> int:
        self.appended.append((ticket_id, type_, payload))
        return 0


class LostHere:
    lease_s = 3.0

    def __init__(self) -> None:
        self.forgotten: list[str] = []

    def forget(self, ticket_id: str) -> None:
        self.forgotten.append(ticket_id)

    def lost(self, ticket_id: str) -> bool:
        return True

    def lost_reason(self, ticket_id: str) -> str:
        return TAKEN_OVER


class NoReports:
    """A store without lost-event reports (the store before the rebuild: its `events` reads events)."""

    def events(self, ticket_id: str, from_seq: int, limit: int = 1000) -> list:
        return []


@pytest.fixture
def two(pg_url):
    a = Store.postgresql(pg_url, "the test database", owner="sched-a")
    b = Store.postgresql(pg_url, "the test database", owner="sched-b")
    t = TicketRecord(id=TID, workspace="ws", workflow="wf", title="t", body="", inputs={}, state=QUEUED,
                     created_at_ms=1, updated_at_ms=1)
    a.tickets.create(t, [NodeRunRecord(TID, "edit", "run")], [EventRecord(TID, 1, "ticket.created", "{}", 1)])
    assert a.leases.claim(TID, (QUEUED,), lease_ms=0) == 1        # a's lease ends at once
    a.tickets.update(TID, state=RUNNING, updated_at_ms=2)
    assert b.leases.claim(TID, (RUNNING,), lease_ms=60_000) == 2  # b takes the ticket over
    a.leases.lose(TID)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


async def test_r45_the_old_owners_count_reaches_the_new_attempt(two):
    a, b = two
    leases_a = LostHere()
    old = Handover(a, DroppedEvents(7), leases_a, running=lambda tid: False)   # type: ignore[arg-type]
    await old.lost_here(TID, fence=1)
    assert leases_a.forgotten == [TID]          # the lost fence goes once nothing of the attempt is in flight
    new = Handover(b, DroppedEvents(0), LostHere(), running=lambda tid: False)   # type: ignore[arg-type]
    attempt = new.attempt_for(TID, TAKEOVER, "sched-b", interrupted=1)
    assert attempt.lost_events == 7 and attempt.reason == TAKEOVER
    assert b.events.take_lost_reports(TID) == []                    # taken once


async def test_r45_a_count_reported_after_the_takeover_is_said_on_the_heartbeat_once(two):
    a, b = two
    events_b = DroppedEvents(0)
    new = Handover(b, events_b, LostHere(), running=lambda tid: False)   # type: ignore[arg-type]
    assert new.attempt_for(TID, TAKEOVER, "sched-b", interrupted=1).lost_events == 0
    new.heard(TID)
    assert events_b.appended == []                                   # nothing reported yet
    old = Handover(a, DroppedEvents(5), LostHere(), running=lambda tid: False)   # type: ignore[arg-type]
    await old.lost_here(TID, fence=1)                                # the old owner is back and reports
    new.heard(TID)
    new.heard(TID)
    [(tid, type_, payload)] = events_b.appended
    assert (tid, type_) == (TID, LOST_EVENT) and payload["count"] == 5 and payload["attempt"] == 1


async def test_positive_control_a_store_without_reports_loses_the_count_between_schedulers(two):
    _a, _b = two
    old = Handover(NoReports(), DroppedEvents(7), LostHere(), running=lambda tid: False)   # type: ignore[arg-type]
    await old.lost_here(TID, fence=1)
    new = Handover(NoReports(), DroppedEvents(0), LostHere(), running=lambda tid: False)   # type: ignore[arg-type]
    assert new.attempt_for(TID, TAKEOVER, "sched-b", interrupted=1).lost_events == 0
