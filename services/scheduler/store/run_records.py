"""The signed run records of a ticket's heads (R42, docs/GUIDE.md "The run
record"), kept in the store's `run_records` table (migration 0009): one DSSE
envelope per (ticket, head, kind), kind `request` (signed when the approval
of the head is asked) or `decision` (signed again with the person's
decision). `Store` inherits these methods; both back ends run the same SQL
(PostgreSQL's `%s` becomes SQLite's `?`) under the store's retry wrapper
(store_retry.py). `put_run_record` keeps the first envelope of a key (a
resumed ticket that signed again keeps what was attached first).
"""

from __future__ import annotations

from dataclasses import dataclass

from .either import EitherBackend

REQUEST, DECISION = "request", "decision"


@dataclass(frozen=True)
class RunRecord:
    ticket_id: str
    sha: str
    kind: str
    envelope: str
    at_ms: int


class RunRecords(EitherBackend):
    """The `run_records` methods of `Store` (SQLite and PostgreSQL)."""

    def put_run_record(self, rec: RunRecord) -> RunRecord:
        """Store `rec` unless (ticket, sha, kind) has one; returns the stored one."""
        self._sql("INSERT INTO run_records (ticket_id, sha, kind, envelope, at_ms) VALUES (%s,%s,%s,%s,%s) "
                  "ON CONFLICT (ticket_id, sha, kind) DO NOTHING",
                  (rec.ticket_id, rec.sha, rec.kind, rec.envelope, rec.at_ms))
        return self.run_record(rec.ticket_id, rec.sha, rec.kind) or rec

    def run_record(self, ticket_id: str, sha: str, kind: str) -> RunRecord | None:
        row = self._sql("SELECT ticket_id, sha, kind, envelope, at_ms FROM run_records WHERE ticket_id=%s AND "
                        "sha=%s AND kind=%s", (ticket_id, sha, kind)).fetchone()
        return RunRecord(*row) if row else None

    def run_records(self, ticket_id: str) -> list[RunRecord]:
        """The ticket's records, oldest first (a request before its decision)."""
        rows = self._sql("SELECT ticket_id, sha, kind, envelope, at_ms FROM run_records WHERE ticket_id=%s "
                         "ORDER BY at_ms, kind DESC", (ticket_id,)).fetchall()
        return [RunRecord(*r) for r in rows]
