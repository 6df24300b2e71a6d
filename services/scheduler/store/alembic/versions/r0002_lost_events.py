"""lost_events: how many events a lost attempt of a ticket could not store,
reported by its old owner (unfenced, like a cancel request) and taken by the
new owner, who says it in an `events.lost` event (R45, issue 32).

Revision ID: 0002
Revises: 0001
Created: 2026-12-07

Released: never edit; a change of the schema is a new revision. Written once
for SQLite and PostgreSQL (the types of store/schema.py at this revision).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    big = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    op.create_table(
        "lost_events",
        sa.Column("ticket_id", sa.Text(), nullable=False),
        sa.Column("fence", big, nullable=False),
        sa.Column("count", big, nullable=False),
        sa.Column("at_ms", big, nullable=False),
        sa.PrimaryKeyConstraint("ticket_id", "fence"),
    )


def downgrade() -> None:
    raise NotImplementedError("afe's store migrations go forward only: restore a backup to go back")
