"""The pull request afe opened for a ticket (one row per ticket, written by
the ticket's owner: builtin:pr, builtin:merge, a re-open) and the lookups
GitHub events need: which ticket a pull request number or a head commit
belongs to.

`put_pr` changes the owner's ticket data: fenced (R37, R45).
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, select

from .. import schema
from ..base import PullRequestRecord
from .base import FencedRepository, insert_for

_P, _T = schema.pull_requests, schema.tickets
_COLS = (_P.c.ticket_id, _P.c.number, _P.c.url, _P.c.head_branch, _P.c.base_branch, _P.c.head_sha,
         _P.c.state, _P.c.merge_sha)
_UPDATED = ("number", "url", "head_branch", "base_branch", "head_sha", "state", "merge_sha")


class PullRequests(FencedRepository):
    def put_pr(self, pr: PullRequestRecord) -> None:
        with self._tx() as conn:
            self._check(conn, pr.ticket_id)
            ins = insert_for(conn, _P).values(
                ticket_id=pr.ticket_id, number=pr.number, url=pr.url, head_branch=pr.head_branch,
                base_branch=pr.base_branch, head_sha=pr.head_sha, state=pr.state, merge_sha=pr.merge_sha)
            conn.execute(ins.on_conflict_do_update(index_elements=[_P.c.ticket_id],
                                                   set_={k: ins.excluded[k] for k in _UPDATED}))

    def get_pr(self, ticket_id: str) -> PullRequestRecord | None:
        with self._read() as conn:
            row = conn.execute(select(*_COLS).where(_P.c.ticket_id == ticket_id)).first()
        return PullRequestRecord(*row) if row else None

    def ticket_for_pr(self, workspace: str, number: str) -> str | None:
        """The ticket whose pull request in `workspace` is `number` (the newest ticket, should
        two name it), if afe opened it."""
        return self._ticket_where(workspace, _P.c.number == number)

    def ticket_for_head(self, workspace: str, sha: str) -> str | None:
        """The ticket whose pull request in `workspace` has head `sha` now, if afe opened it."""
        return self._ticket_where(workspace, _P.c.head_sha == sha)

    def _ticket_where(self, workspace: str, cond: ColumnElement[bool]) -> str | None:
        stmt = (select(_P.c.ticket_id).join(_T, _T.c.id == _P.c.ticket_id)
                .where(_T.c.workspace == workspace, cond).order_by(_T.c.created_at_ms.desc()).limit(1))
        with self._read() as conn:
            row = conn.execute(stmt).first()
        return row[0] if row else None
