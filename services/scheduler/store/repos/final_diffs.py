"""A ticket's last diff against its base, taken by its owner before the
workspace is released, so `afe ticket show --diff` and the UI show it after
the ticket ended (one row per ticket, replaced by a later one).

`put_final_diff` changes the owner's ticket data: fenced (R37, R45).
"""

from __future__ import annotations

from sqlalchemy import select

from .. import schema
from .base import FencedRepository, insert_for

_D = schema.ticket_diffs


class FinalDiffs(FencedRepository):
    def put_final_diff(self, ticket_id: str, diff: str, truncated: bool, at_ms: int) -> None:
        with self._tx() as conn:
            self._check(conn, ticket_id)
            ins = insert_for(conn, _D).values(ticket_id=ticket_id, diff=diff, truncated=bool(truncated),
                                              at_ms=at_ms)
            conn.execute(ins.on_conflict_do_update(
                index_elements=[_D.c.ticket_id],
                set_={"diff": ins.excluded.diff, "truncated": ins.excluded.truncated, "at_ms": ins.excluded.at_ms}))

    def final_diff(self, ticket_id: str) -> tuple[str, bool] | None:
        """(diff, truncated) as stored by `put_final_diff`, or None."""
        with self._read() as conn:
            row = conn.execute(select(_D.c.diff, _D.c.truncated).where(_D.c.ticket_id == ticket_id)).first()
        return (row[0], bool(row[1])) if row else None
