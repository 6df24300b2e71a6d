"""The store's schema as afe 0.1's ten hand-written migrations left it on
PostgreSQL (SQLite's had no lease columns and no event_counters: migrate.py
adds them to such a database before stamping it with this revision).

Revision ID: 0001
Revises:
Created: 2026-12-07

Released: never edit; a change of the schema is a new revision. Written once
for SQLite and PostgreSQL (the types of store/schema.py at this revision).
"""

from __future__ import annotations

import importlib.metadata
import time

import sqlalchemy as sa
from alembic import op

# The version an afe before Alembic reads in schema_version (and SQLite's PRAGMA user_version): past
# its 10, so it refuses this database and names the release that wrote it instead of migrating it.
SCHEMA_VERSION = 11

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('ci_failures',
    sa.Column('ticket_id', sa.Text(), nullable=False),
    sa.Column('sha', sa.Text(), nullable=False),
    sa.Column('checks', sa.Text(), nullable=False),
    sa.Column('at_ms', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.PrimaryKeyConstraint('ticket_id', 'sha')
    )
    op.create_table('event_counters',
    sa.Column('ticket_id', sa.Text(), nullable=False),
    sa.Column('last_seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.PrimaryKeyConstraint('ticket_id')
    )
    op.create_table('events',
    sa.Column('ticket_id', sa.Text(), nullable=False),
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('type', sa.Text(), nullable=False),
    sa.Column('payload_json', sa.Text(), nullable=False),
    sa.Column('at_ms', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.PrimaryKeyConstraint('ticket_id', 'seq'),
    sqlite_with_rowid=False
    )
    op.create_table('github_once',
    sa.Column('key', sa.Text(), nullable=False),
    sa.Column('at_ms', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.PrimaryKeyConstraint('key')
    )
    op.create_table('github_poll_cursors',
    sa.Column('workspace', sa.Text(), nullable=False),
    sa.Column('etag', sa.Text(), nullable=False),
    sa.Column('last_event_id', sa.Text(), nullable=False),
    sa.Column('updated_at_ms', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('next_poll_ms', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), server_default=sa.text('0'), nullable=False),
    sa.PrimaryKeyConstraint('workspace')
    )
    op.create_table('github_reports',
    sa.Column('ticket_id', sa.Text(), nullable=False),
    sa.Column('step', sa.Text(), nullable=False),
    sa.Column('comment_id', sa.Text(), nullable=False),
    sa.Column('digest', sa.Text(), nullable=False),
    sa.Column('at_ms', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.PrimaryKeyConstraint('ticket_id', 'step')
    )
    op.create_table('github_work',
    sa.Column('repo', sa.Text(), nullable=False),
    sa.Column('number', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('trigger_name', sa.Text(), nullable=False),
    sa.Column('claim', sa.Text(), nullable=False),
    sa.Column('ticket_id', sa.Text(), server_default=sa.text("''"), nullable=False),
    sa.Column('claimed_at_ms', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.PrimaryKeyConstraint('repo', 'number', 'trigger_name')
    )
    op.create_table('run_records',
    sa.Column('ticket_id', sa.Text(), nullable=False),
    sa.Column('sha', sa.Text(), nullable=False),
    sa.Column('kind', sa.Text(), nullable=False),
    sa.Column('envelope', sa.Text(), nullable=False),
    sa.Column('at_ms', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.PrimaryKeyConstraint('ticket_id', 'sha', 'kind')
    )
    op.create_table('sandbox_placements',
    sa.Column('ticket_id', sa.Text(), nullable=False),
    sa.Column('broker', sa.Text(), nullable=False),
    sa.Column('at_ms', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.PrimaryKeyConstraint('ticket_id')
    )
    op.create_table('schema_version',
    sa.Column('version', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('afe_version', sa.Text(), nullable=False),
    sa.Column('applied_at_ms', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.PrimaryKeyConstraint('version')
    )
    op.create_table('tickets',
    sa.Column('rowid', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), sa.Identity(always=True), nullable=False),
    sa.Column('id', sa.Text(), nullable=False),
    sa.Column('workspace', sa.Text(), nullable=False),
    sa.Column('workflow', sa.Text(), nullable=False),
    sa.Column('title', sa.Text(), nullable=False),
    sa.Column('body', sa.Text(), nullable=False),
    sa.Column('inputs_json', sa.Text(), nullable=False),
    sa.Column('state', sa.Text(), nullable=False),
    sa.Column('created_at_ms', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('updated_at_ms', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('principal', sa.Text(), server_default=sa.text("''"), nullable=False),
    sa.Column('error', sa.Text(), server_default=sa.text("''"), nullable=False),
    sa.Column('tokens_used', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), server_default=sa.text('0'), nullable=False),
    sa.Column('awaiting_sha', sa.Text(), server_default=sa.text("''"), nullable=False),
    sa.Column('torn_down', sa.Boolean().with_variant(sa.Integer(), 'sqlite'), server_default=sa.text("'0'"), nullable=False),
    sa.Column('owner', sa.Text(), server_default=sa.text("''"), nullable=False),
    sa.Column('lease_until_ms', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), server_default=sa.text('0'), nullable=False),
    sa.Column('origin_json', sa.Text(), server_default=sa.text("'{}'"), nullable=False),
    sa.Column('reopened_at_ms', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), server_default=sa.text('0'), nullable=False),
    sa.Column('fence', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), server_default=sa.text('0'), nullable=False),
    sa.Column('cancel_by', sa.Text(), server_default=sa.text("''"), nullable=False),
    sa.PrimaryKeyConstraint('rowid'),
    sa.UniqueConstraint('id'),
    sqlite_autoincrement=True
    )
    with op.batch_alter_table('tickets', schema=None) as batch_op:
        batch_op.create_index('tickets_lease', ['state', 'lease_until_ms'], unique=False)
        batch_op.create_index('tickets_state', ['state', 'rowid'], unique=False)

    op.create_table('verification_runs',
    sa.Column('ticket_id', sa.Text(), nullable=False),
    sa.Column('sha', sa.Text(), nullable=False),
    sa.Column('base_sha', sa.Text(), nullable=False),
    sa.Column('config', sa.Text(), nullable=False),
    sa.Column('kind', sa.Text(), nullable=False),
    sa.Column('passed', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('result', sa.Text(), nullable=False),
    sa.Column('at_ms', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.PrimaryKeyConstraint('ticket_id', 'sha', 'base_sha', 'config', 'kind')
    )
    op.create_table('approvals',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), sa.Identity(always=True), nullable=False),
    sa.Column('ticket_id', sa.Text(), nullable=False),
    sa.Column('principal', sa.Text(), nullable=False),
    sa.Column('sha', sa.Text(), nullable=False),
    sa.Column('granted', sa.Boolean().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('at_ms', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('reason', sa.Text(), server_default=sa.text("''"), nullable=False),
    sa.Column('accepted_harness', sa.Text(), server_default=sa.text("'[]'"), nullable=False),
    sa.ForeignKeyConstraint(['ticket_id'], ['tickets.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sqlite_autoincrement=True
    )
    with op.batch_alter_table('approvals', schema=None) as batch_op:
        batch_op.create_index('approvals_ticket', ['ticket_id', 'id'], unique=False)

    op.create_table('node_runs',
    sa.Column('ticket_id', sa.Text(), nullable=False),
    sa.Column('node_id', sa.Text(), nullable=False),
    sa.Column('ord', sa.Integer(), nullable=False),
    sa.Column('kind', sa.Text(), nullable=False),
    sa.Column('state', sa.Text(), nullable=False),
    sa.Column('needs_json', sa.Text(), nullable=False),
    sa.Column('attempt', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('started_at_ms', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), server_default=sa.text('0'), nullable=False),
    sa.Column('finished_at_ms', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), server_default=sa.text('0'), nullable=False),
    sa.Column('output', sa.Text(), server_default=sa.text("''"), nullable=False),
    sa.Column('error', sa.Text(), server_default=sa.text("''"), nullable=False),
    sa.Column('rounds', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('feedback', sa.Text(), server_default=sa.text("''"), nullable=False),
    sa.ForeignKeyConstraint(['ticket_id'], ['tickets.id'], ),
    sa.PrimaryKeyConstraint('ticket_id', 'node_id')
    )
    op.create_table('pull_requests',
    sa.Column('ticket_id', sa.Text(), nullable=False),
    sa.Column('number', sa.Text(), nullable=False),
    sa.Column('url', sa.Text(), nullable=False),
    sa.Column('head_branch', sa.Text(), nullable=False),
    sa.Column('base_branch', sa.Text(), nullable=False),
    sa.Column('head_sha', sa.Text(), nullable=False),
    sa.Column('state', sa.Text(), nullable=False),
    sa.Column('merge_sha', sa.Text(), server_default=sa.text("''"), nullable=False),
    sa.ForeignKeyConstraint(['ticket_id'], ['tickets.id'], ),
    sa.PrimaryKeyConstraint('ticket_id')
    )
    op.create_table('ticket_diffs',
    sa.Column('ticket_id', sa.Text(), nullable=False),
    sa.Column('diff', sa.Text(), nullable=False),
    sa.Column('truncated', sa.Boolean().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('at_ms', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.ForeignKeyConstraint(['ticket_id'], ['tickets.id'], ),
    sa.PrimaryKeyConstraint('ticket_id')
    )
    op.create_table('ticket_followups',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('ticket_id', sa.Text(), nullable=False),
    sa.Column('at_ms', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('author', sa.Text(), nullable=False),
    sa.Column('source', sa.Text(), nullable=False),
    sa.Column('text', sa.Text(), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('line', sa.Integer(), nullable=False),
    sa.Column('url', sa.Text(), nullable=False),
    sa.Column('state', sa.Text(), server_default=sa.text("'given'"), nullable=False),
    sa.ForeignKeyConstraint(['ticket_id'], ['tickets.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sqlite_autoincrement=True
    )
    with op.batch_alter_table('ticket_followups', schema=None) as batch_op:
        batch_op.create_index('ticket_followups_pending', ['ticket_id'], unique=False, postgresql_where=sa.text("state = 'pending'"), sqlite_where=sa.text("state = 'pending'"))
        batch_op.create_index('ticket_followups_ticket', ['ticket_id', 'at_ms'], unique=False)

    mark_schema_version(op.get_bind())


def mark_schema_version(conn: sa.Connection) -> None:
    """Record SCHEMA_VERSION where an afe before Alembic looks (migrate.py also calls this when it
    adopts a database those releases made)."""
    try:
        release = importlib.metadata.version("afe")
    except importlib.metadata.PackageNotFoundError:
        release = "unknown"
    table = sa.table("schema_version", sa.column("version"), sa.column("afe_version"),
                     sa.column("applied_at_ms"))
    conn.execute(sa.delete(table).where(table.c.version == SCHEMA_VERSION))
    conn.execute(sa.insert(table).values(version=SCHEMA_VERSION, afe_version=release,
                                         applied_at_ms=time.time_ns() // 1_000_000))
    if conn.dialect.name == "sqlite":
        conn.exec_driver_sql(f"PRAGMA user_version={SCHEMA_VERSION}")


def downgrade() -> None:
    raise NotImplementedError("afe's store migrations go forward only: restore a backup to go back")
