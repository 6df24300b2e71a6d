"""Ticket state changes: the store row, the events that announce it and the
`afe_ticket_transitions_total` metric, always together and in this order.

Every change of a ticket's `state` goes through `Transitions`: `create`
(the first state, `queued`, stored in one transaction with `ticket.created`)
and `move` (every later one: the dispatcher, approvals, the approval wait,
the end). Node states are the run's business (`TicketRun.run_node`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.common.observability.metrics import SchedulerMetrics

from ..events.log import EventLog, now_ms
from ..store.base import QUEUED, TERMINAL, NodeRunRecord, TicketRecord
from ..store.store import Store

Event = tuple[str, dict[str, Any]]


def state_event(state: str) -> Event:
    """`ticket.state`: what watchers see when a live ticket changes state."""
    return ("ticket.state", {"state": state})


class Transitions:
    def __init__(self, store: Store, events: EventLog, metrics: SchedulerMetrics | None) -> None:
        self.store = store
        self.events = events
        self.metrics = metrics
        # Called with (ticket id, state) after every stored change (github/report.py); never raise.
        self.listeners: list[Callable[[str, str], None]] = []

    def notify(self, ticket_id: str, state: str) -> None:
        """Tell the listeners; also for a change that is not a state (a pull request opened)."""
        for listener in self.listeners:
            listener(ticket_id, state)

    def create(self, ticket: TicketRecord, nodes: list[NodeRunRecord], created: dict[str, Any]) -> None:
        """Store a new `queued` ticket, its node runs and `ticket.created` at once."""
        self.events.flush()
        first = [self.events.make(ticket.id, "ticket.created", created)]
        self.store.tickets.create(ticket, nodes, first)
        self.events.delivered(first)
        self.count(QUEUED)

    def move(self, ticket_id: str, state: str, *events: Event, counted: bool = True, **fields: object) -> None:
        """Store `state` (and `fields`), append `events` in order, count the
        transition. A terminal state is stored after every earlier event and
        its own events are flushed at once, so a watcher that sees the ticket
        ended has every event. `counted=False` only for a rejection: the
        ticket is `running` for the moment its run takes to fail."""
        terminal = state in TERMINAL
        if terminal:
            self.events.flush()
        self.store.tickets.update(ticket_id, state=state, updated_at_ms=now_ms(), **fields)
        for type_, payload in events:
            self.events.append(ticket_id, type_, payload)
        if terminal:
            self.events.flush()
        if counted:
            self.count(state)
        self.notify(ticket_id, state)

    def count(self, state: str) -> None:
        if self.metrics is not None:
            self.metrics.ticket_transitions.labels(state=state).inc()

    def set_gauges(self) -> None:
        if self.metrics is None:
            return
        # Every state, the finished ones too: `afe_tickets{state="failed"}` is an alert (OPERATIONS.md).
        self.metrics.set_ticket_counts(self.store.tickets.count_by_state())
