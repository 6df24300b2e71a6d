"""What every repository of this package is built from: how it gets a
transaction, how it checks the fence of a ticket it writes, and the two
statements that cannot be written the same way for SQLite and PostgreSQL
(an upsert, the database's clock).

- `Transaction`: a function that opens one transaction and yields its
  `Connection` (committed when the block ends, rolled back when it raises):
  `engine.begin` of an `Engine`, or the store's `Database.transaction`
  over the one connection its thread owns. Every method runs in one such
  transaction, so a fence check and the write it guards commit or roll
  back together. `tx` opens the transactions of writes (on SQLite a
  `BEGIN IMMEDIATE` one: the write lock first); `read`, when given, those
  of methods that only read (a plain `BEGIN`, no write lock).
- `FenceCheck`: `check(conn, ticket_id)` runs inside that transaction before
  a write that changes an owner's ticket data (R37, R45). It raises
  `LeaseLost` when this scheduler's claim of the ticket is no longer the
  ticket's (another scheduler took it over), and holds the ticket row
  (SELECT ... FOR SHARE on PostgreSQL) until the transaction ends, so a
  claim cannot slip in between the check and the write. `Leases.guard`
  (leases.py) is the one the store passes; the repositories here only call it.
- `insert_for(conn, table)`: INSERT with ON CONFLICT of the connection's
  dialect (SQLAlchemy builds the same statement for both, from the same
  arguments; only the constructor differs).
- `now_ms(conn, at_ms)`: "now" for a statement: the database's own clock on
  PostgreSQL (several hosts share it, so their clocks do not matter), the
  caller's `at_ms` on SQLite (one host; the tests move time by passing it).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy import BigInteger, ColumnElement, Connection, Table, literal
from sqlalchemy.dialects import postgresql, sqlite

from ..database import db_now_ms

Transaction = Callable[[], AbstractContextManager[Connection]]
FenceCheck = Callable[[Connection, str], None]


class Repository:
    """A repository of statements: writes run in transactions `tx` opens, reads in
    those `read` opens (`tx`'s when not given)."""

    def __init__(self, tx: Transaction, *, read: Transaction | None = None) -> None:
        self._tx = tx
        self._read = read or tx


class FencedRepository(Repository):
    """A repository whose writes change an owner's ticket data: each runs `check`
    for its ticket first, in the write's transaction."""

    def __init__(self, tx: Transaction, check: FenceCheck, *, read: Transaction | None = None) -> None:
        super().__init__(tx, read=read)
        self._check = check


def insert_for(conn: Connection, table: Table) -> Any:
    """INSERT INTO `table` with `.on_conflict_do_update/_do_nothing` and `.excluded`, for the
    connection's database."""
    name = conn.dialect.name
    if name == "postgresql":
        return postgresql.insert(table)
    if name == "sqlite":
        return sqlite.insert(table)
    raise ValueError(f"the store runs on SQLite or PostgreSQL, not {name}")


def now_ms(conn: Connection, at_ms: int) -> ColumnElement[int]:
    """The current time in ms for a statement: PostgreSQL's clock there (`db_now_ms`), `at_ms`
    on SQLite."""
    if conn.dialect.name == "postgresql":
        return db_now_ms()
    return literal(at_ms, BigInteger)
