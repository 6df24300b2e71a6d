"""Statements retried across a lost or busy database (issue: no event lost on
a database restart).

A PostgreSQL restart (`pg_ctl restart -m fast` or `-m immediate`, a crash of
the postmaster) closes every connection. psycopg only learns of it at the
next statement, which then fails with `AdminShutdown` or "server closed the
connection unexpectedly"; while the server comes back, new connections are
refused or told "the database system is starting up". SQLite's equivalent
is another process holding the write lock past `busy_timeout`.

Each public method of a repository runs under `Retrier.call` (the store
wraps them: database.py `retry_methods`; `ping` and `close` are not
retried): on one of those
connection-level errors (and on a serialization failure or a deadlock, which
PostgreSQL asks the client to retry) the connection is dropped, the method
waits a bounded, growing back-off and runs again from its start, so a
transaction is always redone whole. Every method of a store is safe to run
again after a failure that may have committed: writes set values, insert
with `ON CONFLICT`, or are checked by their caller (the event log compares
a batch with what the store holds, ticket + seq; `create_ticket` finds its
own row). After `budget_s` the error becomes `StoreUnavailable`, naming the
database and the last cause; anything else is raised at once, unchanged.

The waits never hold the scheduler's event loop: in the scheduler every
statement runs on the store's own thread (worker.py), whose `pause` waits on
the job's own event, so a call whose caller stopped waiting ends at once
(`StoreUnavailable`), and `health` tells that thread when the database
stops and starts answering. Without those hooks (a tool, a test) a wait is a
plain sleep of the calling thread.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from typing import Any, TypeVar

from services.common.errors import FailedPrecondition, Unavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

# Seconds between tries: fast at first (a restart with -m fast is back within a
# second), then every 2 s until the budget is spent.
BACKOFF_S = (0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 2.0)
BUDGET_S = 30.0


class StoreUnavailable(Unavailable):
    """The database did not answer within the retry budget."""


def pg_reason(exc: BaseException, broken: bool) -> str | None:
    """Why a PostgreSQL error is worth another try, or None."""
    import psycopg
    from psycopg import errors as e

    if isinstance(exc, e.SerializationFailure):
        return "serialization_failure"
    if isinstance(exc, e.DeadlockDetected):
        return "deadlock"
    if isinstance(exc, (e.AdminShutdown, e.CrashShutdown)):
        return "admin_shutdown"
    if isinstance(exc, e.CannotConnectNow):
        return "starting_up"
    if isinstance(exc, Unavailable):             # pg_connect.connect: refused, or not accepting yet
        return "starting_up" if "starting up" in str(exc) else "connection_lost"
    if isinstance(exc, psycopg.OperationalError):
        state = exc.sqlstate or ""
        if state.startswith("08") or (not state and broken):
            return "connection_lost"
    if isinstance(exc, psycopg.InterfaceError) and broken:
        return "connection_lost"
    return None


def sqlite_reason(exc: BaseException, broken: bool) -> str | None:
    """SQLITE_BUSY (another connection holds the lock past busy_timeout) or
    SQLITE_LOCKED (a table lock inside this process)."""
    if isinstance(exc, sqlite3.OperationalError):
        code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
        if code == sqlite3.SQLITE_BUSY or "database is locked" in str(exc):
            return "busy"
        if code == sqlite3.SQLITE_LOCKED or "is locked" in str(exc):
            return "locked"
    return None


class Retrier:
    """Runs a store's methods with retries; one per store (not thread-safe,
    like the store's connection). A method called from inside another one
    runs once: the outer call retries the whole."""

    def __init__(self, store: str, where: str, classify: Callable[[BaseException, bool], str | None],
                 reset: Callable[[str], None], broken: Callable[[], bool], budget_s: float = BUDGET_S) -> None:
        self.store = store              # "postgresql" | "sqlite": the metric's label
        self.where = where              # the database, without credentials (R29)
        self.classify = classify
        self.reset = reset              # (reason): drop the connection, or end the open transaction
        self.broken = broken
        self.budget_s = budget_s
        self.metric: Any = None         # counter {store, reason} (metrics.SchedulerMetrics.store_retries)
        self.retried = 0                # tries after a failure in the current call
        # (seconds) -> False when the call should give up instead (its caller stopped waiting): worker.py
        self.pause: Callable[[float], bool] = _sleep
        # (reason of a failure, or None: the database answered) -> None: worker.py
        self.health: Callable[[str | None], None] | None = None
        self._depth = 0

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._depth:
            return fn(*args, **kwargs)
        start = 0.0                     # taken at the first failure: nothing extra on the common path
        self.retried = 0
        while True:
            self._depth += 1
            try:
                result = fn(*args, **kwargs)
            except StoreUnavailable:
                raise
            except FailedPrecondition:
                self._answered()
                raise
            except Exception as exc:
                reason = self.classify(exc, self.broken())
                if reason is None:
                    self._answered()
                    raise
                if self.health is not None:
                    self.health(reason)
                delay = BACKOFF_S[min(self.retried, len(BACKOFF_S) - 1)]
                start = start or time.monotonic()
                spent = time.monotonic() - start
                if spent + delay > self.budget_s:
                    raise StoreUnavailable(
                        f"{self.where} did not answer for {spent:.1f} s ({reason.replace('_', ' ')}, "
                        f"{self.retried + 1} tries): check that the database runs; afe goes on when it "
                        "answers again") from None
                self._note(fn, reason, delay)
                self.reset(reason)
                if not self.pause(delay):
                    raise StoreUnavailable(
                        f"{self.where} did not answer for {time.monotonic() - start:.1f} s "
                        f"({reason.replace('_', ' ')}); the caller stopped waiting") from None
                self.retried += 1
            else:
                self._answered()
                return result
            finally:
                self._depth -= 1

    def _answered(self) -> None:
        if self.health is not None:
            self.health(None)

    def _note(self, fn: Callable[..., Any], reason: str, delay: float) -> None:
        if self.metric is not None:
            self.metric.labels(store=self.store, reason=reason).inc()
        level = logging.WARNING if self.retried in (0, 5) or self.retried % 20 == 0 else logging.DEBUG
        log.log(level, "store: %s on %s (%s); trying again in %.2f s", reason.replace("_", " "), self.where,
                getattr(fn, "__name__", "a statement"), delay)


def _sleep(seconds: float) -> bool:
    time.sleep(seconds)
    return True


def count_outages(store: Any, events: Any, metrics: Any) -> None:
    """Point the store's retries and the event log's losses at the scheduler's
    metrics (metrics.SchedulerMetrics)."""
    events.lost_metric = metrics.events_lost
    retrier = getattr(store, "_retry", None)
    if retrier is not None:
        retrier.metric = metrics.store_retries
