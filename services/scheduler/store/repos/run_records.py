"""The signed run records of a ticket's heads (R42, docs/GUIDE.md "The run
record"): one DSSE envelope per (ticket, head, kind), kind `request` (signed
when the approval of the head is asked) or `decision` (signed again with the
person's decision). The first envelope of a key is kept (a resumed ticket
that signed again keeps what was attached first). Writing one records a side
effect of the ticket's owner: fenced (R37, R45).
"""

from __future__ import annotations

from sqlalchemy import Connection, select

from .. import schema
from ..run_records import RunRecord
from .base import FencedRepository, insert_for

_R = schema.run_records
_COLS = (_R.c.ticket_id, _R.c.sha, _R.c.kind, _R.c.envelope, _R.c.at_ms)


class RunRecords(FencedRepository):
    def put_run_record(self, rec: RunRecord) -> RunRecord:
        """Store `rec` unless (ticket, sha, kind) has one; returns the stored one."""
        with self._tx() as conn:
            self._check(conn, rec.ticket_id)
            conn.execute(insert_for(conn, _R).values(ticket_id=rec.ticket_id, sha=rec.sha, kind=rec.kind,
                                                     envelope=rec.envelope, at_ms=rec.at_ms)
                         .on_conflict_do_nothing(index_elements=[_R.c.ticket_id, _R.c.sha, _R.c.kind]))
            return self._get(conn, rec.ticket_id, rec.sha, rec.kind) or rec

    def run_record(self, ticket_id: str, sha: str, kind: str) -> RunRecord | None:
        with self._read() as conn:
            return self._get(conn, ticket_id, sha, kind)

    @staticmethod
    def _get(conn: Connection, ticket_id: str, sha: str, kind: str) -> RunRecord | None:
        row = conn.execute(select(*_COLS).where(_R.c.ticket_id == ticket_id, _R.c.sha == sha,
                                                _R.c.kind == kind)).first()
        return RunRecord(*row) if row else None

    def run_records(self, ticket_id: str) -> list[RunRecord]:
        """The ticket's records, oldest first (a request before its decision)."""
        with self._read() as conn:
            rows = conn.execute(select(*_COLS).where(_R.c.ticket_id == ticket_id)
                                .order_by(_R.c.at_ms, _R.c.kind.desc())).all()
        return [RunRecord(*r) for r in rows]
