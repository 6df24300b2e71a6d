"""The PostgreSQL store: the same `Store` as sqlite_store.py on a server that
several schedulers may share (psycopg 3, one synchronous connection owned by
the scheduler's event loop thread, like the SQLite connection).

Schema: numbered migrations in migrations/postgresql/, applied under an
advisory lock (two schedulers starting together migrate once), recorded in
`schema_version` with the afe release that applied them; a newer schema is
refused with the release it needs.

Event seqs: see pg_events.py.

Leases (docs/SCALE.md): a live ticket is driven by the scheduler in
`tickets.owner` until `lease_until_ms` (the database's clock, so the hosts'
clocks do not matter); `claim_ticket` takes a free or expired ticket with
`FOR UPDATE SKIP LOCKED` and bumps `fence`. For the tickets in `fences`,
every write first checks owner and fence with `SELECT ... FOR SHARE` in the
write's own transaction: a claim (which updates the row) waits for the
write to commit, and a write after the claim finds the new fence and is
refused (`LeaseLost`) with nothing written.

Opening the database and reading its schema version: pg_connect.py. The
GitHub intake, report and sandbox-placement records: pg_records.py.

The connection string is never logged or put in an error (R29): errors name
the host, port and database only (`where`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg

from services.common.errors import FailedPrecondition, Unavailable

from . import migrations
from .base import (
    LIVE,
    TERMINAL,
    ApprovalRecord,
    EventRecord,
    Lease,
    LeaseLost,
    NodeRunRecord,
    PullRequestRecord,
    Store,
    TicketRecord,
    str_list,
)
from .pg_connect import MIGRATIONS, SCHEMA_VERSION, _one, check_newer, connect, schema_state
from .pg_events import insert_events
from .pg_records import PostgresRecords
from .retry import Retrier, pg_reason, retried_methods

log = logging.getLogger(__name__)

MIGRATION_LOCK = 0x61666531   # pg_advisory_xact_lock key ("afe1") held while migrating

_TICKET_COLS = ("rowid, id, workspace, workflow, title, body, inputs_json, state, created_at_ms, "
                "updated_at_ms, principal, error, tokens_used, awaiting_sha, torn_down, origin_json, reopened_at_ms")
_TICKET_FIELDS = {"state", "updated_at_ms", "error", "tokens_used", "awaiting_sha", "torn_down",
                  "reopened_at_ms"}
_NODE_FIELDS = {"state", "attempt", "started_at_ms", "finished_at_ms", "output", "error", "rounds",
                "feedback"}


NOW_MS = "(extract(epoch from clock_timestamp()) * 1000)::bigint"   # the database's clock, ms


def _ticket(row: tuple) -> TicketRecord:
    return TicketRecord(
        rowid=row[0], id=row[1], workspace=row[2], workflow=row[3], title=row[4], body=row[5],
        inputs=json.loads(row[6]), state=row[7], created_at_ms=row[8], updated_at_ms=row[9],
        principal=row[10], error=row[11], tokens_used=row[12], awaiting_sha=row[13],
        torn_down=bool(row[14]), origin=json.loads(row[15] or "{}"), reopened_at_ms=row[16] or 0,
    )


class PostgresStore(PostgresRecords, Store):
    shared = True

    def __init__(self, conninfo: str, where: str = "the PostgreSQL database") -> None:
        self._conninfo = conninfo
        self.where = where
        self._retry = Retrier("postgresql", where, pg_reason, self._drop, self._broken)
        self.db = connect(conninfo, where)
        try:
            self._migrate()
        except psycopg.errors.InsufficientPrivilege:
            self.db.close()
            raise FailedPrecondition(
                f"AFE_DATABASE_URL: the user in the URL may not create afe's tables in {where}: make it the "
                "database's owner (ALTER DATABASE ... OWNER TO ...) or grant it CREATE on schema public") from None
        except BaseException:
            self.db.close()
            raise

    def __repr__(self) -> str:
        return f"PostgresStore({self.where})"

    def _migrate(self) -> None:
        db = self.db
        with db.transaction():
            db.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            version, needed = schema_state(db)
            check_newer(version, needed, self.where)
            for i in range(version, SCHEMA_VERSION):
                log.info("store: migrating the PostgreSQL schema %s -> %s", i, i + 1)
                db.execute(MIGRATIONS[i])  # several statements, no parameters: simple query protocol
                db.execute("INSERT INTO schema_version (version, afe_version, applied_at_ms) VALUES (%s,%s,%s)",
                           (i + 1, migrations.afe_version(), time.time_ns() // 1_000_000))

    def _conn(self) -> psycopg.Connection:
        """The connection; a new one when the server closed it (a restart)."""
        if self.db.broken or self.db.closed:
            log.warning("store: the connection to %s was lost; reconnecting", self.where)
            self.db = connect(self._conninfo, self.where)
            log.info("store: connected to %s again", self.where)
        return self.db

    def _broken(self) -> bool:
        return bool(self.db.broken or self.db.closed)

    def _drop(self, reason: str) -> None:
        """Before a retry (store_retry.py): a connection the server ended is
        closed here, so `_conn` opens a new one."""
        if reason not in ("serialization_failure", "deadlock") or self._broken():
            self.db.close()

    def close(self) -> None:
        self.db.close()

    def ping(self) -> bool:
        """Whether the database answers now. A connection the server ended
        (a restart) is replaced once, so the first probe after a restart
        does not report the old connection's end."""
        for _ in range(2):
            try:
                return _one(self._conn().execute("SELECT 1").fetchone())[0] == 1
            except (psycopg.Error, Unavailable, FailedPrecondition):
                if not self._broken():
                    return False
        return False

    # leases (docs/SCALE.md)
    def _check(self, db: psycopg.Connection | psycopg.Cursor, ticket_id: str, fence: int) -> None:
        """Inside the caller's transaction: this owner still holds the ticket with
        `fence` (the row stays share-locked until the transaction ends)."""
        row = db.execute("SELECT 1 FROM tickets WHERE id=%s AND owner=%s AND fence=%s FOR SHARE",
                         (ticket_id, self.owner, fence)).fetchone()
        if row is None:
            raise LeaseLost(ticket_id)

    def _write(self, ticket_id: str, sql: str, params: Sequence[Any] | Mapping[str, Any]) -> None:
        """One statement that changes `ticket_id`'s rows; checked when this scheduler holds the ticket."""
        db = self._conn()
        fence = self.fences.get(ticket_id)
        if fence is None:
            db.execute(sql, params)
            return
        with db.transaction():
            self._check(db, ticket_id, fence)
            db.execute(sql, params)

    def claim_ticket(self, ticket_id: str, states: tuple[str, ...], lease_ms: int) -> int | None:
        row = self._conn().execute(
            "WITH free AS (SELECT id FROM tickets WHERE id=%s AND state = ANY(%s) "
            f"AND (owner='' OR owner=%s OR lease_until_ms < {NOW_MS}) FOR UPDATE SKIP LOCKED) "
            f"UPDATE tickets t SET owner=%s, fence=t.fence+1, lease_until_ms={NOW_MS}+%s FROM free "
            "WHERE t.id=free.id RETURNING t.fence",
            (ticket_id, list(states), self.owner, self.owner, lease_ms)).fetchone()
        if row is None:
            return None
        self.fences[ticket_id] = int(row[0])
        return int(row[0])

    def expired_tickets(self, states: tuple[str, ...]) -> list[str]:
        rows = self._conn().execute(
            "SELECT id FROM tickets WHERE state = ANY(%s) AND owner<>%s "
            f"AND lease_until_ms < {NOW_MS} ORDER BY rowid LIMIT 100", (list(states), self.owner))
        return [r[0] for r in rows]

    def renew_leases(self, ticket_ids: list[str], lease_ms: int) -> list[Lease]:
        if not ticket_ids:
            return []
        rows = self._conn().execute(
            f"UPDATE tickets SET lease_until_ms={NOW_MS}+%s WHERE owner=%s AND id = ANY(%s) "
            "RETURNING id, fence, state, cancel_by", (lease_ms, self.owner, list(ticket_ids))).fetchall()
        return [Lease(r[0], int(r[1]), r[2], r[3]) for r in rows if self.fences.get(r[0]) == int(r[1])]

    def holds(self, ticket_id: str, fence: int) -> bool:
        row = self._conn().execute(
            f"SELECT 1 FROM tickets WHERE id=%s AND owner=%s AND fence=%s AND lease_until_ms >= {NOW_MS}",
            (ticket_id, self.owner, fence)).fetchone()
        return row is not None

    def release_ticket(self, ticket_id: str) -> None:
        fence = self.fences.pop(ticket_id, None)
        if fence is not None:
            self._conn().execute("UPDATE tickets SET owner='', lease_until_ms=0, cancel_by='' "
                                 "WHERE id=%s AND owner=%s AND fence=%s", (ticket_id, self.owner, fence))

    def request_cancel(self, ticket_id: str, principal: str) -> None:
        self._conn().execute("UPDATE tickets SET cancel_by=%s WHERE id=%s AND cancel_by=''",
                             (principal or "unknown", ticket_id))

    # tickets
    def create_ticket(self, ticket: TicketRecord, nodes: list[NodeRunRecord],
                      first_events: list[EventRecord]) -> TicketRecord:
        try:
            return self._create_ticket(ticket, nodes, first_events)
        except psycopg.errors.UniqueViolation:
            # Run again after a lost connection (store_retry.py): the first try may have committed.
            row = self._conn().execute("SELECT rowid FROM tickets WHERE id=%s", (ticket.id,)).fetchone()
            if not self._retry.retried or row is None:
                raise
            ticket.rowid = int(row[0])
            return ticket

    def _create_ticket(self, ticket: TicketRecord, nodes: list[NodeRunRecord],
                       first_events: list[EventRecord]) -> TicketRecord:
        db = self._conn()
        with db.transaction(), db.cursor() as cur:
            cur.execute(
                "INSERT INTO tickets (id, workspace, workflow, title, body, inputs_json, state, "
                "created_at_ms, updated_at_ms, principal, origin_json) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s) "
                "RETURNING rowid",
                (ticket.id, ticket.workspace, ticket.workflow, ticket.title, ticket.body,
                 json.dumps(ticket.inputs, sort_keys=True), ticket.state, ticket.created_at_ms,
                 ticket.updated_at_ms, ticket.principal, json.dumps(ticket.origin, sort_keys=True)))
            ticket.rowid = int(_one(cur.fetchone())[0])
            if nodes:
                cur.executemany(
                    "INSERT INTO node_runs (ticket_id, node_id, ord, kind, state, needs_json) "
                    "VALUES (%s,%s,%s,%s,%s,%s)",
                    [(n.ticket_id, n.node_id, i, n.kind, n.state, json.dumps(list(n.needs)))
                     for i, n in enumerate(nodes)])
            insert_events(cur, first_events)
        return ticket

    def get_ticket(self, ticket_id: str) -> TicketRecord | None:
        row = self._conn().execute(f"SELECT {_TICKET_COLS} FROM tickets WHERE id=%s", (ticket_id,)).fetchone()
        return _ticket(row) if row else None

    def list_tickets(self, states: list[str] | None = None, workspace: str | None = None,
                     limit: int = 50, before_rowid: int | None = None) -> list[TicketRecord]:
        where: list[str] = []
        args: list[object] = []
        if states:
            where.append("state = ANY(%s)")
            args.append(list(states))
        if workspace:
            where.append("workspace=%s")
            args.append(workspace)
        if before_rowid is not None:
            where.append("rowid<%s")
            args.append(before_rowid)
        sql = f"SELECT {_TICKET_COLS} FROM tickets"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY rowid DESC LIMIT %s"
        args.append(limit)
        return [_ticket(r) for r in self._conn().execute(sql, args)]

    def update_ticket(self, ticket_id: str, **fields: object) -> None:
        bad = set(fields) - _TICKET_FIELDS
        if bad:
            raise ValueError(f"not updatable: {sorted(bad)}")
        if "torn_down" in fields:
            fields["torn_down"] = bool(fields["torn_down"])
        cols = ", ".join(f"{k}=%s" for k in fields)
        self._write(ticket_id, f"UPDATE tickets SET {cols} WHERE id=%s", [*fields.values(), ticket_id])

    def tickets_in_states(self, states: tuple[str, ...] = LIVE) -> list[TicketRecord]:
        sql = f"SELECT {_TICKET_COLS} FROM tickets WHERE state = ANY(%s) ORDER BY rowid"
        return [_ticket(r) for r in self._conn().execute(sql, (list(states),))]

    def count_by_state(self) -> dict[str, int]:
        rows = self._conn().execute("SELECT state, COUNT(*) FROM tickets GROUP BY state")
        return {state: int(n) for state, n in rows}

    def terminal_not_torn_down(self) -> list[TicketRecord]:
        sql = f"SELECT {_TICKET_COLS} FROM tickets WHERE NOT torn_down AND state = ANY(%s) ORDER BY rowid"
        return [_ticket(r) for r in self._conn().execute(sql, (sorted(TERMINAL),))]

    # node runs
    def node_runs(self, ticket_id: str) -> list[NodeRunRecord]:
        rows = self._conn().execute(
            "SELECT ticket_id, node_id, kind, state, needs_json, attempt, started_at_ms, "
            "finished_at_ms, output, error, rounds, feedback FROM node_runs WHERE ticket_id=%s ORDER BY ord", (ticket_id,))
        return [NodeRunRecord(ticket_id=r[0], node_id=r[1], kind=r[2], state=r[3],
                              needs=tuple(json.loads(r[4])), attempt=r[5], started_at_ms=r[6],
                              finished_at_ms=r[7], output=r[8], error=r[9], rounds=r[10], feedback=r[11])
                for r in rows]

    def update_node(self, ticket_id: str, node_id: str, **fields: object) -> None:
        bad = set(fields) - _NODE_FIELDS
        if bad:
            raise ValueError(f"not updatable: {sorted(bad)}")
        cols = ", ".join(f"{k}=%s" for k in fields)
        self._write(ticket_id, f"UPDATE node_runs SET {cols} WHERE ticket_id=%s AND node_id=%s",
                    [*fields.values(), ticket_id, node_id])

    # events
    def append_events(self, events: list[EventRecord]) -> None:
        if not events:
            return
        db = self._conn()
        with db.transaction(), db.cursor() as cur:
            for tid in {ev[0] for ev in events}:
                fence = self.fences.get(tid)
                if fence is not None:
                    self._check(cur, tid, fence)
            insert_events(cur, events)

    def events(self, ticket_id: str, from_seq: int, limit: int = 1000) -> list[EventRecord]:
        rows = self._conn().execute(
            "SELECT ticket_id, seq, type, payload_json, at_ms FROM events "
            "WHERE ticket_id=%s AND seq>=%s ORDER BY seq LIMIT %s", (ticket_id, from_seq, limit))
        return [EventRecord(*r) for r in rows]

    def last_seq(self, ticket_id: str) -> int:
        row = self._conn().execute("SELECT last_seq FROM event_counters WHERE ticket_id=%s",
                                   (ticket_id,)).fetchone()
        return int(row[0]) if row else 0

    # approvals and pull requests
    def add_approval(self, approval: ApprovalRecord) -> None:
        self._conn().execute(
            "INSERT INTO approvals (ticket_id, principal, sha, granted, at_ms, reason, accepted_harness) "
            "VALUES (%s,%s,%s,%s,%s,%s,%s)",
            (approval.ticket_id, approval.principal, approval.sha, bool(approval.granted),
             approval.at_ms, approval.reason, json.dumps(approval.accepted_harness_change)))

    def latest_approval(self, ticket_id: str) -> ApprovalRecord | None:
        row = self._conn().execute(
            "SELECT ticket_id, principal, sha, granted, at_ms, reason, accepted_harness FROM approvals "
            "WHERE ticket_id=%s ORDER BY id DESC LIMIT 1", (ticket_id,)).fetchone()
        if not row:
            return None
        return ApprovalRecord(ticket_id=row[0], principal=row[1], sha=row[2], granted=bool(row[3]),
                              at_ms=row[4], reason=row[5],
                              accepted_harness_change=str_list(row[6]))

    def put_pr(self, pr: PullRequestRecord) -> None:
        self._write(
            pr.ticket_id,
            "INSERT INTO pull_requests (ticket_id, number, url, head_branch, base_branch, head_sha, "
            "state, merge_sha) VALUES (%s,%s,%s,%s,%s,%s,%s,%s) ON CONFLICT (ticket_id) DO UPDATE SET "
            "number=excluded.number, url=excluded.url, head_branch=excluded.head_branch, "
            "base_branch=excluded.base_branch, head_sha=excluded.head_sha, state=excluded.state, "
            "merge_sha=excluded.merge_sha",
            (pr.ticket_id, pr.number, pr.url, pr.head_branch, pr.base_branch, pr.head_sha, pr.state,
             pr.merge_sha))

    def get_pr(self, ticket_id: str) -> PullRequestRecord | None:
        row = self._conn().execute(
            "SELECT ticket_id, number, url, head_branch, base_branch, head_sha, state, merge_sha "
            "FROM pull_requests WHERE ticket_id=%s", (ticket_id,)).fetchone()
        return PullRequestRecord(*row) if row else None


    # records that outlive the ticket
    def put_final_diff(self, ticket_id: str, diff: str, truncated: bool, at_ms: int) -> None:
        self._write(
            ticket_id,
            "INSERT INTO ticket_diffs (ticket_id, diff, truncated, at_ms) VALUES (%s,%s,%s,%s) "
            "ON CONFLICT (ticket_id) DO UPDATE SET diff=excluded.diff, truncated=excluded.truncated, "
            "at_ms=excluded.at_ms", (ticket_id, diff, bool(truncated), at_ms))

    def final_diff(self, ticket_id: str) -> tuple[str, bool] | None:
        row = self._conn().execute("SELECT diff, truncated FROM ticket_diffs WHERE ticket_id=%s",
                              (ticket_id,)).fetchone()
        return (row[0], bool(row[1])) if row else None


retried_methods(PostgresStore, Store)
