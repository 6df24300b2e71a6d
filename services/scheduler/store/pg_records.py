"""The PostgreSQL store's records of GitHub intake (delivery ids seen once,
poll cursors, the ticket of a PR, the one live ticket of an issue), follow-ups, reports back to GitHub and
sandbox placements: rows with no lease of their own, so written without a
fence check. Mixed into `PostgresStore` (pg_store.py), which owns the
connection.
"""

from __future__ import annotations

import psycopg

from .base import CLAIM_WORK, FOLLOWUP_COLS, TERMINAL_STATES, FollowUpRecord, PollCursor, WorkClaim

NOW_MS = "(extract(epoch from clock_timestamp()) * 1000)::bigint"   # the database's clock (as pg_store.py)


class PostgresRecords:
    """`Store`'s GitHub, follow-up, report and placement methods on PostgreSQL."""

    def _conn(self) -> psycopg.Connection:
        raise NotImplementedError

    # GitHub intake
    def claim_once(self, key: str, at_ms: int) -> bool:
        cur = self._conn().execute("INSERT INTO github_once (key, at_ms) VALUES (%s,%s) ON CONFLICT (key) "
                                   "DO NOTHING", (key, at_ms))
        return cur.rowcount == 1

    def release_once(self, key: str) -> None:
        self._conn().execute("DELETE FROM github_once WHERE key=%s", (key,))

    def poll_cursor(self, workspace: str) -> PollCursor:
        row = self._conn().execute("SELECT etag, last_event_id, next_poll_ms FROM github_poll_cursors "
                                   "WHERE workspace=%s", (workspace,)).fetchone()
        return PollCursor(row[0], row[1], row[2]) if row else PollCursor()

    def put_poll_cursor(self, workspace: str, cursor: PollCursor, at_ms: int) -> None:
        self._conn().execute(
            "INSERT INTO github_poll_cursors (workspace, etag, last_event_id, next_poll_ms, updated_at_ms) "
            "VALUES (%s,%s,%s,%s,%s) ON CONFLICT (workspace) DO UPDATE SET etag=excluded.etag, "
            "last_event_id=excluded.last_event_id, next_poll_ms=excluded.next_poll_ms, "
            "updated_at_ms=excluded.updated_at_ms",
            (workspace, cursor.etag, cursor.last_event_id, cursor.next_poll_ms, at_ms))

    def ticket_for_pr(self, workspace: str, number: str) -> str | None:
        row = self._conn().execute(
            "SELECT p.ticket_id FROM pull_requests p JOIN tickets t ON t.id=p.ticket_id WHERE t.workspace=%s AND p.number=%s "
            "ORDER BY t.created_at_ms DESC LIMIT 1", (workspace, number)).fetchone()
        return row[0] if row else None

    # one ticket per piece of work (github_intake.py)
    def claim_work(self, repo: str, number: int, trigger: str, claim: str, at_ms: int,
                   grace_ms: int) -> WorkClaim | None:
        # Autocommit: the upsert is atomic on its own (a concurrent claimer's INSERT waits for this
        # one's row, then finds it); the read after it says who holds the claim now. A retry after a
        # commit the lost connection cut finds this caller's own token.
        key = (repo, number, trigger)
        db = self._conn()
        db.execute(CLAIM_WORK.format(now=NOW_MS), (*key, claim, grace_ms, *TERMINAL_STATES))
        row = db.execute("SELECT claim, ticket_id, claimed_at_ms FROM github_work WHERE repo=%s AND number=%s "
                         "AND trigger_name=%s", key).fetchone()
        return WorkClaim(*row) if row else None

    def set_work_ticket(self, repo: str, number: int, trigger: str, claim: str, ticket_id: str) -> bool:
        cur = self._conn().execute("UPDATE github_work SET ticket_id=%s WHERE repo=%s AND number=%s AND "
                                   "trigger_name=%s AND claim=%s", (ticket_id, repo, number, trigger, claim))
        return cur.rowcount == 1

    def release_work(self, repo: str, number: int, trigger: str, claim: str) -> None:
        self._conn().execute("DELETE FROM github_work WHERE repo=%s AND number=%s AND trigger_name=%s AND "
                             "claim=%s", (repo, number, trigger, claim))

    # follow-ups and reports
    def add_followup(self, rec: FollowUpRecord) -> None:
        self._conn().execute(
            "INSERT INTO ticket_followups (ticket_id, at_ms, author, source, text, path, line, url, state) "
            "VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s)",
            (rec.ticket_id, rec.at_ms, rec.author, rec.source, rec.text, rec.path, rec.line, rec.url, rec.state))

    def followups(self, ticket_id: str, since_ms: int) -> list[FollowUpRecord]:
        rows = self._conn().execute(
            f"SELECT {FOLLOWUP_COLS} FROM ticket_followups "
            "WHERE ticket_id=%s AND at_ms>=%s AND state='given' ORDER BY id", (ticket_id, since_ms)).fetchall()
        return [FollowUpRecord(*r) for r in rows]

    def pending_followups(self, ticket_id: str) -> list[FollowUpRecord]:
        rows = self._conn().execute(f"SELECT {FOLLOWUP_COLS} FROM ticket_followups WHERE ticket_id=%s AND "
                                    "state='pending' ORDER BY id", (ticket_id,)).fetchall()
        return [FollowUpRecord(*r) for r in rows]

    def give_followups(self, ticket_id: str, at_ms: int) -> int:
        cur = self._conn().execute("UPDATE ticket_followups SET state='given', at_ms=%s WHERE ticket_id=%s AND "
                                   "state='pending'", (at_ms, ticket_id))
        return cur.rowcount

    def drop_followups(self, ticket_id: str) -> list[FollowUpRecord]:
        rows = self._conn().execute(f"UPDATE ticket_followups SET state='dropped' WHERE ticket_id=%s AND "
                                    f"state='pending' RETURNING id, {FOLLOWUP_COLS}", (ticket_id,)).fetchall()
        return [FollowUpRecord(*r[1:]) for r in sorted(rows)]

    def tickets_with_pending_followups(self) -> list[str]:
        rows = self._conn().execute("SELECT ticket_id, MIN(id) FROM ticket_followups WHERE state='pending' "
                                    "GROUP BY ticket_id ORDER BY 2").fetchall()
        return [r[0] for r in rows]

    def report(self, ticket_id: str, step: str) -> tuple[str, str] | None:
        row = self._conn().execute("SELECT comment_id, digest FROM github_reports WHERE ticket_id=%s AND step=%s",
                              (ticket_id, step)).fetchone()
        return (row[0], row[1]) if row else None

    def put_report(self, ticket_id: str, step: str, comment_id: str, digest: str, at_ms: int) -> None:
        self._conn().execute(
            "INSERT INTO github_reports (ticket_id, step, comment_id, digest, at_ms) VALUES (%s,%s,%s,%s,%s) "
            "ON CONFLICT (ticket_id, step) DO UPDATE SET comment_id=excluded.comment_id, "
            "digest=excluded.digest, at_ms=excluded.at_ms", (ticket_id, step, comment_id, digest, at_ms))

    def place_sandbox(self, ticket_id: str, broker: str, at_ms: int) -> None:
        self._conn().execute("INSERT INTO sandbox_placements (ticket_id, broker, at_ms) VALUES (%s,%s,%s) "
                             "ON CONFLICT (ticket_id) DO UPDATE SET broker=excluded.broker, at_ms=excluded.at_ms",
                             (ticket_id, broker, at_ms))

    def sandbox_placement(self, ticket_id: str) -> str | None:
        row = self._conn().execute("SELECT broker FROM sandbox_placements WHERE ticket_id=%s",
                                   (ticket_id,)).fetchone()
        return row[0] if row else None

    def unplace_sandbox(self, ticket_id: str) -> None:
        self._conn().execute("DELETE FROM sandbox_placements WHERE ticket_id=%s", (ticket_id,))
