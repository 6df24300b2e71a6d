"""Follow-ups: instructions for a re-opened ticket's model and agent nodes
(`afe ticket followup`, a review on its pull request, a CI round;
engine/followups.py). A follow-up is `pending` when received (waiting for
the ticket's next re-open), `given` to the re-run that started at its
`at_ms`, or `dropped` when that re-open was refused for good. Untrusted
text (a source other than "operator") is quoted in the prompt (R36).

`add_followup` is a request (any scheduler may receive the review or the
command): it adds a row, unfenced. Giving and dropping change the pending
rows of the ticket's owner: fenced (R37, R45), and each is one UPDATE, so a
follow-up is given to one re-run or dropped, never both, also with several
schedulers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, Connection, func, insert, select, update

from .. import schema
from ..base import FOLLOWUP_DROPPED, FOLLOWUP_GIVEN, FOLLOWUP_PENDING, FollowUpRecord
from ..ci_records import CI_SOURCE
from .base import FencedRepository

_F = schema.ticket_followups
_COLS = (_F.c.ticket_id, _F.c.at_ms, _F.c.author, _F.c.source, _F.c.text, _F.c.path, _F.c.line, _F.c.url,
         _F.c.state)


def _record(row: Sequence[Any]) -> FollowUpRecord:
    return FollowUpRecord(*row)


class FollowUps(FencedRepository):
    def add_followup(self, rec: FollowUpRecord) -> None:
        """Store `rec` in its `state` (given, or pending for the ticket's next re-open)."""
        with self._tx() as conn:
            conn.execute(insert(_F).values(
                ticket_id=rec.ticket_id, at_ms=rec.at_ms, author=rec.author, source=rec.source, text=rec.text,
                path=rec.path, line=rec.line, url=rec.url, state=rec.state))

    def followups(self, ticket_id: str, since_ms: int) -> list[FollowUpRecord]:
        """The ticket's follow-ups given to a re-run at or after `since_ms`, oldest first."""
        return self._select(_F.c.ticket_id == ticket_id, _F.c.at_ms >= since_ms, _F.c.state == FOLLOWUP_GIVEN)

    def pending_followups(self, ticket_id: str) -> list[FollowUpRecord]:
        """The ticket's follow-ups waiting for its next re-open, oldest first."""
        return self._select(_F.c.ticket_id == ticket_id, _F.c.state == FOLLOWUP_PENDING)

    def _select(self, *where: ColumnElement[bool]) -> list[FollowUpRecord]:
        with self._read() as conn:
            rows = conn.execute(select(*_COLS).where(*where).order_by(_F.c.id)).all()
        return [_record(r) for r in rows]

    def give_followups(self, ticket_id: str, at_ms: int) -> int:
        """Give every pending follow-up of the ticket to the re-run that started at `at_ms`
        (state given, at_ms); returns how many."""
        with self._tx() as conn:
            self._check(conn, ticket_id)
            res = conn.execute(update(_F).where(_F.c.ticket_id == ticket_id, _F.c.state == FOLLOWUP_PENDING)
                               .values(state=FOLLOWUP_GIVEN, at_ms=at_ms))
        return max(0, res.rowcount)

    def drop_followups(self, ticket_id: str) -> list[FollowUpRecord]:
        """Mark the ticket's pending follow-ups dropped (it cannot be re-opened any more);
        returns the ones this call dropped, oldest first."""
        with self._tx() as conn:
            self._check(conn, ticket_id)
            return self._drop(conn, _F.c.ticket_id == ticket_id, _F.c.state == FOLLOWUP_PENDING)

    def drop_ci_followups(self, ticket_id: str, sha: str) -> int:
        """Mark the ticket's pending CI-round follow-ups about the failed head `sha` (their text
        starts with github/ci.py followup_text's first line) dropped; how many this call dropped."""
        first_line = f"CI failed on commit {sha}:"
        # A prefix compared as text, not LIKE: SQLite's LIKE ignores ASCII case, PostgreSQL's does not.
        about_sha = func.substr(_F.c.text, 1, len(first_line)) == first_line
        with self._tx() as conn:
            self._check(conn, ticket_id)
            return len(self._drop(conn, _F.c.ticket_id == ticket_id, _F.c.state == FOLLOWUP_PENDING,
                                  _F.c.source == CI_SOURCE, about_sha))

    @staticmethod
    def _drop(conn: Connection, *where: ColumnElement[bool]) -> list[FollowUpRecord]:
        rows = conn.execute(update(_F).where(*where).values(state=FOLLOWUP_DROPPED)
                            .returning(_F.c.id, *_COLS)).all()
        return [_record(r[1:]) for r in sorted(rows, key=lambda r: r[0])]

    def tickets_with_pending_followups(self) -> list[str]:
        """Tickets that have follow-ups waiting (after a restart: their re-open is still owed),
        in the order their first one came."""
        first = func.min(_F.c.id)
        with self._read() as conn:
            rows = conn.execute(select(_F.c.ticket_id, first).where(_F.c.state == FOLLOWUP_PENDING)
                                .group_by(_F.c.ticket_id).order_by(first)).all()
        return [r[0] for r in rows]
