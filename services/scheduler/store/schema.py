"""Every table of the scheduler's store, once, as SQLAlchemy Core `Table`s on
one `MetaData` (`metadata`): the schema the Alembic migrations leave at their
head (store/alembic/), the same tables on SQLite and on PostgreSQL.

Types are written once; where the two databases name a column differently
the type says so (`with_variant`): milliseconds and counters are BIGINT on
PostgreSQL and INTEGER on SQLite (the same 64-bit integer there), flags are
BOOLEAN on PostgreSQL and INTEGER 0/1 on SQLite, as since each database's
first schema. The repositories (tickets.py, events.py, leases.py and the
records modules) run their statements on these tables only; no SQL text is
written per dialect.

Columns with a default carry it as a server default, so a row inserted by a
statement that names fewer columns (or by an older afe) gets it.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    text,
)

# The integer of a time in ms, a count or a fence: BIGINT on PostgreSQL, INTEGER (64-bit) on SQLite.
Ms = BigInteger().with_variant(Integer(), "sqlite")
# A flag: BOOLEAN on PostgreSQL, INTEGER 0/1 on SQLite (read back with bool()).
Flag = Boolean().with_variant(Integer(), "sqlite")


def _text(name: str, default: str | None = None, **kw: object) -> Column[Any]:
    if default is None:
        return Column(name, Text, nullable=False, **kw)  # type: ignore[arg-type]
    return Column(name, Text, nullable=False, server_default=text(f"'{default}'"), **kw)  # type: ignore[arg-type]


def _int(name: str, type_: object = Integer, default: int | None = None) -> Column[Any]:
    if default is None:
        return Column(name, type_, nullable=False)  # type: ignore[arg-type]
    return Column(name, type_, nullable=False, server_default=text(str(default)))  # type: ignore[arg-type]


def _flag(name: str, default: bool | None = None) -> Column[Any]:
    if default is None:
        return Column(name, Flag, nullable=False)
    # FALSE/TRUE on PostgreSQL, 0/1 on SQLite: one literal both accept as the column's type
    return Column(name, Flag, nullable=False, server_default=text("'1'" if default else "'0'"))


metadata = MetaData()

# Which afe release wrote each schema version of the hand-written migrations (1..10) and of the
# first Alembic revision (11): an older afe that meets this database names the release it needs.
schema_version = Table(
    "schema_version", metadata,
    Column("version", Integer, primary_key=True, autoincrement=False),
    _text("afe_version"),
    _int("applied_at_ms", Ms),
)

# A ticket. owner / lease_until_ms / fence: the scheduler that drives it, until when (the database's
# clock, ms) and the fencing token every claim bumps (R37, R45); cancel_by: a cancel asked of a scheduler
# that does not drive it. origin_json: where it came from and which texts are untrusted (R36).
tickets = Table(
    "tickets", metadata,
    Column("rowid", Ms, Identity(always=True), primary_key=True),
    Column("id", Text, nullable=False, unique=True),
    _text("workspace"),
    _text("workflow"),
    _text("title"),
    _text("body"),
    _text("inputs_json"),
    _text("state"),
    _int("created_at_ms", Ms),
    _int("updated_at_ms", Ms),
    _text("principal", ""),
    _text("error", ""),
    _int("tokens_used", Ms, 0),
    _text("awaiting_sha", ""),
    _flag("torn_down", False),
    _text("owner", ""),
    _int("lease_until_ms", Ms, 0),
    _text("origin_json", "{}"),
    _int("reopened_at_ms", Ms, 0),
    _int("fence", Ms, 0),
    _text("cancel_by", ""),
    sqlite_autoincrement=True,
)
Index("tickets_state", tickets.c.state, tickets.c.rowid)
Index("tickets_lease", tickets.c.state, tickets.c.lease_until_ms)

node_runs = Table(
    "node_runs", metadata,
    Column("ticket_id", Text, ForeignKey("tickets.id"), nullable=False),
    _text("node_id"),
    _int("ord"),
    _text("kind"),
    _text("state"),
    _text("needs_json"),
    _int("attempt", Integer, 0),
    _int("started_at_ms", Ms, 0),
    _int("finished_at_ms", Ms, 0),
    _text("output", ""),
    _text("error", ""),
    _int("rounds", Integer, 0),
    _text("feedback", ""),
    PrimaryKeyConstraint("ticket_id", "node_id"),
)

# A ticket's events, seq 1..n with no gap; event_counters holds each ticket's last stored seq, moved
# forward by every batch under its row lock (events.py).
events = Table(
    "events", metadata,
    _text("ticket_id"),
    _int("seq", Ms),
    _text("type"),
    _text("payload_json"),
    _int("at_ms", Ms),
    PrimaryKeyConstraint("ticket_id", "seq"),
    sqlite_with_rowid=False,
)

event_counters = Table(
    "event_counters", metadata,
    Column("ticket_id", Text, primary_key=True),
    _int("last_seq", Ms),
)

# Events a lost attempt could not store (R45): the old owner's report (its fence, how many), which the
# new owner takes and says as `events.lost` (revision 0002).
lost_events = Table(
    "lost_events", metadata,
    _text("ticket_id"),
    _int("fence", Ms),
    _int("count", Ms),
    _int("at_ms", Ms),
    PrimaryKeyConstraint("ticket_id", "fence"),
)

approvals = Table(
    "approvals", metadata,
    Column("id", Ms, Identity(always=True), primary_key=True),
    Column("ticket_id", Text, ForeignKey("tickets.id"), nullable=False),
    _text("principal"),
    _text("sha"),
    _flag("granted"),
    _int("at_ms", Ms),
    _text("reason", ""),
    _text("accepted_harness", "[]"),     # the harness files (JSON list) the person acknowledged (R41)
    sqlite_autoincrement=True,
)
Index("approvals_ticket", approvals.c.ticket_id, approvals.c.id)

pull_requests = Table(
    "pull_requests", metadata,
    Column("ticket_id", Text, ForeignKey("tickets.id"), primary_key=True),
    _text("number"),
    _text("url"),
    _text("head_branch"),
    _text("base_branch"),
    _text("head_sha"),
    _text("state"),
    _text("merge_sha", ""),
)

# Keys that take effect once only (a webhook delivery id, R35; a polled event id; a refusal comment).
github_once = Table(
    "github_once", metadata,
    Column("key", Text, primary_key=True),
    _int("at_ms", Ms),
)

github_poll_cursors = Table(
    "github_poll_cursors", metadata,
    Column("workspace", Text, primary_key=True),
    _text("etag"),
    _text("last_event_id"),
    _int("updated_at_ms", Ms),
    _int("next_poll_ms", Ms, 0),
)

ticket_diffs = Table(
    "ticket_diffs", metadata,
    Column("ticket_id", Text, ForeignKey("tickets.id"), primary_key=True),
    _text("diff"),
    _flag("truncated"),
    _int("at_ms", Ms),
)

# state: given (an instruction of the re-run since at_ms), pending (waits for the next re-open),
# dropped (that re-open was refused for good).
ticket_followups = Table(
    "ticket_followups", metadata,
    Column("id", Ms, primary_key=True, autoincrement=True),
    Column("ticket_id", Text, ForeignKey("tickets.id"), nullable=False),
    _int("at_ms", Ms),
    _text("author"),
    _text("source"),
    _text("text"),
    _text("path"),
    _int("line"),
    _text("url"),
    _text("state", "given"),
    sqlite_autoincrement=True,
)
Index("ticket_followups_ticket", ticket_followups.c.ticket_id, ticket_followups.c.at_ms)
Index("ticket_followups_pending", ticket_followups.c.ticket_id,
      postgresql_where=text("state = 'pending'"), sqlite_where=text("state = 'pending'"))

github_reports = Table(
    "github_reports", metadata,
    _text("ticket_id"),
    _text("step"),
    _text("comment_id"),
    _text("digest"),
    _int("at_ms", Ms),
    PrimaryKeyConstraint("ticket_id", "step"),
)

# The sandbox broker that holds the sandbox of a ticket or of a warm sandbox's reserved id (so no
# reference to tickets).
sandbox_placements = Table(
    "sandbox_placements", metadata,
    Column("ticket_id", Text, primary_key=True),
    _text("broker"),
    _int("at_ms", Ms),
)

# The claim of (repository, issue number, Trigger) on its one live ticket (github/intake.py).
github_work = Table(
    "github_work", metadata,
    _text("repo"),
    _int("number", Ms),
    _text("trigger_name"),
    _text("claim"),
    _text("ticket_id", ""),
    _int("claimed_at_ms", Ms),
    PrimaryKeyConstraint("repo", "number", "trigger_name"),
)

# The signed run record of a head (R42): kind 'request' or 'decision'.
run_records = Table(
    "run_records", metadata,
    _text("ticket_id"),
    _text("sha"),
    _text("kind"),
    _text("envelope"),
    _int("at_ms", Ms),
    PrimaryKeyConstraint("ticket_id", "sha", "kind"),
)

# A failing CI head of a ticket's pull request taken as a follow-up: one row per (ticket, head).
ci_failures = Table(
    "ci_failures", metadata,
    _text("ticket_id"),
    _text("sha"),
    _text("checks"),
    _int("at_ms", Ms),
    PrimaryKeyConstraint("ticket_id", "sha"),
)

# Clean-room verifications (R41): one row per (ticket, head, base tip, verify: config, kind).
verification_runs = Table(
    "verification_runs", metadata,
    _text("ticket_id"),
    _text("sha"),
    _text("base_sha"),
    _text("config"),
    _text("kind"),
    _int("passed", Ms),
    _text("result"),
    _int("at_ms", Ms),
    PrimaryKeyConstraint("ticket_id", "sha", "base_sha", "config", "kind"),
)
