"""Failing CI on afe's pull requests (docs/GITHUB.md "Failing CI",
github/ci.py): one row per (ticket, head), so a failure GitHub reports by
several deliveries (a check_run per check, the check_suite, a commit
status), or that polling sees again, is one round; and the pull requests
whose heads CI polling looks at.

A row's `checks` document: {"claim": token, "state": gathering | round |
over | quiet, "round": k, "checks": [...]} (ci_records.py names the states).
Claiming and updating a row record the ticket's CI rounds: fenced (R37,
R45). Each is safe to run again: a claim is an INSERT ... ON CONFLICT DO
NOTHING carrying the claimer's token, and the read after it, in the same
transaction, says whose row it is.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Connection, Row, select, update

from .. import schema
from ..ci_records import GATHERING, CiFailureRecord, CiWatch
from .base import FencedRepository, insert_for

_CI, _T, _P = schema.ci_failures, schema.tickets, schema.pull_requests
_COLS = (_CI.c.ticket_id, _CI.c.sha, _CI.c.at_ms, _CI.c.checks)


def _record(row: Row[Any]) -> CiFailureRecord:
    try:
        doc = json.loads(row[3] or "{}")
    except ValueError:
        doc = {}
    return CiFailureRecord(row[0], row[1], row[2], doc if isinstance(doc, dict) else {})


class CiFailures(FencedRepository):
    def claim_ci_failure(self, ticket_id: str, sha: str, token: str, at_ms: int) -> bool:
        """Take (ticket, head) for one round: True for the one caller whose token the row carries."""
        doc = json.dumps({"claim": token, "state": GATHERING, "checks": []})
        with self._tx() as conn:
            self._check(conn, ticket_id)
            conn.execute(insert_for(conn, _CI).values(ticket_id=ticket_id, sha=sha, checks=doc, at_ms=at_ms)
                         .on_conflict_do_nothing(index_elements=[_CI.c.ticket_id, _CI.c.sha]))
            row = self._get(conn, ticket_id, sha)
        return row is not None and row.doc.get("claim") == token

    def put_ci_failure(self, ticket_id: str, sha: str, doc: dict[str, Any]) -> None:
        with self._tx() as conn:
            self._check(conn, ticket_id)
            conn.execute(update(_CI).where(_CI.c.ticket_id == ticket_id, _CI.c.sha == sha)
                         .values(checks=json.dumps(doc)))

    def ci_failure(self, ticket_id: str, sha: str) -> CiFailureRecord | None:
        with self._read() as conn:
            return self._get(conn, ticket_id, sha)

    @staticmethod
    def _get(conn: Connection, ticket_id: str, sha: str) -> CiFailureRecord | None:
        row = conn.execute(select(*_COLS).where(_CI.c.ticket_id == ticket_id, _CI.c.sha == sha)).first()
        return _record(row) if row else None

    def ci_failures(self, ticket_id: str) -> list[CiFailureRecord]:
        with self._read() as conn:
            rows = conn.execute(select(*_COLS).where(_CI.c.ticket_id == ticket_id)
                                .order_by(_CI.c.at_ms, _CI.c.sha)).all()
        return [_record(r) for r in rows]

    def ci_gathering(self) -> list[CiFailureRecord]:
        """Rows a stopped scheduler left in their settle window (resumed at start), oldest first."""
        with self._read() as conn:
            rows = conn.execute(select(*_COLS).where(_CI.c.checks.like(f'%"state": "{GATHERING}"%'))
                                .order_by(_CI.c.at_ms)).all()
        return [r for r in (_record(row) for row in rows) if r.state == GATHERING]

    def ci_watch(self, states: tuple[str, ...], since_ms: int) -> list[CiWatch]:
        """Tickets in `states` changed since `since_ms` whose pull request is not merged, by id."""
        stmt = (select(_T.c.id, _T.c.workspace, _T.c.workflow, _P.c.number, _P.c.head_sha)
                .join(_P, _P.c.ticket_id == _T.c.id)
                .where(_T.c.state.in_(states), _T.c.updated_at_ms >= since_ms, _P.c.state != "merged",
                       _P.c.head_sha != "")
                .order_by(_T.c.id))
        with self._read() as conn:
            rows = conn.execute(stmt).all()
        return [CiWatch(*r) for r in rows]
