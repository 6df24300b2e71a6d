"""Tickets and their node runs (the tickets and node_runs tables).

A ticket is created with its pending node runs and its first events in one
transaction (not fenced: nobody holds a new ticket). Every later change of a
ticket this scheduler holds is fenced (R45, leases.py): `update` carries
owner and fence in its WHERE clause, `update_node` checks them in its
transaction; a lost lease raises `LeaseLost` with nothing written.
The lease columns (owner, lease_until_ms, fence, cancel_by) are written by
leases.py only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from .base import LIVE, TERMINAL, EventRecord, LeaseLost, NodeRunRecord, TicketRecord
from .database import Repository
from .events import insert_events
from .schema import node_runs, tickets

_t = tickets.c
_n = node_runs.c

_TICKET_COLS = (_t.rowid, _t.id, _t.workspace, _t.workflow, _t.title, _t.body, _t.inputs_json, _t.state,
                _t.created_at_ms, _t.updated_at_ms, _t.principal, _t.error, _t.tokens_used, _t.awaiting_sha,
                _t.torn_down, _t.origin_json, _t.reopened_at_ms)
_NODE_COLS = (_n.ticket_id, _n.node_id, _n.kind, _n.state, _n.needs_json, _n.attempt, _n.started_at_ms,
              _n.finished_at_ms, _n.output, _n.error, _n.rounds, _n.feedback)
TICKET_FIELDS = frozenset({"state", "updated_at_ms", "error", "tokens_used", "awaiting_sha", "torn_down",
                           "reopened_at_ms"})
NODE_FIELDS = frozenset({"state", "attempt", "started_at_ms", "finished_at_ms", "output", "error", "rounds",
                         "feedback"})


TicketList = list[TicketRecord]    # (inside `Tickets`, `list` is its method)
NodeRunList = list[NodeRunRecord]


def _ticket(row: Sequence[Any]) -> TicketRecord:
    return TicketRecord(
        rowid=row[0], id=row[1], workspace=row[2], workflow=row[3], title=row[4], body=row[5],
        inputs=json.loads(row[6]), state=row[7], created_at_ms=row[8], updated_at_ms=row[9],
        principal=row[10], error=row[11], tokens_used=row[12], awaiting_sha=row[13],
        torn_down=bool(row[14]), origin=json.loads(row[15] or "{}"), reopened_at_ms=row[16] or 0,
    )


def _node(r: Sequence[Any]) -> NodeRunRecord:
    return NodeRunRecord(ticket_id=r[0], node_id=r[1], kind=r[2], state=r[3], needs=tuple(json.loads(r[4])),
                         attempt=r[5], started_at_ms=r[6], finished_at_ms=r[7], output=r[8], error=r[9],
                         rounds=r[10], feedback=r[11])


def _values(fields: dict[str, object], allowed: frozenset[str]) -> dict[str, object]:
    bad = set(fields) - allowed
    if bad:
        raise ValueError(f"not updatable: {sorted(bad)}")
    return {k: (bool(v) if k == "torn_down" else v) for k, v in fields.items()}


class Tickets(Repository):
    """Tickets and node runs."""

    def create(self, ticket: TicketRecord, nodes: list[NodeRunRecord],
               first_events: Sequence[EventRecord]) -> TicketRecord:
        """Insert the ticket, its pending node runs and its first events atomically."""
        try:
            with self.db.transaction(write=True) as conn:
                ticket.rowid = int(conn.execute(
                    sa.insert(tickets).values(
                        id=ticket.id, workspace=ticket.workspace, workflow=ticket.workflow, title=ticket.title,
                        body=ticket.body, inputs_json=json.dumps(ticket.inputs, sort_keys=True),
                        state=ticket.state, created_at_ms=ticket.created_at_ms,
                        updated_at_ms=ticket.updated_at_ms, principal=ticket.principal,
                        origin_json=json.dumps(ticket.origin, sort_keys=True))
                    .returning(_t.rowid)).scalar_one())
                if nodes:
                    conn.execute(sa.insert(node_runs), [
                        {"ticket_id": n.ticket_id, "node_id": n.node_id, "ord": i, "kind": n.kind,
                         "state": n.state, "needs_json": json.dumps(list(n.needs))}
                        for i, n in enumerate(nodes)])
                insert_events(conn, first_events)
        except sa.exc.IntegrityError:
            # Run again after a lost connection (retry.py): the first try may have committed.
            if not self.db.retry.retried:
                raise
            with self._read() as conn:
                rowid = conn.execute(sa.select(_t.rowid).where(_t.id == ticket.id)).scalar()
            if rowid is None:
                raise
            ticket.rowid = int(rowid)
        return ticket

    def get(self, ticket_id: str) -> TicketRecord | None:
        with self._read() as conn:
            row = conn.execute(sa.select(*_TICKET_COLS).where(_t.id == ticket_id)).first()
        return _ticket(row) if row else None

    def list(self, states: Sequence[str] | None = None, workspace: str | None = None,
             limit: int = 50, before_rowid: int | None = None) -> TicketList:
        """Newest first; `before_rowid` pages backwards."""
        q = sa.select(*_TICKET_COLS)
        if states:
            q = q.where(_t.state.in_(list(states)))
        if workspace:
            q = q.where(_t.workspace == workspace)
        if before_rowid is not None:
            q = q.where(_t.rowid < before_rowid)
        with self._read() as conn:
            rows = conn.execute(q.order_by(_t.rowid.desc()).limit(limit)).all()
        return [_ticket(r) for r in rows]

    def update(self, ticket_id: str, **fields: object) -> None:
        """Set `fields` (of TICKET_FIELDS). A ticket this scheduler holds is written only
        where owner and fence are still its own (R45), else `LeaseLost`, nothing written."""
        values = _values(fields, TICKET_FIELDS)
        if not values:
            return
        fence = self.leases.fenced(ticket_id)
        q = sa.update(tickets).where(_t.id == ticket_id).values(**values)
        if fence is not None:
            q = q.where(_t.owner == self.leases.owner, _t.fence == fence)
        with self.db.transaction(write=True) as conn:
            n = len(conn.execute(q.returning(_t.id)).all())
        if fence is not None and n != 1:
            self.leases.lose(ticket_id)
            raise LeaseLost(ticket_id)

    def in_states(self, states: Sequence[str] = LIVE) -> TicketList:
        """Tickets in `states`, oldest first (creation order)."""
        with self._read() as conn:
            rows = conn.execute(sa.select(*_TICKET_COLS).where(_t.state.in_(list(states)))
                                .order_by(_t.rowid)).all()
        return [_ticket(r) for r in rows]

    def terminal_not_torn_down(self) -> TicketList:
        with self._read() as conn:
            rows = conn.execute(sa.select(*_TICKET_COLS)
                                .where(_t.torn_down == sa.false(), _t.state.in_(sorted(TERMINAL)))
                                .order_by(_t.rowid)).all()
        return [_ticket(r) for r in rows]

    def count_by_state(self) -> dict[str, int]:
        """How many tickets are in each state (the `afe_tickets` gauge)."""
        with self._read() as conn:
            rows = conn.execute(sa.select(_t.state, sa.func.count()).group_by(_t.state)).all()
        return {state: int(n) for state, n in rows}

    # node runs
    def node_runs(self, ticket_id: str) -> NodeRunList:
        """The ticket's node runs in the workflow's order."""
        with self._read() as conn:
            rows = conn.execute(sa.select(*_NODE_COLS).where(_n.ticket_id == ticket_id).order_by(_n.ord)).all()
        return [_node(r) for r in rows]

    def update_node(self, ticket_id: str, node_id: str, **fields: object) -> None:
        """Set `fields` (of NODE_FIELDS) of one node run, fenced (R45)."""
        values = _values(fields, NODE_FIELDS)
        if not values:
            return
        with self._write(ticket_id) as conn:
            conn.execute(sa.update(node_runs).where(_n.ticket_id == ticket_id, _n.node_id == node_id)
                         .values(**values))
