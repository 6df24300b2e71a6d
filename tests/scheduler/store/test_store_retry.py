"""The store's retries (store_retry.py) without a database: which errors are
tried again, that a method runs again whole and at most within the budget,
and that anything else is raised at once (fast, no server)."""

from __future__ import annotations

import sqlite3

import psycopg
import pytest

from services.common.errors import FailedPrecondition
from services.scheduler.store import retry as store_retry
from services.scheduler.store.retry import Retrier, StoreUnavailable, pg_reason, sqlite_reason


def _retrier(budget_s: float = 5.0) -> tuple[Retrier, list[str]]:
    resets: list[str] = []
    return Retrier("postgresql", "the test database", pg_reason, resets.append, lambda: True, budget_s), resets


def test_connection_level_errors_are_retried_and_others_are_not():
    assert pg_reason(psycopg.errors.AdminShutdown("terminating connection"), False) == "admin_shutdown"
    assert pg_reason(psycopg.errors.SerializationFailure("retry"), False) == "serialization_failure"
    assert pg_reason(psycopg.OperationalError("server closed the connection unexpectedly"), True) == "connection_lost"
    assert pg_reason(psycopg.OperationalError("canceled"), False) is None        # the connection is fine
    assert pg_reason(psycopg.errors.UniqueViolation("dup"), True) is None
    busy = sqlite3.OperationalError("database is locked")
    assert sqlite_reason(busy, False) == "busy" and sqlite_reason(sqlite3.OperationalError("no such table"), False) is None


def test_a_method_runs_again_whole_after_a_lost_connection(monkeypatch):
    monkeypatch.setattr(store_retry, "BACKOFF_S", (0.0,))
    r, resets = _retrier()
    calls = []

    def method():
        calls.append(1)
        if len(calls) < 3:
            raise psycopg.errors.AdminShutdown("terminating connection due to administrator command")
        return "stored"
    assert r.call(method) == "stored" and len(calls) == 3
    assert resets == ["admin_shutdown", "admin_shutdown"] and r.retried == 2


def test_the_budget_ends_in_store_unavailable_and_other_errors_pass_at_once(monkeypatch):
    monkeypatch.setattr(store_retry, "BACKOFF_S", (0.01,))
    r, _ = _retrier(budget_s=0.05)

    def down():
        raise psycopg.OperationalError("connection refused")
    with pytest.raises(StoreUnavailable, match="the test database did not answer"):
        r.call(down)
    calls = []

    def refused():
        calls.append(1)
        raise FailedPrecondition("another scheduler wrote it")
    with pytest.raises(FailedPrecondition):
        r.call(refused)
    assert calls == [1]                                   # never retried


def test_a_nested_call_is_retried_by_the_outer_one_only(monkeypatch):
    monkeypatch.setattr(store_retry, "BACKOFF_S", (0.0,))
    r, _ = _retrier()
    inner_calls = []

    def inner():
        inner_calls.append(1)
        if len(inner_calls) == 1:
            raise psycopg.errors.AdminShutdown("bye")
        return 1
    assert r.call(lambda: r.call(inner)) == 1 and len(inner_calls) == 2
