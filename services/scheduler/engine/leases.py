"""Leases: several schedulers on one PostgreSQL store (docs/SCALE.md).

Each live ticket is driven by the scheduler that claimed it (`Store.claim_ticket`:
the dispatcher for a queued ticket, `Engine.start` and the takeover loop for a
running or waiting one whose owner's lease expired). `_lease_loop` renews the
leases of the tickets this scheduler drives and learns what others asked of
them (a cancel, an approval); a ticket found taken over stops at once without a
write or a side effect (`LeaseLost`, R37). On an unshared store (SQLite) the
scheduler owns every ticket and neither loop runs.

A part of `Engine` (engine.py), which holds the state used here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from typing import TYPE_CHECKING

from services.common.metrics import SchedulerMetrics

from ..events.log import EventLog
from ..store.base import (
    RUNNING,
    TERMINAL,
    WAITING_APPROVAL,
    ApprovalRecord,
    Lease,
    LeaseLost,
    Store,
    TicketRecord,
)
from ..store.worker import run_in_store, store_failing

if TYPE_CHECKING:
    from .view import TicketView

log = logging.getLogger(__name__)

LEASE_S = 10.0                     # a live ticket's lease; renewed every third of it (docs/SCALE.md)
HELD = (RUNNING, WAITING_APPROVAL)  # states a scheduler drives a ticket in (takeover takes them over)


def scheduler_id() -> str:
    """A new id for this scheduler process (host, pid, random): the owner of its leases."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Leases:
    """The leases of the tickets this scheduler drives: claim, check (R37), renew, take over."""

    # of Engine (engine.py)
    store: Store
    owner: str
    lease_s: float
    fencing: bool
    max_running: int
    events: EventLog
    metrics: SchedulerMetrics | None
    _lost: set[str]
    _tasks: dict[str, asyncio.Task]
    _running: set[str]
    _cancelling: dict[str, str]
    _finishing: set[str]
    _waiters: dict[str, asyncio.Future]
    _stopping: bool

    if TYPE_CHECKING:
        def view(self, ticket_id: str) -> TicketView: ...
        async def cancel(self, ticket_id: str, principal: str) -> TicketView: ...
        def _kick(self) -> None: ...
        def _launch(self, t: TicketRecord, resumed: bool) -> None: ...
        def _spawn(self, coro) -> None: ...
        def _wake(self, ticket_id: str, rec: ApprovalRecord) -> None: ...

    @property
    def lease_ms(self) -> int:
        return int(self.lease_s * 1000)

    def _claim(self, ticket_id: str, states: tuple[str, ...]) -> bool:
        """Take the ticket for this scheduler (a new fence) when it is in `states`
        and free; True when this scheduler drives it now."""
        if ticket_id in self._tasks:
            return True
        fence = self.store.claim_ticket(ticket_id, states, self.lease_ms)
        if fence is None:
            return False
        self._lost.discard(ticket_id)
        return True

    def _holds(self, ticket_id: str) -> bool:
        fence = self.store.fences.get(ticket_id) if self.store.shared else 0
        if fence is None or ticket_id in self._lost:
            return False
        return not self.store.shared or self.store.holds(ticket_id, fence)

    def check_lease(self, ticket_id: str) -> None:
        """Right before a side effect (a push, a pull request, a merge, a comment):
        this scheduler still holds the ticket with its fence, by the database's
        clock, or `LeaseLost` (R37)."""
        if self.fencing and not self._holds(ticket_id):
            self._lost.add(ticket_id)
            raise LeaseLost(ticket_id)

    def fence(self, ticket_id: str) -> int:
        """The fence this scheduler holds the ticket with (0: an unshared store, nothing to fence)."""
        return self.store.fences.get(ticket_id, 0) if self.fencing and self.store.shared else 0

    def lease_lost(self, ticket_id: str) -> bool:
        return ticket_id in self._lost

    def _resume(self, t: TicketRecord) -> None:
        if t.state == RUNNING:
            self._running.add(t.id)
        self._launch(t, resumed=True)

    def _forget(self, ticket_id: str, why: str) -> None:
        """Stop driving a ticket another scheduler took over: no write, no teardown."""
        log.warning("ticket %s: stopped here: %s; the scheduler that took it over goes on", ticket_id, why)
        self._lost.add(ticket_id)
        self.store.fences.pop(ticket_id, None)
        self._running.discard(ticket_id)
        self._cancelling.pop(ticket_id, None)
        self._kick()

    async def _cancel_elsewhere(self, ticket_id: str, who: str) -> TicketView:
        """A cancel of a ticket another scheduler drives: ask it (its heartbeat sees the
        request) and wait for the end, at most a lease and a half."""
        self.store.request_cancel(ticket_id, who)
        end = time.monotonic() + self.lease_s * 1.5 + 5
        while time.monotonic() < end:
            t = self.store.get_ticket(ticket_id)
            if t is None or t.state in TERMINAL:
                break
            await asyncio.sleep(0.2)
        return self.view(ticket_id)

    async def _lease_loop(self) -> None:
        """Renew the leases of the tickets this scheduler drives, every third of a
        lease; stop the ones another scheduler took over; act on what was asked
        of them through another scheduler (a cancel, an approval)."""
        while not self._stopping:
            await asyncio.sleep(self.lease_s / 3)
            held = list(self.store.fences)
            if not held:
                continue
            try:
                # On the store's thread (store/worker.py), waited for at most a lease (a renewal later
                # than that renews nothing): a database that does not answer holds neither the loop
                # nor the heartbeat, which counts the failure and tries again.
                def renew(s: Store, ids: list[str] = held) -> list[Lease]:
                    return s.renew_leases(ids, self.lease_ms)
                renewed = await run_in_store(self.store, renew, timeout=self.lease_s)
                leases = {lease.ticket_id: lease for lease in renewed}
            except Exception as exc:  # noqa: BLE001 - the database is away: the leases run out unless it is back
                log.warning("scheduler: could not renew its tickets' leases: %s",
                            getattr(exc, "message", type(exc).__name__))
                if self.metrics is not None:
                    self.metrics.lease_renew_failures.labels(reason="error").inc()
                continue
            for tid in held:
                lease = leases.get(tid)
                if lease is None:
                    if tid not in self.store.fences:
                        continue          # released meanwhile (the ticket ended)
                    if self.metrics is not None:
                        self.metrics.lease_renew_failures.labels(reason="lost").inc()
                    self._lost.add(tid)
                    self.store.fences.pop(tid, None)
                    task = self._tasks.get(tid)
                    if task is not None and tid not in self._finishing:
                        task.cancel()
                    continue
                if lease.cancel_by and tid in self._tasks and tid not in self._cancelling:
                    self._spawn(self.cancel(tid, lease.cancel_by))
                elif lease.state == RUNNING and tid in self._waiters:
                    rec = self.store.latest_approval(tid)
                    if rec is not None:
                        self._running.add(tid)
                        self._wake(tid, rec)

    async def _takeover_loop(self) -> None:
        """Claim the live tickets whose owner's lease expired (it died or hangs) and
        resume them here; start queued tickets filed through other schedulers."""
        interval = max(0.2, self.lease_s / 5)
        while not self._stopping:
            await asyncio.sleep(interval)
            if store_failing(self.store):
                continue          # nothing to take over from a database that does not answer
            try:
                expired = await run_in_store(self.store, lambda s: s.expired_tickets(HELD), timeout=self.lease_s)
                for tid in expired:
                    if self._stopping or tid in self._tasks:
                        continue
                    if len(self._running) >= self.max_running:
                        break
                    t = self.store.get_ticket(tid)
                    if t is None or not self._claim(tid, HELD):
                        continue
                    t = self.store.get_ticket(tid) or t
                    log.info("ticket %s: taken over (%s; its scheduler's lease expired)", tid, t.state)
                    if self.metrics is not None:
                        self.metrics.lease_takeovers.labels(from_state=t.state).inc()
                    self.events.append(tid, "ticket.takeover", {"scheduler": self.owner, "state": t.state})
                    self._resume(t)
                self._kick()
            except Exception as exc:  # noqa: BLE001 - the next scan tries again
                log.warning("scheduler: the takeover scan failed: %s", getattr(exc, "message", type(exc).__name__))
