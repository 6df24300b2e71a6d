"""Clean-room verifications of heads (R41, executor/nodes/verification.py),
kept in the store's `verifications` table (migration 0009): one row per
(ticket, head), whose `result` is the `verification.finished` event's
payload (the run record, R42, reads it from there). `Store` inherits these
methods; both back ends run the same SQL (PostgreSQL's `%s` becomes
SQLite's `?`), under the store's retry wrapper (store_retry.py): a row is
written once (INSERT ... ON CONFLICT DO NOTHING), so a retried or repeated
write keeps the first result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .either import EitherBackend


@dataclass
class VerificationRecord:
    ticket_id: str
    sha: str
    passed: bool
    at_ms: int
    result: dict[str, Any] = field(default_factory=dict)


class VerificationRecords(EitherBackend):
    """The `verifications` methods of `Store` (SQLite and PostgreSQL)."""

    def put_verification(self, ticket_id: str, sha: str, passed: bool, result: dict[str, Any],
                         at_ms: int) -> VerificationRecord:
        """Store the verification of (ticket, head) unless one is stored; returns the stored one."""
        self._sql("INSERT INTO verifications (ticket_id, sha, passed, result, at_ms) VALUES (%s,%s,%s,%s,%s) "
                  "ON CONFLICT (ticket_id, sha) DO NOTHING",
                  (ticket_id, sha, 1 if passed else 0, json.dumps(result, sort_keys=True), at_ms))
        row = self.verification(ticket_id, sha)
        assert row is not None
        return row

    def verification(self, ticket_id: str, sha: str) -> VerificationRecord | None:
        row = self._sql("SELECT ticket_id, sha, passed, result, at_ms FROM verifications "
                        "WHERE ticket_id=%s AND sha=%s", (ticket_id, sha)).fetchone()
        return _record(row) if row else None

    def verifications(self, ticket_id: str) -> list[VerificationRecord]:
        rows = self._sql("SELECT ticket_id, sha, passed, result, at_ms FROM verifications WHERE ticket_id=%s "
                         "ORDER BY at_ms, sha", (ticket_id,)).fetchall()
        return [_record(r) for r in rows]


def _record(row: Any) -> VerificationRecord:
    try:
        result = json.loads(row[3] or "{}")
    except ValueError:
        result = {}
    return VerificationRecord(row[0], row[1], bool(row[2]), int(row[4]),
                              result if isinstance(result, dict) else {})
