"""Why a ticket's next run is a new attempt, and who ran the one before.

A node that was running when its run stopped (the scheduler restarted, its
lease was taken over by another scheduler, or it fenced itself off, R45) runs
again as a new attempt (`node_runs.attempt` + 1). `Attempt` is what the
engine knows about the interruption when it starts the run again; the run
(`TicketRun`) says it on the ticket before anything else:

- `events.lost` {count, reason, attempt, scheduler} when events of the
  interrupted attempt were never stored and their number is known (this
  scheduler counted them: `EventLog.fence`), before any event of the new
  attempt;
- `node.attempt` {node, attempt, reason, previous_scheduler, scheduler} for
  every interrupted node, and every event of the new attempt's nodes carries
  `attempt`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..store.store import Store

RESTART = "restart"          # the scheduler that drove it stopped and started again (same store)
TAKEOVER = "takeover"        # another scheduler's lease expired; this one claimed the ticket
SELF_FENCED = "self_fenced"  # this scheduler stopped acting before its lease could end (R45), then claimed it again

PAGES = 20                   # pages of 1000 events looked through backwards for the previous attempt's scheduler


@dataclass(frozen=True)
class Attempt:
    reason: str                  # RESTART, TAKEOVER or SELF_FENCED
    previous_scheduler: str = ""  # the scheduler that ran the interrupted attempt ("" when no event says)
    lost_events: int = 0         # events of the interrupted attempt that were never stored (counted here)


def previous_scheduler(store: Store, ticket_id: str) -> str:
    """The scheduler of the latest stored `node.started` event (each names the scheduler of its
    attempt; `ticket.takeover` names the new owner, not the old), read backwards from the ticket's
    last event, at most PAGES pages of 1000; "" when none says."""
    last = store.events.last_seq(ticket_id)
    for _ in range(PAGES):
        if last < 1:
            break
        first = max(1, last - 999)
        for ev in reversed(store.events.read(ticket_id, first, last - first + 1)):
            if ev.type == "node.started" and '"scheduler"' in ev.payload_json:
                return str(json.loads(ev.payload_json).get("scheduler") or "")
        last = first - 1
    return ""


def lost_reason(reason: str) -> str:
    """The `events.lost` reason of an interrupted attempt's events that were never stored."""
    if reason == SELF_FENCED:
        return ("this scheduler could not renew the ticket's lease and stopped acting before it could end "
                "(self-fencing, R45); the events its attempt had not stored yet were dropped, not written late")
    if reason == TAKEOVER:
        return ("the scheduler that ran the attempt lost the ticket to this one; the events it had not "
                "stored were dropped, not written late (R45)")
    return "the attempt stopped before these events were stored"
