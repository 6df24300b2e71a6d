"""The scheduler's store from AFE_DATABASE_URL (read by
services/common/config/database_url.py): opened and migrated
(`open_store`), or its schema compared with this afe's, changing nothing
(`check_database`, for the pre-flight checks of `afe check` and `afe up`,
run as `python -m services.scheduler.store.schemacheck`)."""

from __future__ import annotations

import sqlite3

import sqlalchemy

from services.common.config.database_url import ENV, DatabaseTarget
from services.common.errors import FailedPrecondition

from .store import Store


def open_store(target: DatabaseTarget) -> Store:
    """The store for `target`: migrated to this afe's schema, or an error that
    says what to change."""
    if target.backend == "postgresql":
        return Store.postgresql(target.conninfo, target.where)
    assert target.path is not None
    return Store.sqlite(target.path)


def check_database(target: DatabaseTarget) -> str:
    """Connect and compare the database's schema with this afe's, changing
    nothing. Returns a line for `afe check`; raises an AfeError that says
    what to change (unreachable, refused login, newer schema)."""
    from . import migrate
    from .database import Database

    if target.backend == "postgresql":
        db = Database.postgresql(target.conninfo, target.where)
    else:
        assert target.path is not None
        if not target.path.exists():
            return f"{target.where}: not created yet; `afe up` creates it (schema {migrate.head()})"
        try:
            db = Database.sqlite_read_only(target.path)
        except sqlalchemy.exc.DBAPIError:
            raise FailedPrecondition(f"{target.where} cannot be read as a SQLite database: point "
                                     f"{ENV} at afe's store file, or move this file away") from None
    db.where = target.where
    try:
        return migrate.check(db)
    except sqlalchemy.exc.DBAPIError as exc:
        if isinstance(exc.orig, sqlite3.Error):
            raise FailedPrecondition(f"{target.where} cannot be read as a SQLite database: point "
                                     f"{ENV} at afe's store file, or move this file away") from None
        raise
    finally:
        db.close()
