"""What one attempt of a ticket hands to the next when the ticket changes
hands (a takeover by another scheduler, or this one claiming again after it
fenced itself off, R45): how many events the lost attempt could not store.

The scheduler that lost the ticket drops those events (`EventLog.fence`,
never written late) and, once its run has stopped and nothing of the attempt
is on the store's thread any more, forgets the lost fence and takes the
count (`lost_here`). It reports
it in the database (`report_lost`, a non-owner's write like a cancel
request: the row is its own report) so whichever scheduler claims the ticket
says it; it keeps it here too, for when it claims the ticket again itself
before the report could be written (the database away).

The scheduler that claims the ticket takes the reports (`take_lost_reports`,
fenced: only the owner) for the new attempt's first event, `events.lost`
(`attempt_for`); a report that arrives later (the old owner was cut off
from the database when the takeover happened) is taken on the heartbeat
(`heard`) and said then.

A store without lost-event reports (the store before the SQLAlchemy one)
carries nothing between schedulers: the count is said only by the scheduler
that counted it, when it claims the ticket again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..events.log import EventLog
from ..events.writes import LOST_EVENT
from ..executor.attempts import SELF_FENCED, TAKEOVER, Attempt, lost_reason
from ..store.store import Store
from ..store.worker import run_in_store
from .leases import Leases

log = logging.getLogger(__name__)

REPORT_RETRY_S = (0.5, 1.0, 2.0, 5.0, 10.0)   # a report the database did not take is tried again after these
REPORT_TRIES = 60                            # about ten minutes of the longest delay


def _reports(store: Store) -> object | None:
    """The repository that carries lost-event reports (store.events of the SQLAlchemy store), or
    None when this store has none."""
    repo = getattr(store, "events", None)
    return repo if hasattr(repo, "report_lost") and hasattr(repo, "take_lost_reports") else None


class Handover:
    """The lost attempts' event counts: reported by the scheduler that lost a ticket, said by the
    one that claims it."""

    def __init__(self, store: Store, events: EventLog, leases: Leases, running: Callable[[str], bool]) -> None:
        self.store = store
        self.events = events
        self.leases = leases
        self.running = running      # a run task of the ticket is here (the dispatcher's)
        self._counted: dict[str, int] = {}          # ticket -> events its attempt here never stored (not said yet)
        self._awaiting: dict[str, int] = {}         # ticket taken over here -> its interrupted attempt, report to come

    # ---- the scheduler that lost the ticket -------------------------------------------

    async def lost_here(self, ticket_id: str, fence: int) -> None:
        """The lost ticket's run has stopped here: once its events on the store's thread met their
        fence, take the count of what was never stored, and report it for the next owner."""
        for _ in range(int(self.leases.lease_s * 40) + 200):
            if not self.events.holds_unstored(ticket_id):
                break
            await asyncio.sleep(0.05)
        # Every statement the lost attempt left on the store's thread (a node's state, a batch of
        # events) runs before this one, meeting the fence still marked lost: only then is the fence
        # forgotten (a write of the ticket after that would not be checked against it).
        try:
            await run_in_store(self.store, lambda s: None)
        except Exception:  # noqa: BLE001 - the store is closed: the scheduler stops
            return
        if not self.leases.lost(ticket_id) or self.running(ticket_id):
            return
        self.leases.forget(ticket_id)
        count = self.events.unfence(ticket_id)
        if count:
            log.warning("ticket %s: %d event(s) of its attempt here were never stored (its lease was lost: %s); "
                        "they were dropped, not written late", ticket_id, count, self.leases.lost_reason(ticket_id))
        self._counted[ticket_id] = self._counted.get(ticket_id, 0) + count
        repo = _reports(self.store)
        if repo is None or fence <= 0:
            return
        for i in range(REPORT_TRIES):
            if ticket_id not in self._counted:
                return               # claimed here again meanwhile: said by that attempt
            try:
                repo.report_lost(ticket_id, fence, self._counted[ticket_id])  # type: ignore[attr-defined]
                self._counted.pop(ticket_id, None)
                return
            except Exception as exc:  # noqa: BLE001 - the database is away: tried again
                log.info("ticket %s: the count of lost events not reported yet: %s", ticket_id,
                         getattr(exc, "message", type(exc).__name__))
            await asyncio.sleep(REPORT_RETRY_S[min(i, len(REPORT_RETRY_S) - 1)])
        log.warning("ticket %s: the count of its %d lost event(s) could not be reported; the log has it",
                    ticket_id, self._counted.get(ticket_id, 0))

    # ---- the scheduler that claims the ticket ---------------------------------------

    def attempt_for(self, ticket_id: str, why: str, owner: str, interrupted: int) -> Attempt:
        """The attempt a claimed ticket's run starts with: why, and the lost events known now
        (`interrupted`: the attempt of the node that was running, for a report that comes later)."""
        reported = self._take(ticket_id)
        count = self._counted.pop(ticket_id, 0) + (reported or 0)
        if why == TAKEOVER and reported is None and _reports(self.store) is not None:
            self._awaiting[ticket_id] = interrupted
        return Attempt(why, owner if why == SELF_FENCED else "", count)

    def heard(self, ticket_id: str) -> None:
        """On the heartbeat of a ticket taken over here: the old owner's report, once it came."""
        if ticket_id not in self._awaiting:
            return
        count = self._take(ticket_id)
        if count is None:
            return
        attempt = self._awaiting.pop(ticket_id)
        if count:
            self.events.append(ticket_id, LOST_EVENT, {"count": count, "reason": lost_reason(TAKEOVER),
                                                       "attempt": attempt})

    def ended(self, ticket_id: str) -> None:
        """The ticket's run ended here: no report is waited for any more."""
        self._awaiting.pop(ticket_id, None)

    def _take(self, ticket_id: str) -> int | None:
        """The sum of the reports the database holds for the ticket, taking them; None: none there
        (or a store without reports)."""
        repo = _reports(self.store)
        if repo is None:
            return None
        reports = repo.take_lost_reports(ticket_id)  # type: ignore[attr-defined]
        return sum(count for _fence, count in reports) if reports else None
