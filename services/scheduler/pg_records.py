"""The PostgreSQL store's records of GitHub intake (delivery ids seen once,
poll cursors, the ticket of a PR), follow-ups, reports back to GitHub and
sandbox placements: rows with no lease of their own, so written without a
fence check. Mixed into `PostgresStore` (pg_store.py), which owns the
connection.
"""

from __future__ import annotations

import psycopg

from .store import FollowUpRecord


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

    def poll_cursor(self, workspace: str) -> tuple[str, str]:
        row = self._conn().execute("SELECT etag, last_event_id FROM github_poll_cursors WHERE workspace=%s",
                                   (workspace,)).fetchone()
        return (row[0], row[1]) if row else ("", "")

    def put_poll_cursor(self, workspace: str, etag: str, last_event_id: str, at_ms: int) -> None:
        self._conn().execute(
            "INSERT INTO github_poll_cursors (workspace, etag, last_event_id, updated_at_ms) "
            "VALUES (%s,%s,%s,%s) ON CONFLICT (workspace) DO UPDATE SET etag=excluded.etag, "
            "last_event_id=excluded.last_event_id, updated_at_ms=excluded.updated_at_ms",
            (workspace, etag, last_event_id, at_ms))

    def ticket_for_pr(self, workspace: str, number: str) -> str | None:
        row = self._conn().execute(
            "SELECT p.ticket_id FROM pull_requests p JOIN tickets t ON t.id=p.ticket_id WHERE t.workspace=%s AND p.number=%s "
            "ORDER BY t.created_at_ms DESC LIMIT 1", (workspace, number)).fetchone()
        return row[0] if row else None

    # follow-ups and reports
    def add_followup(self, rec: FollowUpRecord) -> None:
        self._conn().execute(
            "INSERT INTO ticket_followups (ticket_id, at_ms, author, source, text, path, line, url) "
            "VALUES (%s,%s,%s,%s,%s,%s,%s,%s)",
            (rec.ticket_id, rec.at_ms, rec.author, rec.source, rec.text, rec.path, rec.line, rec.url))

    def followups(self, ticket_id: str, since_ms: int) -> list[FollowUpRecord]:
        rows = self._conn().execute(
            "SELECT ticket_id, at_ms, author, source, text, path, line, url FROM ticket_followups "
            "WHERE ticket_id=%s AND at_ms>=%s ORDER BY id", (ticket_id, since_ms)).fetchall()
        return [FollowUpRecord(*r) for r in rows]

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
