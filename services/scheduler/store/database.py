"""The store's database: one SQLAlchemy engine and the one connection the
store's thread owns (worker.py), transactions, the database's clock, and the
retries of a statement across a lost or busy database (retry.py).

- SQLite (`sqlite+pysqlite`): WAL, `synchronous=NORMAL`, a busy timeout;
  the driver's own transaction handling is off and every transaction is
  begun here: `BEGIN IMMEDIATE` for a write (it takes the write lock first,
  so a check and the write it guards are one step for every other
  connection), `BEGIN` for a read.
- PostgreSQL (`postgresql+psycopg`, psycopg 3): the connection comes from
  `connect` below, whose errors say what to change and never repeat the
  connection string (R29).

Repositories (tickets.py, events.py, leases.py and repos/) run their
statements inside `Database.transaction`; a repository method called from
inside another one joins the caller's transaction. `retry_methods` wraps a
repository's public methods in the database's `Retrier` (the store does it
for each, store.py), so a transaction is always redone whole.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import FunctionElement

from services.common.errors import FailedPrecondition, Unavailable

from .retry import Retrier, pg_reason, sqlite_reason

log = logging.getLogger(__name__)

T = TypeVar("T")

BUSY_TIMEOUT_MS = 5000   # SQLite's own wait for another connection's lock, before retry.py's


class db_now_ms(FunctionElement[int]):
    """The database's clock in ms (an expression). PostgreSQL: the server's clock, so the hosts' clocks
    do not matter to leases; SQLite: the one machine's clock."""

    type = sa.BigInteger()
    inherit_cache = True


@compiles(db_now_ms, "postgresql")
def _now_pg(element: db_now_ms, compiler: Any, **kw: Any) -> str:
    return "(extract(epoch from clock_timestamp()) * 1000)::bigint"


@compiles(db_now_ms, "sqlite")
def _now_sqlite(element: db_now_ms, compiler: Any, **kw: Any) -> str:
    return "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)"


def connect_error(exc: Exception, where: str) -> Exception:
    """Say what to change about a refused PostgreSQL connection. libpq reports a
    refused login as text (no SQLSTATE), so the server's FATAL line is classified
    by its words; the text itself is never passed on (it may quote the URL)."""
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


# What a database failover needs of a connection, unless AFE_DATABASE_URL says otherwise: a
# server that went away without closing the socket (its address moved to a new primary) is
# noticed within seconds instead of the kernel's hours, a connect to an address that no longer
# answers gives up, and a session frozen inside a transaction (a paused scheduler) cannot hold
# the rows another scheduler needs for longer than a lease. afe's transactions are short and
# never wait on anything but the database. The libpq parameters go in the connection string;
# the session settings are SET once connected (not as the `options` startup parameter, which
# connection poolers such as PgBouncer refuse).
PG_CONNECT_DEFAULTS = {
    "connect_timeout": "5",
    "keepalives": "1",
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "3",
    "tcp_user_timeout": "15000",
}
PG_SESSION_DEFAULTS = {
    "lock_timeout": "30000",                        # a row lock held longer: the holder is stuck
    "idle_in_transaction_session_timeout": "15000",  # a transaction left open by a frozen session
}


def pg_conninfo(conninfo: str) -> tuple[str, dict[str, str]]:
    """`conninfo` with the libpq failover defaults above for what it does not set itself, and
    the session settings to SET once connected (those its `options` do not set)."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    given = conninfo_to_dict(conninfo)
    extra: dict[str, Any] = {k: v for k, v in PG_CONNECT_DEFAULTS.items() if k not in given}
    options = str(given.get("options") or "")
    settings = {k: v for k, v in PG_SESSION_DEFAULTS.items() if k not in options}
    return make_conninfo(conninfo, **extra), settings


def pg_connect(conninfo: str, where: str, autocommit: bool = False) -> Any:
    """A psycopg connection (with `pg_conninfo`'s failover defaults), or an error that
    says what to change (and repeats neither the connection string nor the password)."""
    import psycopg
    from psycopg import sql

    info, settings = pg_conninfo(conninfo)
    try:
        conn = psycopg.connect(info, autocommit=autocommit)
    except psycopg.Error as exc:
        raise connect_error(exc, where) from None
    try:
        for name, value in settings.items():
            conn.execute(sql.SQL("SET {} = {}").format(sql.Identifier(name), sql.Literal(value)))
        if not autocommit:
            conn.commit()
    except BaseException:
        conn.close()        # the server went away meanwhile: the caller's retries classify the error
        raise
    return conn


def _unwrap(classify: Callable[[BaseException, bool], str | None]) -> Callable[[BaseException, bool], str | None]:
    """The driver's error inside SQLAlchemy's wrapper is what retry.py classifies."""
    def reason(exc: BaseException, broken: bool) -> str | None:
        if isinstance(exc, sa.exc.DBAPIError) and exc.orig is not None:
            return classify(exc.orig, broken or bool(exc.connection_invalidated))
        return classify(exc, broken)
    return reason


class Database:
    """An engine and the connection the store's thread owns."""

    def __init__(self, engine: Engine, where: str) -> None:
        self.engine = engine
        self.where = where
        self.dialect: str = engine.dialect.name            # "sqlite" | "postgresql"
        self._conn: Connection | None = None
        classify = pg_reason if self.dialect == "postgresql" else sqlite_reason
        self.retry = Retrier(self.dialect, where, _unwrap(classify), self._reset, self._broken)

    @classmethod
    def sqlite(cls, path: str | os.PathLike[str]) -> Database:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(
            f"sqlite+pysqlite:///{p}",
            connect_args={"check_same_thread": False, "isolation_level": None}, poolclass=sa.pool.NullPool)
        sa.event.listen(engine, "connect", _sqlite_connected)
        sa.event.listen(engine, "begin", _sqlite_begin)
        db = cls(engine, f"the SQLite store {p.name}")
        db.path = p
        db.connection()                         # creates the file
        with contextlib.suppress(OSError):
            os.chmod(p, 0o600)
        return db

    @classmethod
    def sqlite_read_only(cls, path: str | os.PathLike[str]) -> Database:
        """An existing SQLite store opened read-only (`afe check`: nothing is changed)."""
        p = Path(path)
        engine = sa.create_engine(
            f"sqlite+pysqlite:///file:{urllib.parse.quote(str(p))}?mode=ro&uri=true",
            connect_args={"check_same_thread": False, "isolation_level": None})
        sa.event.listen(engine, "begin", _sqlite_begin)
        db = cls(engine, f"the SQLite store {p}")
        db.path = p
        return db

    @classmethod
    def postgresql(cls, conninfo: str, where: str) -> Database:
        # No pool: the store holds its one connection; a new one after a restart is a new connection,
        # never an idle pooled one the restart also ended.
        engine = sa.create_engine("postgresql+psycopg://", creator=lambda: pg_connect(conninfo, where),
                                  poolclass=sa.pool.NullPool)
        return cls(engine, where)

    path: Path | None = None

    def __repr__(self) -> str:
        return f"Database({self.where})"

    # -- the connection -------------------------------------------------------------

    def connection(self) -> Connection:
        """The store's connection; a new one after the server closed the old (a restart)."""
        conn = self._conn
        if conn is None or conn.closed or conn.invalidated:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
                log.warning("store: the connection to %s was lost; reconnecting", self.where)
            self._conn = conn = self.engine.connect()
        return conn

    @contextlib.contextmanager
    def transaction(self, write: bool = False) -> Iterator[Connection]:
        """A transaction on the store's connection: committed when the block ends,
        rolled back when it raises. Inside another one (a repository method that
        calls another), the block is part of the outer transaction."""
        conn = self.connection()
        if conn.in_transaction():
            yield conn
            return
        conn.info["write"] = write
        with conn.begin():
            yield conn

    def _broken(self) -> bool:
        conn = self._conn
        return conn is None or conn.closed or conn.invalidated

    def _reset(self, reason: str) -> None:
        """Before a retry (retry.py): a connection the server ended is dropped, so
        `connection` opens a new one; an open transaction is ended."""
        conn = self._conn
        if conn is None:
            return
        if reason in ("serialization_failure", "deadlock", "busy", "locked") and not self._broken():
            with contextlib.suppress(Exception):
                if conn.in_transaction():
                    conn.rollback()
            return
        with contextlib.suppress(Exception):
            conn.invalidate()
        with contextlib.suppress(Exception):
            conn.close()
        self._conn = None

    def ping(self) -> bool:
        """Whether the database answers now. A connection the server ended is
        replaced once, so the first probe after a restart does not report the old
        connection's end."""
        for _ in range(2):
            try:
                with self.transaction() as conn:
                    return conn.execute(sa.text("SELECT 1")).scalar() == 1
            except (sa.exc.DBAPIError, Unavailable, FailedPrecondition):
                broken = self._broken()
                self._reset("connection_lost")
                if not broken:
                    return False
        return False

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None
        self.engine.dispose()

    def checkpoint(self) -> None:
        """SQLite: copy the WAL into the database file now (otherwise done when a commit
        finds the WAL past 1000 pages). Nothing to do on PostgreSQL."""
        if self.dialect == "sqlite":
            conn = self.connection()
            if not conn.in_transaction():        # outside a transaction, on the driver's connection
                raw = conn.connection.driver_connection
                assert raw is not None
                raw.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()


def _sqlite_connected(dbapi_conn: Any, record: Any) -> None:
    dbapi_conn.isolation_level = None            # transactions are begun by _sqlite_begin
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    cur.close()


def _sqlite_begin(conn: Connection) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.info.get("write") else "BEGIN")


class Fences(Protocol):
    """What a repository needs of this scheduler's leases (leases.py `Leases`)."""

    owner: str

    def guard(self, conn: Connection, ticket_id: str) -> None: ...

    def fenced(self, ticket_id: str) -> int | None: ...

    def lose(self, ticket_id: str) -> None: ...


class Repository:
    """One aggregate's statements. `db`: the database; `leases`: this scheduler's
    fences, which every write of a held ticket is checked against (`Leases.guard`)."""

    def __init__(self, db: Database, leases: Fences) -> None:
        self.db = db
        self.leases = leases

    @contextlib.contextmanager
    def _write(self, *ticket_ids: str) -> Iterator[Connection]:
        """A write transaction that first checks this scheduler's fence of each of
        `ticket_ids` it holds (R45): `LeaseLost`, nothing written, when one was lost."""
        with self.db.transaction(write=True) as conn:
            for tid in ticket_ids:
                self.leases.guard(conn, tid)
            yield conn

    def _read(self) -> contextlib.AbstractContextManager[Connection]:
        return self.db.transaction()


def local(method: Callable[..., T]) -> Callable[..., T]:
    """Mark a repository method that runs no statement (bookkeeping in memory): not
    retried, and called on the caller's thread, also while the database is away
    (worker.py)."""
    method.__store_local__ = True   # type: ignore[attr-defined]
    return method


def is_local(method: object) -> bool:
    return bool(getattr(method, "__store_local__", False))


def retry_methods(repo: T, retrier: Retrier) -> T:
    """Run each public method of a repository under `retrier`: a transaction a lost
    or busy database broke is run again whole (retry.py). A method called from
    inside another runs once (the outer call retries the whole)."""
    for name in dir(type(repo)):
        value = getattr(type(repo), name, None)
        if name.startswith("_") or not callable(value) or isinstance(value, type) or is_local(value):
            continue
        setattr(repo, name, _wrap(retrier, getattr(repo, name)))
    return repo


def _wrap(retrier: Retrier, method: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> T:
        return retrier.call(method, *args, **kwargs)
    run.__wrapped_store_method__ = True   # type: ignore[attr-defined]
    return run
