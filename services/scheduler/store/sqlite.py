"""The embedded SQLite store (WAL mode, versioned migrations).

One connection owned by the scheduler's event loop thread. Writes are
short transactions; `synchronous=NORMAL` in WAL mode keeps every committed
transaction across a process kill (only an OS crash may lose the tail).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import time
from pathlib import Path

from services.common.errors import FailedPrecondition

from . import migrations
from .base import (
    CLAIM_WORK,
    FOLLOWUP_COLS,
    LIVE,
    TERMINAL,
    TERMINAL_STATES,
    ApprovalRecord,
    EventRecord,
    FollowUpRecord,
    NodeRunRecord,
    PollCursor,
    PullRequestRecord,
    Store,
    TicketRecord,
    WorkClaim,
    str_list,
)
from .retry import Retrier, retried_methods, sqlite_reason

log = logging.getLogger(__name__)

# Versioned migrations (migrations/sqlite/NNNN_*.sql): index i brings the
# schema from version i to i+1. PRAGMA user_version holds the version.
MIGRATIONS: list[str] = migrations.load("sqlite")
SCHEMA_TABLE_SINCE = 2   # the version whose migration creates schema_version
SCHEMA_VERSION = len(MIGRATIONS)
BUSY_TIMEOUT_MS = 5000   # SQLite's own wait for another connection's lock, before store_retry.py's

_TICKET_COLS = ("rowid, id, workspace, workflow, title, body, inputs_json, state, created_at_ms, "
                "updated_at_ms, principal, error, tokens_used, awaiting_sha, torn_down, origin_json, reopened_at_ms")
_TICKET_FIELDS = {"state", "updated_at_ms", "error", "tokens_used", "awaiting_sha", "torn_down",
                  "reopened_at_ms"}
_NODE_FIELDS = {"state", "attempt", "started_at_ms", "finished_at_ms", "output", "error", "rounds",
                "feedback"}


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _ticket(row: tuple) -> TicketRecord:
    return TicketRecord(
        rowid=row[0], id=row[1], workspace=row[2], workflow=row[3], title=row[4], body=row[5],
        inputs=json.loads(row[6]), state=row[7], created_at_ms=row[8], updated_at_ms=row[9],
        principal=row[10], error=row[11], tokens_used=row[12], awaiting_sha=row[13],
        torn_down=bool(row[14]), origin=json.loads(row[15] or "{}"), reopened_at_ms=row[16] or 0,
    )


class SqliteStore(Store):
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        with contextlib.suppress(OSError):
            os.chmod(self.path, 0o600)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        self._retry = Retrier("sqlite", f"the SQLite store {self.path.name}", sqlite_reason, self._end_transaction,
                              lambda: False)
        self._migrate()

    def _migrate(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise FailedPrecondition(migrations.newer_schema_message(
                f"the SQLite store {self.path.name}", version, SCHEMA_VERSION, self._release_of(version)))
        for i in range(version, SCHEMA_VERSION):
            log.info("store: migrating schema %s -> %s", i, i + 1)
            self.db.execute("BEGIN IMMEDIATE")
            try:
                for stmt in MIGRATIONS[i].split(";"):
                    if stmt.strip():
                        self.db.execute(stmt)
                if i + 1 >= SCHEMA_TABLE_SINCE:
                    self.db.execute("INSERT OR REPLACE INTO schema_version (version, afe_version, applied_at_ms) "
                                    "VALUES (?,?,?)", (i + 1, migrations.afe_version(), _now_ms()))
                self.db.execute(f"PRAGMA user_version={i + 1}")
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise

    def _release_of(self, version: int) -> str | None:
        """The afe release that first applied a schema version past ours, if recorded."""
        try:
            row = self.db.execute("SELECT afe_version FROM schema_version WHERE version>? ORDER BY version "
                                  "LIMIT 1", (SCHEMA_VERSION,)).fetchone()
        except sqlite3.Error:
            return None
        return row[0] if row else None

    def _end_transaction(self, reason: str) -> None:
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")

    def close(self) -> None:
        self.db.close()

    def checkpoint(self) -> None:
        """Copy the WAL into the database file now (SQLite otherwise does it
        when a commit finds the WAL past 1000 pages)."""
        self.db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()

    def ping(self) -> bool:
        return self.db.execute("SELECT 1").fetchone()[0] == 1

    # tickets
    def create_ticket(self, ticket: TicketRecord, nodes: list[NodeRunRecord],
                      first_events: list[EventRecord]) -> TicketRecord:
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            cur = db.execute(
                "INSERT INTO tickets (id, workspace, workflow, title, body, inputs_json, state, "
                "created_at_ms, updated_at_ms, principal, origin_json) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (ticket.id, ticket.workspace, ticket.workflow, ticket.title, ticket.body,
                 json.dumps(ticket.inputs, sort_keys=True), ticket.state, ticket.created_at_ms,
                 ticket.updated_at_ms, ticket.principal, json.dumps(ticket.origin, sort_keys=True)))
            ticket.rowid = int(cur.lastrowid or 0)
            db.executemany(
                "INSERT INTO node_runs (ticket_id, node_id, ord, kind, state, needs_json) "
                "VALUES (?,?,?,?,?,?)",
                [(n.ticket_id, n.node_id, i, n.kind, n.state, json.dumps(list(n.needs)))
                 for i, n in enumerate(nodes)])
            self._insert_events(first_events)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return ticket

    def get_ticket(self, ticket_id: str) -> TicketRecord | None:
        row = self.db.execute(f"SELECT {_TICKET_COLS} FROM tickets WHERE id=?", (ticket_id,)).fetchone()
        return _ticket(row) if row else None

    def list_tickets(self, states: list[str] | None = None, workspace: str | None = None,
                     limit: int = 50, before_rowid: int | None = None) -> list[TicketRecord]:
        where: list[str] = []
        args: list[object] = []
        if states:
            where.append(f"state IN ({','.join('?' * len(states))})")
            args.extend(states)
        if workspace:
            where.append("workspace=?")
            args.append(workspace)
        if before_rowid is not None:
            where.append("rowid<?")
            args.append(before_rowid)
        sql = f"SELECT {_TICKET_COLS} FROM tickets"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY rowid DESC LIMIT ?"
        args.append(limit)
        return [_ticket(r) for r in self.db.execute(sql, args)]

    def update_ticket(self, ticket_id: str, **fields: object) -> None:
        bad = set(fields) - _TICKET_FIELDS
        if bad:
            raise ValueError(f"not updatable: {sorted(bad)}")
        cols = ", ".join(f"{k}=?" for k in fields)
        self.db.execute(f"UPDATE tickets SET {cols} WHERE id=?",
                        [int(v) if isinstance(v, bool) else v for v in fields.values()] + [ticket_id])

    def tickets_in_states(self, states: tuple[str, ...] = LIVE) -> list[TicketRecord]:
        marks = ",".join("?" * len(states))
        sql = f"SELECT {_TICKET_COLS} FROM tickets WHERE state IN ({marks}) ORDER BY rowid"
        return [_ticket(r) for r in self.db.execute(sql, states)]

    def count_by_state(self) -> dict[str, int]:
        return {state: n for state, n in self.db.execute("SELECT state, COUNT(*) FROM tickets GROUP BY state")}

    def terminal_not_torn_down(self) -> list[TicketRecord]:
        sql = f"SELECT {_TICKET_COLS} FROM tickets WHERE torn_down=0 AND state IN (?,?,?) ORDER BY rowid"
        return [_ticket(r) for r in self.db.execute(sql, sorted(TERMINAL))]

    # node runs
    def node_runs(self, ticket_id: str) -> list[NodeRunRecord]:
        rows = self.db.execute(
            "SELECT ticket_id, node_id, kind, state, needs_json, attempt, started_at_ms, "
            "finished_at_ms, output, error, rounds, feedback FROM node_runs WHERE ticket_id=? ORDER BY ord", (ticket_id,))
        return [NodeRunRecord(ticket_id=r[0], node_id=r[1], kind=r[2], state=r[3],
                              needs=tuple(json.loads(r[4])), attempt=r[5], started_at_ms=r[6],
                              finished_at_ms=r[7], output=r[8], error=r[9], rounds=r[10], feedback=r[11])
                for r in rows]

    def update_node(self, ticket_id: str, node_id: str, **fields: object) -> None:
        bad = set(fields) - _NODE_FIELDS
        if bad:
            raise ValueError(f"not updatable: {sorted(bad)}")
        cols = ", ".join(f"{k}=?" for k in fields)
        self.db.execute(f"UPDATE node_runs SET {cols} WHERE ticket_id=? AND node_id=?",
                        [*fields.values(), ticket_id, node_id])

    # events
    def _insert_events(self, events: list[EventRecord]) -> None:
        if events:
            # EventRecord is a tuple in column order. The module binds exact
            # tuples much faster than tuple subclasses: plain copies are cheaper
            # (the event log hands over plain tuples already).
            if events[0].__class__ is not tuple:
                events = list(map(tuple, events))  # type: ignore[arg-type]
            self.db.executemany(
                "INSERT INTO events (ticket_id, seq, type, payload_json, at_ms) VALUES (?,?,?,?,?)", events)

    def append_events(self, events: list[EventRecord]) -> None:
        if not events:
            return
        self.db.execute("BEGIN")
        try:
            self._insert_events(events)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def events(self, ticket_id: str, from_seq: int, limit: int = 1000) -> list[EventRecord]:
        rows = self.db.execute(
            "SELECT ticket_id, seq, type, payload_json, at_ms FROM events "
            "WHERE ticket_id=? AND seq>=? ORDER BY seq LIMIT ?", (ticket_id, from_seq, limit))
        return [EventRecord(*r) for r in rows]

    def last_seq(self, ticket_id: str) -> int:
        row = self.db.execute("SELECT MAX(seq) FROM events WHERE ticket_id=?", (ticket_id,)).fetchone()
        return int(row[0] or 0)

    # approvals and pull requests
    def add_approval(self, approval: ApprovalRecord) -> None:
        self.db.execute(
            "INSERT INTO approvals (ticket_id, principal, sha, granted, at_ms, reason, accepted_harness) "
            "VALUES (?,?,?,?,?,?,?)",
            (approval.ticket_id, approval.principal, approval.sha, int(approval.granted),
             approval.at_ms, approval.reason, json.dumps(approval.accepted_harness_change)))

    def latest_approval(self, ticket_id: str) -> ApprovalRecord | None:
        row = self.db.execute(
            "SELECT ticket_id, principal, sha, granted, at_ms, reason, accepted_harness FROM approvals "
            "WHERE ticket_id=? ORDER BY id DESC LIMIT 1", (ticket_id,)).fetchone()
        if not row:
            return None
        return ApprovalRecord(ticket_id=row[0], principal=row[1], sha=row[2], granted=bool(row[3]),
                              at_ms=row[4], reason=row[5],
                              accepted_harness_change=str_list(row[6]))

    def put_pr(self, pr: PullRequestRecord) -> None:
        self.db.execute(
            "INSERT INTO pull_requests (ticket_id, number, url, head_branch, base_branch, head_sha, "
            "state, merge_sha) VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(ticket_id) DO UPDATE SET "
            "number=excluded.number, url=excluded.url, head_branch=excluded.head_branch, "
            "base_branch=excluded.base_branch, head_sha=excluded.head_sha, state=excluded.state, "
            "merge_sha=excluded.merge_sha",
            (pr.ticket_id, pr.number, pr.url, pr.head_branch, pr.base_branch, pr.head_sha, pr.state,
             pr.merge_sha))

    def get_pr(self, ticket_id: str) -> PullRequestRecord | None:
        row = self.db.execute(
            "SELECT ticket_id, number, url, head_branch, base_branch, head_sha, state, merge_sha "
            "FROM pull_requests WHERE ticket_id=?", (ticket_id,)).fetchone()
        return PullRequestRecord(*row) if row else None

    # records that outlive the ticket
    def put_final_diff(self, ticket_id: str, diff: str, truncated: bool, at_ms: int) -> None:
        self.db.execute(
            "INSERT INTO ticket_diffs (ticket_id, diff, truncated, at_ms) VALUES (?,?,?,?) "
            "ON CONFLICT (ticket_id) DO UPDATE SET diff=excluded.diff, truncated=excluded.truncated, "
            "at_ms=excluded.at_ms", (ticket_id, diff, int(truncated), at_ms))

    def final_diff(self, ticket_id: str) -> tuple[str, bool] | None:
        row = self.db.execute("SELECT diff, truncated FROM ticket_diffs WHERE ticket_id=?",
                              (ticket_id,)).fetchone()
        return (row[0], bool(row[1])) if row else None

    # GitHub intake
    def claim_once(self, key: str, at_ms: int) -> bool:
        cur = self.db.execute("INSERT OR IGNORE INTO github_once (key, at_ms) VALUES (?,?)", (key, at_ms))
        return cur.rowcount == 1

    def release_once(self, key: str) -> None:
        self.db.execute("DELETE FROM github_once WHERE key=?", (key,))

    def poll_cursor(self, workspace: str) -> PollCursor:
        row = self.db.execute("SELECT etag, last_event_id, next_poll_ms FROM github_poll_cursors WHERE workspace=?",
                              (workspace,)).fetchone()
        return PollCursor(row[0], row[1], row[2]) if row else PollCursor()

    def put_poll_cursor(self, workspace: str, cursor: PollCursor, at_ms: int) -> None:
        self.db.execute(
            "INSERT INTO github_poll_cursors (workspace, etag, last_event_id, next_poll_ms, updated_at_ms) "
            "VALUES (?,?,?,?,?) ON CONFLICT(workspace) DO UPDATE SET etag=excluded.etag, "
            "last_event_id=excluded.last_event_id, next_poll_ms=excluded.next_poll_ms, "
            "updated_at_ms=excluded.updated_at_ms",
            (workspace, cursor.etag, cursor.last_event_id, cursor.next_poll_ms, at_ms))

    def ticket_for_pr(self, workspace: str, number: str) -> str | None:
        row = self.db.execute(
            "SELECT p.ticket_id FROM pull_requests p JOIN tickets t ON t.id=p.ticket_id WHERE t.workspace=? AND p.number=? "
            "ORDER BY t.created_at_ms DESC LIMIT 1", (workspace, number)).fetchone()
        return row[0] if row else None

    # one ticket per piece of work (github_intake.py)
    def claim_work(self, repo: str, number: int, trigger: str, claim: str, at_ms: int,
                   grace_ms: int) -> WorkClaim | None:
        key = (repo, number, trigger)
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.execute(CLAIM_WORK.format(now="%s").replace("%s", "?"),
                            (*key, claim, at_ms, at_ms, grace_ms, *TERMINAL_STATES))
            row = self.db.execute("SELECT claim, ticket_id, claimed_at_ms FROM github_work WHERE repo=? AND "
                                  "number=? AND trigger_name=?", key).fetchone()
            self.db.execute("COMMIT")
        except BaseException:
            self._end_transaction("")
            raise
        return WorkClaim(*row) if row else None

    def set_work_ticket(self, repo: str, number: int, trigger: str, claim: str, ticket_id: str) -> bool:
        cur = self.db.execute("UPDATE github_work SET ticket_id=? WHERE repo=? AND number=? AND trigger_name=? "
                              "AND claim=?", (ticket_id, repo, number, trigger, claim))
        return cur.rowcount == 1

    def release_work(self, repo: str, number: int, trigger: str, claim: str) -> None:
        self.db.execute("DELETE FROM github_work WHERE repo=? AND number=? AND trigger_name=? AND claim=?",
                        (repo, number, trigger, claim))

    # follow-ups and reports
    def add_followup(self, rec: FollowUpRecord) -> None:
        self.db.execute(
            "INSERT INTO ticket_followups (ticket_id, at_ms, author, source, text, path, line, url, state) "
            "VALUES (?,?,?,?,?,?,?,?,?)",
            (rec.ticket_id, rec.at_ms, rec.author, rec.source, rec.text, rec.path, rec.line, rec.url, rec.state))

    def followups(self, ticket_id: str, since_ms: int) -> list[FollowUpRecord]:
        rows = self.db.execute(
            f"SELECT {FOLLOWUP_COLS} FROM ticket_followups "
            "WHERE ticket_id=? AND at_ms>=? AND state='given' ORDER BY id", (ticket_id, since_ms)).fetchall()
        return [FollowUpRecord(*r) for r in rows]

    def pending_followups(self, ticket_id: str) -> list[FollowUpRecord]:
        rows = self.db.execute(f"SELECT {FOLLOWUP_COLS} FROM ticket_followups WHERE ticket_id=? AND "
                               "state='pending' ORDER BY id", (ticket_id,)).fetchall()
        return [FollowUpRecord(*r) for r in rows]

    def give_followups(self, ticket_id: str, at_ms: int) -> int:
        cur = self.db.execute("UPDATE ticket_followups SET state='given', at_ms=? WHERE ticket_id=? AND "
                              "state='pending'", (at_ms, ticket_id))
        return cur.rowcount

    def drop_followups(self, ticket_id: str) -> list[FollowUpRecord]:
        rows = self.db.execute(f"UPDATE ticket_followups SET state='dropped' WHERE ticket_id=? AND "
                               f"state='pending' RETURNING id, {FOLLOWUP_COLS}", (ticket_id,)).fetchall()
        return [FollowUpRecord(*r[1:]) for r in sorted(rows)]

    def tickets_with_pending_followups(self) -> list[str]:
        rows = self.db.execute("SELECT ticket_id, MIN(id) FROM ticket_followups WHERE state='pending' "
                               "GROUP BY ticket_id ORDER BY 2").fetchall()
        return [r[0] for r in rows]

    def report(self, ticket_id: str, step: str) -> tuple[str, str] | None:
        row = self.db.execute("SELECT comment_id, digest FROM github_reports WHERE ticket_id=? AND step=?",
                              (ticket_id, step)).fetchone()
        return (row[0], row[1]) if row else None

    def put_report(self, ticket_id: str, step: str, comment_id: str, digest: str, at_ms: int) -> None:
        self.db.execute(
            "INSERT INTO github_reports (ticket_id, step, comment_id, digest, at_ms) VALUES (?,?,?,?,?) "
            "ON CONFLICT (ticket_id, step) DO UPDATE SET comment_id=excluded.comment_id, "
            "digest=excluded.digest, at_ms=excluded.at_ms", (ticket_id, step, comment_id, digest, at_ms))

    def place_sandbox(self, ticket_id: str, broker: str, at_ms: int) -> None:
        self.db.execute("INSERT INTO sandbox_placements (ticket_id, broker, at_ms) VALUES (?,?,?) "
                        "ON CONFLICT (ticket_id) DO UPDATE SET broker=excluded.broker, at_ms=excluded.at_ms",
                        (ticket_id, broker, at_ms))

    def sandbox_placement(self, ticket_id: str) -> str | None:
        row = self.db.execute("SELECT broker FROM sandbox_placements WHERE ticket_id=?", (ticket_id,)).fetchone()
        return row[0] if row else None

    def unplace_sandbox(self, ticket_id: str) -> None:
        self.db.execute("DELETE FROM sandbox_placements WHERE ticket_id=?", (ticket_id,))


retried_methods(SqliteStore, Store)
