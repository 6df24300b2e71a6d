"""Leases and fences (docs/SCALE.md, R37, R45): which scheduler drives a live
ticket, until when, and the check every write of a held ticket carries.

A live ticket is driven by the scheduler in `tickets.owner` until
`lease_until_ms` (the database's clock). `claim` takes a ticket that is free
(no owner, this owner, or an expired lease) and bumps `tickets.fence`; the
new fence is this scheduler's token for the ticket. The claim skips a row
another transaction holds (`FOR UPDATE SKIP LOCKED` on PostgreSQL; SQLite
has one writer at a time and leaves the clause out), so it never waits on
the owner's write.

Fencing: for a ticket this scheduler holds, every write runs `guard` in its
own transaction first: `SELECT ... FOR SHARE` of the ticket row where
owner and fence are this scheduler's (on SQLite the write transaction holds
the database's write lock, which does the same). A claim by another
scheduler, which updates that row, waits for the write to commit; a write
after the claim finds the new fence and raises `LeaseLost` with nothing
written: the transaction is rolled back, no event is renumbered in.

A lost lease keeps its entry, marked lost (`lose`, called by the engine when
its renewal or its own clock says so, or a failed `guard`): later writes of
the ticket fail at once, before any statement. Only
`release` (the ticket ended here) or `forget` (its task stopped) removes
it. Writes of a ticket this scheduler never claimed are not fenced (a new
ticket's creation, a request by a scheduler that does not own the ticket:
`request_cancel`, an approval), and never touch the owner's columns.

One scheduler on SQLite (`exclusive`): its claims take a ticket whatever
its owner and lease say (the previous process of the same store, before a
restart, is the only other owner there can have been); the same statements
run, so its writes are checked just the same.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .base import Lease, LeaseLost
from .database import Database, db_now_ms, local
from .schema import tickets

_t = tickets.c


class Leases:
    """This scheduler's leases of tickets and its fence of each."""

    def __init__(self, db: Database, owner: str = "", exclusive: bool = False) -> None:
        self.db = db
        self.owner = owner                   # this scheduler's id (the engine sets it)
        self.exclusive = exclusive           # one scheduler on this database (SQLite)
        self._held: dict[str, int] = {}      # ticket -> the fence this scheduler holds it with
        self._lost: dict[str, int] = {}      # ticket -> the fence it held when the lease was found lost

    @property
    def fences(self) -> Mapping[str, int]:
        """Ticket -> fence of the tickets this scheduler holds (not lost): the ones it renews."""
        return types.MappingProxyType(self._held)

    @property
    def lost(self) -> Mapping[str, int]:
        """Ticket -> fence of the leases found lost here and not forgotten yet: their writes fail."""
        return types.MappingProxyType(self._lost)

    # -- the fence check (inside a repository's write transaction) ---------------------

    def guard(self, conn: Connection, ticket_id: str) -> None:
        """Inside the caller's write transaction: this scheduler still holds `ticket_id`
        with its fence (the row stays share-locked until the transaction ends), or
        `LeaseLost` (the lease is marked lost here). A ticket it never claimed passes."""
        if ticket_id in self._lost:
            raise LeaseLost(ticket_id)
        fence = self._held.get(ticket_id)
        if fence is None:
            return
        row = conn.execute(
            sa.select(_t.fence).where(_t.id == ticket_id, _t.owner == self.owner, _t.fence == fence)
            .with_for_update(read=True)).first()
        if row is None:
            self._mark_lost(ticket_id)
            raise LeaseLost(ticket_id)

    @local
    def fenced(self, ticket_id: str) -> int | None:
        """The fence a write of `ticket_id` must find (None: not held here, unfenced);
        `LeaseLost` at once when the lease was lost."""
        if ticket_id in self._lost:
            raise LeaseLost(ticket_id)
        return self._held.get(ticket_id)

    def _mark_lost(self, ticket_id: str) -> None:
        fence = self._held.pop(ticket_id, None)
        if fence is not None or ticket_id not in self._lost:
            self._lost[ticket_id] = fence or 0

    # -- local bookkeeping (no statement) ----------------------------------------------

    @local
    def lose(self, ticket_id: str) -> None:
        """This scheduler no longer holds the ticket (taken over, or its own clock says
        the lease may have ended): its writes fail from now on; the entry stays until
        `forget` or `release`."""
        self._mark_lost(ticket_id)

    @local
    def forget(self, ticket_id: str) -> None:
        """Drop the entry of a lost ticket whose task has stopped here (nothing of it
        writes any more). A held ticket is not forgotten: release it instead."""
        self._lost.pop(ticket_id, None)

    # -- statements ---------------------------------------------------------------------

    def claim(self, ticket_id: str, states: tuple[str, ...], lease_ms: int) -> int | None:
        """Take the ticket when it is in one of `states` and free (no owner, this owner,
        or an expired lease on the database's clock): returns the new fence, None when
        it is not free (or another transaction holds its row)."""
        now = db_now_ms()
        free = (sa.select(_t.id)
                .where(_t.id == ticket_id, _t.state.in_(states),
                       sa.or_(sa.literal(self.exclusive), _t.owner == "", _t.owner == self.owner,
                              _t.lease_until_ms < now))
                .with_for_update(skip_locked=True)
                .scalar_subquery())
        with self.db.transaction(write=True) as conn:
            row = conn.execute(
                sa.update(tickets).where(_t.id == free)
                .values(owner=self.owner, fence=_t.fence + 1, lease_until_ms=now + lease_ms)
                .returning(_t.fence)).first()
        if row is None:
            return None
        fence = int(row[0])
        self._lost.pop(ticket_id, None)
        self._held[ticket_id] = fence
        return fence

    def expired(self, states: tuple[str, ...], limit: int = 100) -> list[str]:
        """Tickets in `states` another scheduler's lease of which has expired (it died), oldest first."""
        with self.db.transaction() as conn:
            rows = conn.execute(
                sa.select(_t.id).where(_t.state.in_(states), _t.owner != self.owner,
                                       _t.lease_until_ms < db_now_ms())
                .order_by(_t.rowid).limit(limit)).all()
        return [r[0] for r in rows]

    def renew(self, ticket_ids: list[str], lease_ms: int) -> list[Lease]:
        """Extend this owner's leases of `ticket_ids` (the held ones: a lost lease is never
        renewed); returns the ones it still holds with their fence, state and cancel request."""
        ids = [tid for tid in ticket_ids if tid in self._held]
        if not ids:
            return []
        with self.db.transaction(write=True) as conn:
            rows = conn.execute(
                sa.update(tickets).where(_t.owner == self.owner, _t.id.in_(ids))
                .values(lease_until_ms=db_now_ms() + lease_ms)
                .returning(_t.id, _t.fence, _t.state, _t.cancel_by)).all()
        return [Lease(r[0], int(r[1]), r[2], r[3]) for r in rows if self._held.get(r[0]) == int(r[1])]

    def holds(self, ticket_id: str, fence: int) -> bool:
        """This owner holds the ticket with `fence` and its lease has not expired (the database's clock)."""
        with self.db.transaction() as conn:
            row = conn.execute(
                sa.select(_t.id).where(_t.id == ticket_id, _t.owner == self.owner, _t.fence == fence,
                                       _t.lease_until_ms >= db_now_ms())).first()
        return row is not None

    def release(self, ticket_id: str) -> None:
        """Give up the ticket (it ended here, or this scheduler stops): another may claim it
        at once. Its entry, held or lost, goes."""
        self._lost.pop(ticket_id, None)
        fence = self._held.pop(ticket_id, None)
        if fence is None:
            return
        with self.db.transaction(write=True) as conn:
            conn.execute(sa.update(tickets)
                         .where(_t.id == ticket_id, _t.owner == self.owner, _t.fence == fence)
                         .values(owner="", lease_until_ms=0, cancel_by=""))

    def request_cancel(self, ticket_id: str, principal: str) -> None:
        """Ask the ticket's owner to cancel it (its heartbeat sees the request): a request
        from a scheduler that does not drive it, so not fenced; it sets only cancel_by."""
        with self.db.transaction(write=True) as conn:
            conn.execute(sa.update(tickets).where(_t.id == ticket_id, _t.cancel_by == "")
                         .values(cancel_by=principal or "unknown"))
