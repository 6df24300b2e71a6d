"""A person's decision on a ticket's head (`afe approve` / `afe reject`,
engine/approvals.py): one row per decision, the latest one counts.

A request from outside the ticket's owner (any scheduler's API may take it;
the owner reads it on its heartbeat): written without a fence check, and it
adds a row, never changes one the owner wrote.
"""

from __future__ import annotations

import json

from sqlalchemy import insert, select

from .. import schema
from ..base import ApprovalRecord, str_list
from .base import Repository

_A = schema.approvals
_COLS = (_A.c.ticket_id, _A.c.principal, _A.c.sha, _A.c.granted, _A.c.at_ms, _A.c.reason, _A.c.accepted_harness)


class Approvals(Repository):
    def add_approval(self, approval: ApprovalRecord) -> None:
        with self._tx() as conn:
            conn.execute(insert(_A).values(
                ticket_id=approval.ticket_id, principal=approval.principal, sha=approval.sha,
                granted=bool(approval.granted), at_ms=approval.at_ms, reason=approval.reason,
                accepted_harness=json.dumps(approval.accepted_harness_change)))

    def latest_approval(self, ticket_id: str) -> ApprovalRecord | None:
        with self._read() as conn:
            row = conn.execute(select(*_COLS).where(_A.c.ticket_id == ticket_id)
                               .order_by(_A.c.id.desc()).limit(1)).first()
        if row is None:
            return None
        return ApprovalRecord(ticket_id=row[0], principal=row[1], sha=row[2], granted=bool(row[3]),
                              at_ms=row[4], reason=row[5], accepted_harness_change=str_list(row[6]))
