"""Opening the PostgreSQL store's database: the connection, the errors a
refused connection becomes, and the schema version found there (also used by
`afe check` and the launcher before a scheduler starts, database_url.py).

The connection string is never logged or put in an error (R29): errors name
the host, port and database only (`where`), and libpq's own text is never
passed on.
"""

from __future__ import annotations

import psycopg

from services.common.errors import FailedPrecondition, Unavailable

from . import migrations

MIGRATIONS: list[str] = migrations.load("postgresql")
SCHEMA_VERSION = len(MIGRATIONS)


def _one(row: tuple | None) -> tuple:
    """The row of a query that always returns one."""
    assert row is not None
    return row


def connect(conninfo: str, where: str) -> psycopg.Connection:
    """An autocommit connection, or an error that says what to change (and
    repeats neither the connection string nor the password)."""
    try:
        return psycopg.connect(conninfo, autocommit=True)
    except psycopg.Error as exc:
        raise connect_error(exc, where) from None


def connect_error(exc: psycopg.Error, where: str) -> Exception:
    """Say what to change. libpq reports a refused login as text (no SQLSTATE
    on the connection error), so the server's FATAL line is classified by its
    words; the text itself is never passed on."""
    text = str(exc)
    fatal = text.partition("FATAL:")[2]
    if ("password authentication failed" in fatal or "no password supplied" in text
            or "authentication failed" in fatal or "no pg_hba.conf entry" in fatal):
        return FailedPrecondition(
            f"AFE_DATABASE_URL: {where} refused the user name or password (the password is not shown): fix "
            "the credentials in AFE_DATABASE_URL, or the server's pg_hba.conf for this host")
    if "does not exist" in fatal and "database" in fatal:
        return FailedPrecondition(
            f"AFE_DATABASE_URL: {where} does not exist on its server: create it (CREATE DATABASE ... OWNER "
            "the user in the URL) or fix the database name in AFE_DATABASE_URL")
    if "permission denied" in fatal:
        return FailedPrecondition(
            f"AFE_DATABASE_URL: the user in the URL may not use {where}: grant it CONNECT, or use the "
            "database's owner")
    if "the database system is" in fatal:
        # starting up, shutting down, in recovery mode, not yet accepting connections: a restart
        return Unavailable(f"AFE_DATABASE_URL: {where} is starting up or shutting down (a restart); try again")
    if fatal:
        return FailedPrecondition(
            f"AFE_DATABASE_URL: {where} refused the connection; its server's log says why")
    return Unavailable(
        f"AFE_DATABASE_URL: cannot reach {where}: check that the server runs and accepts connections from "
        "this machine, and the host and port in AFE_DATABASE_URL")


def schema_state(db: psycopg.Connection) -> tuple[int, str | None]:
    """(the database's schema version, 0 when empty; the afe release that
    first applied a version past this afe's, when there is one)."""
    if _one(db.execute("SELECT to_regclass('schema_version')").fetchone())[0] is None:
        return 0, None
    version = _one(db.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone())[0]
    row = db.execute("SELECT afe_version FROM schema_version WHERE version > %s ORDER BY version LIMIT 1",
                     (SCHEMA_VERSION,)).fetchone()
    return int(version), (row[0] if row else None)


def check_newer(version: int, needed: str | None, where: str) -> None:
    if version > SCHEMA_VERSION:
        raise FailedPrecondition(migrations.newer_schema_message(where, version, SCHEMA_VERSION, needed))


