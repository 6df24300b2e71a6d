"""The fence in the deployment's database (R37, R45; docs/SCALE.md "Fencing").

With a PostgreSQL store, schedulers on several machines share the tickets,
and each machine runs its own credential broker: a fence file per machine
(resource.py) would not see a claim made through another machine. So, when the
broker is given the store's URL (AFE_DATABASE_URL, postgresql://...), every
side effect of a ticket that carries a fence (commit, push, update of the
branch, pull request, merge, comment, commit status, an MCP call) is checked
against the ticket's row in the database:

    SELECT owner, fence, lease_until_ms, <the database's clock>
      FROM tickets WHERE id = $ticket FOR KEY SHARE

The call goes ahead only if the row's `fence` is the call's, the ticket has
an owner and its lease has not ended by the database's clock. A claim bumps
`fence`, so the fence alone names the claim (and so its owner).

The check and the side effect run inside one transaction that keeps the row
locked FOR KEY SHARE until the side effect has returned: a claim (which
takes the row FOR UPDATE, SKIP LOCKED) cannot take the ticket while a call
of the current owner is under way, and any call after a claim finds the new
fence. FOR KEY SHARE and not FOR SHARE, so the owner's own heartbeat and
writes (UPDATEs of other than key columns) go on during a long push.

The broker only reads the tickets table (the lock needs the UPDATE right a
scheduler's user has anyway) through connections of its own, with async
I/O (psycopg's AsyncConnection), so the broker's event loop never blocks on
the database. A database that does not answer refuses the side effect with
`Unavailable` naming the store (nothing done; the scheduler may try again);
it never lets a call through unchecked. Fence 0 (an unfenced call, e.g. the
store of one scheduler) is not checked, as in resource.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import psycopg
from psycopg import errors as pg_errors
from psycopg.rows import TupleRow

from services.common.errors import ConfigError, FailedPrecondition, Reason, Unavailable
from services.common.layout import check_ticket_id
from services.common.secrecy.redact import Redactor
from services.credentials.fencing.resource import LOST_LEASE, StaleFence

log = logging.getLogger(__name__)

ENV = "AFE_DATABASE_URL"
PG_SCHEMES = ("postgresql", "postgres")
NOW_MS = "(extract(epoch from clock_timestamp()) * 1000)::bigint"    # the database's clock, as the store's
CHECK = f"SELECT owner, fence, lease_until_ms, {NOW_MS} FROM tickets WHERE id = %s FOR KEY SHARE"
MAX_CONNECTIONS = 16            # side effects checked at once; more wait for a connection
CONNECT_TIMEOUT_S = 5
LOCK_TIMEOUT_MS = 5000          # a claim holds the row FOR UPDATE only for its one statement
# Every session: a hold may last a long push, so no idle-in-transaction limit; keep-alives so the
# server ends the transaction (and frees the row) soon after this machine vanishes.
SESSION = ("SET idle_in_transaction_session_timeout = 0; SET statement_timeout = '15s'; "
           f"SET lock_timeout = {LOCK_TIMEOUT_MS}; SET tcp_keepalives_idle = 10; "
           "SET tcp_keepalives_interval = 5; SET tcp_keepalives_count = 3")


@dataclass(frozen=True)
class FenceDatabase:
    """The store's database as the broker reaches it. `conninfo` may hold a
    password: it is left out of repr and of every message (R29)."""

    where: str                                      # "the PostgreSQL database afe on db port 5432"
    conninfo: str = field(default="", repr=False)


def database_from_url(url: str, redactor: Redactor | None = None) -> FenceDatabase | None:
    """The PostgreSQL database of AFE_DATABASE_URL, or None for a SQLite store
    (one machine: the fence file stays) or no URL. Its password is registered
    with `redactor`."""
    if not url:
        return None
    try:
        parts = urllib.parse.urlsplit(url)
        scheme, password = parts.scheme, parts.password
    except ValueError:
        raise ConfigError(f"{ENV} is not a URL; write postgresql://user:password@host:port/database") from None
    if scheme == "sqlite":
        return None
    if scheme not in PG_SCHEMES:
        raise ConfigError(f"{ENV}: the URL scheme must be sqlite or postgresql")
    if password and redactor is not None:
        redactor.register(urllib.parse.unquote(password))
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    try:
        params = conninfo_to_dict(url)
    except psycopg.Error:      # its text may quote the URL
        raise ConfigError(f"{ENV}: the postgresql URL does not parse; write "
                          "postgresql://user:password@host:port/database") from None
    host = str(params.get("host") or "the local socket")
    port = str(params.get("port") or "5432")
    dbname = str(params.get("dbname") or params.get("user") or "")
    extra: dict[str, str | int] = {"application_name": "afe-credentials"}
    if "connect_timeout" not in params:
        extra["connect_timeout"] = CONNECT_TIMEOUT_S
    return FenceDatabase(f"the PostgreSQL database {dbname} on {host} port {port}", make_conninfo(url, **extra))


class LeaseEnded(FailedPrecondition):
    """The ticket is no longer held with the request's fence: the scheduler's LeaseLost."""

    reason = Reason.LEASE_LOST

    def __init__(self, ticket_id: str, fence: int, why: str) -> None:
        super().__init__(f"ticket {ticket_id} is no longer held with fence {fence} ({why}); {LOST_LEASE}")


class DatabaseFences:
    """`hold` and `forget` as fences.Fences, judged by the ticket's row in the
    deployment's database (module docstring)."""

    def __init__(self, db: FenceDatabase, max_connections: int = MAX_CONNECTIONS) -> None:
        self.db = db
        self._idle: list[psycopg.AsyncConnection] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._closed = False

    async def _connect(self, ticket_id: str) -> psycopg.AsyncConnection:
        try:
            conn = await psycopg.AsyncConnection.connect(self.db.conninfo, autocommit=True)
        except psycopg.Error as exc:
            raise self._away(exc, ticket_id) from None
        try:
            await conn.execute(SESSION)
        except psycopg.Error as exc:
            await conn.close()
            raise self._away(exc, ticket_id) from None
        return conn

    def _away(self, exc: psycopg.Error, ticket_id: str = "") -> Unavailable:
        """A database that does not answer: the side effect is refused, never let through."""
        # libpq's text is not passed on: it may name the connection's parameters.
        log.warning("the fence check could not reach %s (%s)", self.db.where, type(exc).__name__)
        of = f" of ticket {ticket_id}" if ticket_id else ""
        return Unavailable(f"the fence{of} cannot be checked: {self.db.where} (the scheduler's store) does not "
                           "answer; nothing was done, try again once the database is back",
                           reason=Reason.FENCE_STORE_AWAY)

    @contextlib.asynccontextmanager
    async def _transaction(self, ticket_id: str) -> AsyncIterator[psycopg.AsyncConnection]:
        """A connection with a transaction open (a pooled one, else a new one); ended
        (rolled back: it only read) when the block ends; a broken one is closed."""
        async with self._slots:
            conn = self._idle.pop() if self._idle else None
            if conn is not None:
                try:            # a pooled connection may have died with a database restart: one new try
                    await conn.execute("BEGIN")
                except psycopg.Error:
                    await conn.close()
                    conn = None
            if conn is None:
                conn = await self._connect(ticket_id)
                try:
                    await conn.execute("BEGIN")
                except psycopg.Error as exc:
                    await conn.close()
                    raise self._away(exc, ticket_id) from None
            try:
                yield conn
            finally:
                ended = False
                try:
                    await conn.execute("ROLLBACK")
                    ended = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
                except psycopg.Error:
                    log.warning("ticket %s: the fence's hold on %s ended with its connection; the side effect "
                                "under way went on", ticket_id, self.db.where)
                if ended and not self._closed:
                    self._idle.append(conn)
                else:
                    await conn.close()

    @contextlib.asynccontextmanager
    async def hold(self, ticket_id: str, fence: int) -> AsyncIterator[None]:
        """Run the block only while the ticket's row holds `fence` with a live
        lease, keeping the row locked against a claim until the block ends;
        else `StaleFence`/`LeaseEnded` (the scheduler's `LeaseLost`), or
        `Unavailable` when the database does not answer. Fence 0: no check."""
        if not fence:
            yield
            return
        check_ticket_id(ticket_id)
        async with self._transaction(ticket_id) as conn:
            try:
                row = await (await conn.execute(CHECK, (ticket_id,))).fetchone()
            except pg_errors.LockNotAvailable:
                raise Unavailable(f"ticket {ticket_id} is being claimed by a scheduler right now; nothing was "
                                  "done, try again") from None
            except (pg_errors.UndefinedTable, pg_errors.UndefinedColumn):
                raise FailedPrecondition(
                    f"{self.db.where} has no tickets table with leases: the credential broker's {ENV} must "
                    "name the scheduler's database (the same URL), migrated by a scheduler of this afe") from None
            except psycopg.Error as exc:
                raise self._away(exc, ticket_id) from None
            self._judge(ticket_id, fence, row)
            yield

    def _judge(self, ticket_id: str, fence: int, row: TupleRow | None) -> None:
        if row is None:
            raise LeaseEnded(ticket_id, fence, f"it is not in {self.db.where}")
        owner, held, until_ms, now_ms = str(row[0]), int(row[1]), int(row[2]), int(row[3])
        if fence < held:
            log.warning("ticket %s: refused a request with fence %d (the database holds %d)", ticket_id, fence, held)
            raise StaleFence(ticket_id, fence, held)
        if fence > held:
            # Not a lost lease: the scheduler and this broker do not read the same database.
            raise FailedPrecondition(
                f"ticket {ticket_id}'s fence in {self.db.where} is {held}, older than the request's {fence}: this "
                f"credential broker and the scheduler use different databases; give both the same {ENV}")
        if not owner:
            raise LeaseEnded(ticket_id, fence, "the ticket was released")
        if until_ms < now_ms:
            log.warning("ticket %s: refused a request with fence %d: %s's lease ended %d ms ago by the "
                        "database's clock", ticket_id, fence, owner, now_ms - until_ms)
            raise LeaseEnded(ticket_id, fence, f"the lease of {owner} ended {now_ms - until_ms} ms ago by the "
                             "database's clock")

    def forget(self, ticket_id: str) -> None:
        """Nothing kept here: the database holds the fence."""

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            with contextlib.suppress(psycopg.Error):
                await conn.close()
