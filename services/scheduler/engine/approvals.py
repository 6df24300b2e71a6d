"""Approvals: a person's decision on a ticket that waits for one (R16), and
the run's wait for it (`wait_for_decision`, through executor.Host).

`Approvals` owns the runs parked waiting for a decision (`waiters`); the
capacity they stop holding and the run started again for a decision given
through another scheduler are the dispatcher's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from services.common.errors import FailedPrecondition, InvalidArgument

from ..events.log import EventLog, now_ms
from ..executor import Transitions
from ..executor.nodes.verification import check_approvable
from ..executor.transitions import state_event
from ..store.base import RUNNING, WAITING_APPROVAL, ApprovalRecord
from ..store.store import Store
from .dispatch import Dispatcher
from .leases import HELD
from .view import TicketView


class Approvals:
    """Approve, reject, and wake the run waiting for the decision."""

    def __init__(self, store: Store, events: EventLog, transitions: Transitions, dispatch: Dispatcher,
                 view: Callable[[str], TicketView]) -> None:
        self.store = store
        self.events = events
        self.transitions = transitions
        self.dispatch = dispatch
        self.view = view
        self.waiters: dict[str, asyncio.Future[ApprovalRecord]] = {}

    async def approve(self, ticket_id: str, principal: str, sha: str, *,
                      accept_harness_change: bool = False) -> TicketView:
        t = self.view(ticket_id).ticket
        if not principal:
            raise InvalidArgument("an approval needs the principal (who approves)")
        if t.state != WAITING_APPROVAL:
            raise FailedPrecondition(f"ticket {ticket_id} is {t.state}, not waiting for approval")
        if sha and sha != t.awaiting_sha:
            raise FailedPrecondition(
                f"the pull request head is {t.awaiting_sha or 'unknown'} now, not {sha}; review it again "
                f"and approve the current head")
        # R41: a head whose verification failed is not approved (the merge would refuse it), and
        # a change to how its tests run is approved only when the person says they saw it
        accepted = check_approvable(self.store.verifications.verification(ticket_id, t.awaiting_sha) if t.awaiting_sha else None,
                                    t.awaiting_sha, accept_harness_change)
        rec = ApprovalRecord(ticket_id, principal, t.awaiting_sha, True, now_ms(), accepted_harness_change=accepted)
        self.events.flush()
        self.store.approvals.add_approval(rec)
        granted = {"principal": principal, "sha": rec.sha,
                   **({"accepted_harness_change": accepted} if accepted else {})}
        self.transitions.move(t.id, RUNNING, ("approval.granted", granted),
                              state_event(RUNNING), awaiting_sha="")
        self.dispatch.running.add(t.id)
        self.wake(t.id, rec)
        return self.view(ticket_id)

    async def reject(self, ticket_id: str, principal: str, reason: str) -> TicketView:
        t = self.view(ticket_id).ticket
        if not principal:
            raise InvalidArgument("a rejection needs the principal (who rejects)")
        if t.state != WAITING_APPROVAL:
            raise FailedPrecondition(f"ticket {ticket_id} is {t.state}, not waiting for approval")
        rec = ApprovalRecord(ticket_id, principal, t.awaiting_sha, False, now_ms(), reason or "")
        self.events.flush()
        self.store.approvals.add_approval(rec)
        self.transitions.move(t.id, RUNNING, ("approval.rejected", {"principal": principal, "sha": rec.sha,
                                                                    "reason": reason or ""}),
                              counted=False, awaiting_sha="")
        self.dispatch.running.add(t.id)
        task = self.dispatch.tasks.get(ticket_id)
        self.wake(t.id, rec)
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        return self.view(ticket_id)

    def wake(self, ticket_id: str, rec: ApprovalRecord) -> None:
        """Hand the decision to the run waiting for it, or start the run here (a restart parked it)."""
        fut = self.waiters.get(ticket_id)
        if fut is not None and not fut.done():
            fut.set_result(rec)
        elif ticket_id not in self.dispatch.tasks:
            t = self.store.tickets.get(ticket_id)
            if t is not None and self.dispatch.claim(t.id, HELD):
                self.dispatch.launch(t, resumed=True)
            else:   # another scheduler drives it: its heartbeat sees the decision (Engine._heard)
                self.dispatch.running.discard(ticket_id)

    def heard(self, ticket_id: str) -> None:
        """A held ticket is `running` again by its lease, and a run of it here waits for a decision:
        the decision was given through another scheduler."""
        if ticket_id in self.waiters:
            rec = self.store.approvals.latest_approval(ticket_id)
            if rec is not None:
                self.dispatch.running.add(ticket_id)
                self.wake(ticket_id, rec)

    async def wait_for_decision(self, ticket_id: str) -> ApprovalRecord:
        fut: asyncio.Future[ApprovalRecord] = asyncio.get_running_loop().create_future()
        self.waiters[ticket_id] = fut
        try:
            self.dispatch.running.discard(ticket_id)   # a waiting ticket holds no capacity
            self.dispatch.kick()
            return await fut
        finally:
            if self.waiters.get(ticket_id) is fut:
                del self.waiters[ticket_id]
