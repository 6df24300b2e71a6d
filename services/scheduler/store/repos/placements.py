"""Which sandbox broker holds the sandbox of a ticket, or of a warm
sandbox's reserved id (sandboxes/placement.py, docs/SCALE.md): recorded
before the sandbox is created, so every later call of the ticket, also after
a restart or a takeover, goes to the same broker.

Placing and unplacing change the owner's ticket data: fenced (R37, R45) by
the id placed. A warm sandbox's reserved id is no ticket; the fence check
lets through ids this scheduler never claimed (the leases repository's
rule), so warm sandboxes are placed as before.
"""

from __future__ import annotations

from sqlalchemy import delete, select

from .. import schema
from .base import FencedRepository, insert_for

_S = schema.sandbox_placements


class SandboxPlacements(FencedRepository):
    def place_sandbox(self, ticket_id: str, broker: str, at_ms: int) -> None:
        """Record that the sandbox of `ticket_id` is on `broker`."""
        with self._tx() as conn:
            self._check(conn, ticket_id)
            ins = insert_for(conn, _S).values(ticket_id=ticket_id, broker=broker, at_ms=at_ms)
            conn.execute(ins.on_conflict_do_update(
                index_elements=[_S.c.ticket_id], set_={"broker": ins.excluded.broker, "at_ms": ins.excluded.at_ms}))

    def sandbox_placement(self, ticket_id: str) -> str | None:
        """The broker `place_sandbox` recorded for the id, None when none is."""
        with self._read() as conn:
            row = conn.execute(select(_S.c.broker).where(_S.c.ticket_id == ticket_id)).first()
        return row[0] if row else None

    def unplace_sandbox(self, ticket_id: str) -> None:
        with self._tx() as conn:
            self._check(conn, ticket_id)
            conn.execute(delete(_S).where(_S.c.ticket_id == ticket_id))
