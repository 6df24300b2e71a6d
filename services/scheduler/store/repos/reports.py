"""What afe last reported on GitHub per ticket and step (started, final,
status, ...): the comment it wrote and a digest of what it said, so a report
is edited rather than posted again, also after a crash (github/report.py).

`put_report` records a side effect of the ticket's owner: fenced (R37, R45).
"""

from __future__ import annotations

from sqlalchemy import select

from .. import schema
from .base import FencedRepository, insert_for

_R = schema.github_reports


class Reports(FencedRepository):
    def report(self, ticket_id: str, step: str) -> tuple[str, str] | None:
        """(comment id, digest) of the report `step` of the ticket, as last recorded."""
        with self._read() as conn:
            row = conn.execute(select(_R.c.comment_id, _R.c.digest)
                               .where(_R.c.ticket_id == ticket_id, _R.c.step == step)).first()
        return (row[0], row[1]) if row else None

    def put_report(self, ticket_id: str, step: str, comment_id: str, digest: str, at_ms: int) -> None:
        with self._tx() as conn:
            self._check(conn, ticket_id)
            ins = insert_for(conn, _R).values(ticket_id=ticket_id, step=step, comment_id=comment_id,
                                              digest=digest, at_ms=at_ms)
            conn.execute(ins.on_conflict_do_update(
                index_elements=[_R.c.ticket_id, _R.c.step],
                set_={"comment_id": ins.excluded.comment_id, "digest": ins.excluded.digest,
                      "at_ms": ins.excluded.at_ms}))
