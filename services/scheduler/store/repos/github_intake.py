"""The GitHub intake's own bookkeeping (github/intake.py, github/poll.py,
docs/GITHUB.md): keys that take effect once, where each workspace's polling
stands, and the claim of a piece of work (repository, issue, Trigger) on its
one live ticket.

These rows belong to no ticket's owner: a webhook reaches any scheduler,
the poller runs on one. They are written unfenced, with one exception:
a once-key that guards a step of a ticket (`claim_once(..., ticket_id=)`)
is a side effect of that ticket's owner and is fenced (R37, R45).
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, and_, delete, exists, literal_column, or_, select, update

from .. import schema
from ..base import TERMINAL_STATES
from ..github_records import PollCursor, WorkClaim
from .base import FencedRepository, insert_for, now_ms

_O, _C, _W = schema.github_once, schema.github_poll_cursors, schema.github_work
_WORK_KEY = (_W.c.repo, _W.c.number, _W.c.trigger_name)
# The stored (conflicting) row's ticket inside ON CONFLICT ... WHERE. Named as text because SQLAlchemy
# does not correlate a subquery there with the INSERT's table: `_W.c.ticket_id` would add `github_work`
# to the subquery's FROM (any row's ticket would do). The same words on SQLite and PostgreSQL.
_HELD_TICKET: ColumnElement[str] = literal_column("github_work.ticket_id")


def takeover_condition(now: ColumnElement[int], grace_ms: int) -> ColumnElement[bool]:
    """When a stored work claim gives way to a new claimer: its ticket has ended, or it has
    had no (stored) ticket for longer than the grace period (its creator crashed, or the
    ticket is gone). A ticket that does not exist counts only after the grace period because
    PostgreSQL checks the conflicting row at its newest version but reads `tickets` in the
    statement's snapshot: a claimer whose statement began just before the holder's ticket was
    committed sees the holder's ticket id but not the ticket (the tests have that interleaving)."""
    t = schema.tickets.alias("t")
    no_ticket = ~exists().where(t.c.id == _HELD_TICKET)
    ended = exists().where(t.c.id == _HELD_TICKET, t.c.state.in_(TERMINAL_STATES))
    return or_(and_(_W.c.claimed_at_ms < now - grace_ms, no_ticket), ended)


class GitHubIntake(FencedRepository):
    # keys seen once (R35)
    def claim_once(self, key: str, at_ms: int, ticket_id: str = "") -> bool:
        """Record `key` (a delivery id, a polled event id, ...) and return True, or return False
        when it was recorded before: what it guards happens once (R35). With `ticket_id`, the key
        guards a step of that ticket: only its owner records it."""
        with self._tx() as conn:
            if ticket_id:
                self._check(conn, ticket_id)
            row = conn.execute(insert_for(conn, _O).values(key=key, at_ms=at_ms)
                               .on_conflict_do_nothing(index_elements=[_O.c.key]).returning(_O.c.key)).first()
        return row is not None        # RETURNING names the row only when this INSERT made it

    def release_once(self, key: str, ticket_id: str = "") -> None:
        """Forget a claimed `key`: its handling failed before it was done, so a redelivery must be
        handled rather than refused as seen."""
        with self._tx() as conn:
            if ticket_id:
                self._check(conn, ticket_id)
            conn.execute(delete(_O).where(_O.c.key == key))

    # polling (github/poll.py)
    def poll_cursor(self, workspace: str) -> PollCursor:
        """Where the workspace's polling stands; PollCursor() before its first listing."""
        with self._read() as conn:
            row = conn.execute(select(_C.c.etag, _C.c.last_event_id, _C.c.next_poll_ms)
                               .where(_C.c.workspace == workspace)).first()
        return PollCursor(row[0], row[1], row[2]) if row else PollCursor()

    def put_poll_cursor(self, workspace: str, cursor: PollCursor, at_ms: int) -> None:
        with self._tx() as conn:
            ins = insert_for(conn, _C).values(workspace=workspace, etag=cursor.etag,
                                              last_event_id=cursor.last_event_id,
                                              next_poll_ms=cursor.next_poll_ms, updated_at_ms=at_ms)
            conn.execute(ins.on_conflict_do_update(
                index_elements=[_C.c.workspace],
                set_={k: ins.excluded[k] for k in ("etag", "last_event_id", "next_poll_ms", "updated_at_ms")}))

    # one ticket per piece of work (github/intake.py, docs/GITHUB.md "One ticket per issue")
    def claim_work(self, repo: str, number: int, trigger: str, claim: str, at_ms: int,
                   grace_ms: int) -> WorkClaim | None:
        """Claim (repo, number, trigger) for a ticket about to be created, in one atomic
        statement (INSERT ... ON CONFLICT on the table's primary key): the row is inserted when
        there is none, and replaced when `takeover_condition` holds. `at_ms`: now, on the
        caller's clock (PostgreSQL uses its own instead, so several hosts agree). Returns the
        claim as stored afterwards: `claim` equal to the argument means this caller holds it;
        another token means another delivery or scheduler does (join its ticket); None: the row
        went away meanwhile (try again)."""
        with self._tx() as conn:
            now = now_ms(conn, at_ms)
            ins = insert_for(conn, _W).values(repo=repo, number=number, trigger_name=trigger, claim=claim,
                                              ticket_id="", claimed_at_ms=now)
            conn.execute(ins.on_conflict_do_update(
                index_elements=list(_WORK_KEY),
                set_={"claim": ins.excluded.claim, "ticket_id": "", "claimed_at_ms": ins.excluded.claimed_at_ms},
                where=takeover_condition(now, grace_ms)))
            row = conn.execute(select(_W.c.claim, _W.c.ticket_id, _W.c.claimed_at_ms)
                               .where(*self._key(repo, number, trigger))).first()
        return WorkClaim(*row) if row else None

    def set_work_ticket(self, repo: str, number: int, trigger: str, claim: str, ticket_id: str) -> bool:
        """Record the ticket of this caller's claim; False when the claim is no longer its own."""
        with self._tx() as conn:
            res = conn.execute(update(_W).where(*self._key(repo, number, trigger), _W.c.claim == claim)
                               .values(ticket_id=ticket_id))
        return res.rowcount == 1

    def release_work(self, repo: str, number: int, trigger: str, claim: str) -> None:
        """Give up this caller's claim (its ticket could not be created), so the next event may start one."""
        with self._tx() as conn:
            conn.execute(delete(_W).where(*self._key(repo, number, trigger), _W.c.claim == claim))

    @staticmethod
    def _key(repo: str, number: int, trigger: str) -> tuple[ColumnElement[bool], ...]:
        return (_W.c.repo == repo, _W.c.number == number, _W.c.trigger_name == trigger)
