"""Clean-room verifications (R41, executor/nodes/verification.py): one row
per (ticket, commit, base tip, verify: configuration, kind), whose `result`
is the `verification.finished` event's payload. kind 'head' is a ticket's
head merged onto the base tip; kind 'base' is the base tip's own run of the
same commands, whose test counts a head must not fall below.

A row is written once (INSERT ... ON CONFLICT DO NOTHING), so a retried or
repeated write keeps the first result; writing one records a verdict of the
ticket's owner: fenced (R37, R45). A verification that could not run (a
dead sandbox, a missing image) is never stored: it is no verdict.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Connection, Row, select

from .. import schema
from ..verification_records import HEAD, VerificationRecord
from .base import FencedRepository, insert_for

_V = schema.verification_runs
_COLS = (_V.c.ticket_id, _V.c.sha, _V.c.passed, _V.c.result, _V.c.at_ms, _V.c.base_sha, _V.c.config, _V.c.kind)


def _record(row: Row[Any]) -> VerificationRecord:
    try:
        result = json.loads(row[3] or "{}")
    except ValueError:
        result = {}
    return VerificationRecord(row[0], row[1], bool(row[2]), int(row[4]),
                              result if isinstance(result, dict) else {}, row[5], row[6], row[7])


class Verifications(FencedRepository):
    def put_verification(self, ticket_id: str, sha: str, passed: bool, result: dict[str, Any], at_ms: int, *,
                         base_sha: str = "", config: str = "", kind: str = HEAD) -> VerificationRecord:
        """Store the verification of (ticket, commit, base, config, kind) unless one is stored;
        returns the stored one."""
        with self._tx() as conn:
            self._check(conn, ticket_id)
            conn.execute(insert_for(conn, _V).values(
                ticket_id=ticket_id, sha=sha, base_sha=base_sha, config=config, kind=kind, passed=1 if passed else 0,
                result=json.dumps(result, sort_keys=True), at_ms=at_ms,
            ).on_conflict_do_nothing(index_elements=[_V.c.ticket_id, _V.c.sha, _V.c.base_sha, _V.c.config,
                                                     _V.c.kind]))
            row = self._with(conn, ticket_id, sha, base_sha, config, kind)
        if row is None:     # the primary key's row cannot go away inside the transaction that wrote it
            raise RuntimeError(f"the verification of {sha} of ticket {ticket_id} was not stored")
        return row

    def verification_with(self, ticket_id: str, sha: str, base_sha: str, config: str,
                          kind: str = HEAD) -> VerificationRecord | None:
        """The verification of `sha` on exactly that base tip and configuration."""
        with self._read() as conn:
            return self._with(conn, ticket_id, sha, base_sha, config, kind)

    @staticmethod
    def _with(conn: Connection, ticket_id: str, sha: str, base_sha: str, config: str,
              kind: str) -> VerificationRecord | None:
        row = conn.execute(select(*_COLS).where(_V.c.ticket_id == ticket_id, _V.c.sha == sha,
                                                _V.c.base_sha == base_sha, _V.c.config == config,
                                                _V.c.kind == kind)).first()
        return _record(row) if row else None

    def verification(self, ticket_id: str, sha: str) -> VerificationRecord | None:
        """The latest verification of the head `sha` (whatever base and configuration)."""
        with self._read() as conn:
            row = conn.execute(select(*_COLS).where(_V.c.ticket_id == ticket_id, _V.c.sha == sha, _V.c.kind == HEAD)
                               .order_by(_V.c.at_ms.desc(), _V.c.base_sha.desc()).limit(1)).first()
        return _record(row) if row else None

    def verifications(self, ticket_id: str) -> list[VerificationRecord]:
        """The ticket's head verifications, oldest first."""
        with self._read() as conn:
            rows = conn.execute(select(*_COLS).where(_V.c.ticket_id == ticket_id, _V.c.kind == HEAD)
                                .order_by(_V.c.at_ms, _V.c.sha)).all()
        return [_record(r) for r in rows]
