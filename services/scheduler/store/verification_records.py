"""Clean-room verifications (R41, executor/nodes/verification.py), kept in
the store's `verification_runs` table (migration 0010): one row per
(ticket, commit, base tip, verify: configuration, kind), whose `result` is
the `verification.finished` event's payload (the run record, R42, reads it
from there). kind 'head' is a ticket's head merged onto the base tip; kind
'base' is the base tip's own run of the same commands, whose test counts a
head must not fall below. `Store` inherits these methods; both back ends
run the same SQL (PostgreSQL's `%s` becomes SQLite's `?`), under the store's
retry wrapper (store_retry.py): a row is written once (INSERT ... ON
CONFLICT DO NOTHING), so a retried or repeated write keeps the first result.

A verification that could not run (a dead sandbox, a missing image) is
never stored: it is no verdict on the head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .either import EitherBackend

HEAD, BASE = "head", "base"
_COLUMNS = "ticket_id, sha, passed, result, at_ms, base_sha, config, kind"


@dataclass
class VerificationRecord:
    ticket_id: str
    sha: str
    passed: bool
    at_ms: int
    result: dict[str, Any] = field(default_factory=dict)
    base_sha: str = ""
    config: str = ""
    kind: str = HEAD


class VerificationRecords(EitherBackend):
    """The `verification_runs` methods of `Store` (SQLite and PostgreSQL)."""

    def put_verification(self, ticket_id: str, sha: str, passed: bool, result: dict[str, Any], at_ms: int, *,
                         base_sha: str = "", config: str = "", kind: str = HEAD) -> VerificationRecord:
        """Store the verification of (ticket, commit, base, config, kind) unless one is stored;
        returns the stored one."""
        self._sql("INSERT INTO verification_runs (ticket_id, sha, base_sha, config, kind, passed, result, at_ms) "
                  "VALUES (%s,%s,%s,%s,%s,%s,%s,%s) ON CONFLICT (ticket_id, sha, base_sha, config, kind) DO NOTHING",
                  (ticket_id, sha, base_sha, config, kind, 1 if passed else 0,
                   json.dumps(result, sort_keys=True), at_ms))
        row = self.verification_with(ticket_id, sha, base_sha, config, kind)
        assert row is not None
        return row

    def verification_with(self, ticket_id: str, sha: str, base_sha: str, config: str,
                          kind: str = HEAD) -> VerificationRecord | None:
        """The verification of `sha` on exactly that base tip and configuration."""
        row = self._sql(f"SELECT {_COLUMNS} FROM verification_runs WHERE ticket_id=%s AND sha=%s AND base_sha=%s "
                        "AND config=%s AND kind=%s", (ticket_id, sha, base_sha, config, kind)).fetchone()
        return _record(row) if row else None

    def verification(self, ticket_id: str, sha: str) -> VerificationRecord | None:
        """The latest verification of the head `sha` (whatever base and configuration)."""
        row = self._sql(f"SELECT {_COLUMNS} FROM verification_runs WHERE ticket_id=%s AND sha=%s AND kind=%s "
                        "ORDER BY at_ms DESC, base_sha DESC LIMIT 1", (ticket_id, sha, HEAD)).fetchone()
        return _record(row) if row else None

    def verifications(self, ticket_id: str) -> list[VerificationRecord]:
        """The ticket's head verifications, oldest first."""
        rows = self._sql(f"SELECT {_COLUMNS} FROM verification_runs WHERE ticket_id=%s AND kind=%s "
                         "ORDER BY at_ms, sha", (ticket_id, HEAD)).fetchall()
        return [_record(r) for r in rows]


def _record(row: Any) -> VerificationRecord:
    try:
        result = json.loads(row[3] or "{}")
    except ValueError:
        result = {}
    return VerificationRecord(row[0], row[1], bool(row[2]), int(row[4]),
                              result if isinstance(result, dict) else {}, row[5], row[6], row[7])
