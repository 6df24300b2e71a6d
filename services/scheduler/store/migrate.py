"""The store's schema: Alembic migrations (store/alembic/versions/), run when
the store opens, on SQLite and PostgreSQL alike.

`migrate` brings the database to this afe's head revision in one
transaction (PostgreSQL: under an advisory lock, so schedulers starting
together migrate once):

- empty: every revision from the first;
- made by Alembic: the revisions past the one recorded in `alembic_version`;
  a revision this afe does not know (a newer afe migrated it) is refused
  with the release that wrote it;
- made by an afe before Alembic (a `schema_version` table, the ten
  hand-written migrations per database): at version 10 it is adopted with
  nothing lost: on SQLite the lease columns, `event_counters` (from the
  stored events) and two indexes that only PostgreSQL had are added; the
  database is stamped with the first revision, which is exactly that
  schema, and the later ones run. Any other version is refused with what to
  do.

`schema_version` gets version 11 (and SQLite's `PRAGMA user_version`), so an
afe before Alembic refuses the database and names the release it needs.
`check` reads where a database stands without changing it (`afe check`).
"""

from __future__ import annotations

import importlib.metadata
import logging
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.operations import Operations
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection

from services.common.errors import FailedPrecondition

from .database import Database

log = logging.getLogger(__name__)

SCRIPTS = Path(__file__).with_name("alembic")
MIGRATION_LOCK = 0x61666531   # pg_advisory_xact_lock key ("afe1") held while migrating
LEGACY_LAST = 10              # the last hand-written migration; a database there is adopted
BASELINE = "0001"             # the revision that is the schema LEGACY_LAST left on PostgreSQL


def afe_version() -> str:
    """This afe's release."""
    try:
        return importlib.metadata.version("afe")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _config(conn: Connection) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPTS))
    cfg.attributes["connection"] = conn
    return cfg


def scripts() -> ScriptDirectory:
    return ScriptDirectory(str(SCRIPTS))


def head() -> str:
    rev = scripts().get_current_head()
    assert rev is not None
    return rev


def newer_schema_message(what: str, found: str, needed: str | None) -> str:
    release = f"afe {needed} or later" if needed else "a newer afe"
    return (f"{what} has schema {found}, newer than this afe ({afe_version()}, schema {head()}) knows: it was "
            f"upgraded by {release}. Run {release}, or point AFE_DATABASE_URL at another database")


def state(conn: Connection) -> tuple[str, Any]:
    """Where the database stands: ("empty", None), ("alembic", revision) or
    ("legacy", the hand-written migrations' version)."""
    names = set(sa.inspect(conn).get_table_names())
    if "alembic_version" in names:
        return "alembic", MigrationContext.configure(conn).get_current_revision()
    if conn.dialect.name == "sqlite":
        version = int(conn.exec_driver_sql("PRAGMA user_version").scalar() or 0)
        if version:
            return "legacy", version
    if "schema_version" in names:
        return "legacy", int(conn.execute(sa.text("SELECT COALESCE(MAX(version), 0) FROM schema_version"))
                             .scalar() or 0)
    if "tickets" in names:
        return "legacy", 0
    return "empty", None


def _release_of(conn: Connection) -> str | None:
    """The afe release recorded for the newest schema_version row, if there is the table."""
    if "schema_version" not in set(sa.inspect(conn).get_table_names()):
        return None
    return conn.execute(sa.text("SELECT afe_version FROM schema_version ORDER BY version DESC LIMIT 1")).scalar()


def migrate(db: Database) -> None:
    """Bring the database to this afe's head revision (see the module's text)."""
    with db.engine.connect() as conn:
        conn.info["write"] = True                  # SQLite: BEGIN IMMEDIATE, one migrator at a time
        with conn.begin():
            if conn.dialect.name == "postgresql":
                # Another scheduler's migration may take longer than the sessions' lock_timeout
                # (database.PG_SESSION_DEFAULTS): wait for it, and let a long one run here.
                conn.execute(sa.text("SET LOCAL lock_timeout = 0"))
                conn.execute(sa.text("SET LOCAL idle_in_transaction_session_timeout = 0"))
                conn.execute(sa.select(sa.func.pg_advisory_xact_lock(MIGRATION_LOCK)))
            kind, found = state(conn)
            cfg = _config(conn)
            if kind == "legacy":
                _adopt(conn, cfg, found, db.where)
            elif kind == "alembic" and found is not None and found not in _known():
                raise FailedPrecondition(newer_schema_message(db.where, str(found), _release_of(conn)))
            elif kind == "empty":
                log.info("store: creating the schema in %s", db.where)
            command.upgrade(cfg, "head")


def _known() -> set[str]:
    return {rev.revision for rev in scripts().walk_revisions()}


def _adopt(conn: Connection, cfg: Config, version: int, where: str) -> None:
    """A database of the hand-written migrations at LEGACY_LAST becomes the baseline revision."""
    if version > LEGACY_LAST:
        raise FailedPrecondition(newer_schema_message(where, f"version {version}", _release_of(conn)))
    if version < LEGACY_LAST:
        raise FailedPrecondition(
            f"{where} has schema version {version} of afe's hand-written migrations; this afe adopts only "
            f"version {LEGACY_LAST}. Open it once with an afe release from before the Alembic migrations "
            "(any afe 0.1.0 build that has services/scheduler/store/migrations/*/0010_*.sql), which migrates "
            "it to version 10, then with this afe")
    log.info("store: adopting %s (schema version %s of the hand-written migrations) as revision %s",
             where, version, BASELINE)
    if conn.dialect.name == "sqlite":
        _sqlite_catch_up(conn)
    baseline = scripts().get_revision(BASELINE)
    assert baseline is not None
    baseline.module.mark_schema_version(conn)
    command.stamp(cfg, BASELINE)


def _sqlite_catch_up(conn: Connection) -> None:
    """What SQLite's version 10 lacks of the baseline: the lease columns, event_counters (each
    ticket's last stored seq, from its events) and the indexes PostgreSQL's migrations made."""
    op = Operations(MigrationContext.configure(conn))
    big = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    op.add_column("tickets", sa.Column("owner", sa.Text(), server_default=sa.text("''"), nullable=False))
    op.add_column("tickets", sa.Column("lease_until_ms", big, server_default=sa.text("0"), nullable=False))
    op.add_column("tickets", sa.Column("fence", big, server_default=sa.text("0"), nullable=False))
    op.add_column("tickets", sa.Column("cancel_by", sa.Text(), server_default=sa.text("''"), nullable=False))
    op.create_index("tickets_lease", "tickets", ["state", "lease_until_ms"])
    op.create_index("approvals_ticket", "approvals", ["ticket_id", "id"])
    op.create_table("event_counters",
                    sa.Column("ticket_id", sa.Text(), nullable=False),
                    sa.Column("last_seq", big, nullable=False),
                    sa.PrimaryKeyConstraint("ticket_id"))
    conn.execute(sa.text("INSERT INTO event_counters (ticket_id, last_seq) "
                         "SELECT ticket_id, MAX(seq) FROM events GROUP BY ticket_id"))


def check(db: Database) -> str:
    """Where the database stands against this afe's schema, changing nothing: a line
    for `afe check`, or an AfeError that says what to change."""
    target = head()
    if db.dialect == "sqlite" and db.path is not None and not db.path.exists():
        return f"{db.where}: not created yet; `afe up` creates it (schema {target})"
    with db.engine.connect() as conn:
        kind, found = state(conn)
        if kind == "legacy":
            if found > LEGACY_LAST:
                raise FailedPrecondition(newer_schema_message(db.where, f"version {found}", _release_of(conn)))
            if found < LEGACY_LAST:
                raise FailedPrecondition(
                    f"{db.where}: schema version {found} of afe's hand-written migrations; open it once with an "
                    f"afe release from before the Alembic migrations (it migrates it to {LEGACY_LAST}), then "
                    "with this afe")
            return (f"{db.where}: reachable, schema version {found} of the hand-written migrations; `afe up` "
                    f"adopts it and migrates it to {target}")
        if kind == "empty":
            return f"{db.where}: reachable and empty; `afe up` creates the schema ({target})"
        if found == target:
            return f"{db.where}: reachable, schema {found} (current)"
        if found not in _known():
            raise FailedPrecondition(newer_schema_message(db.where, str(found), _release_of(conn)))
        return f"{db.where}: reachable, schema {found}; `afe up` migrates it to {target}"
