"""The scheduler's PostgreSQL sessions are made for a failover (database.py
PG_CONNECT_DEFAULTS, PG_SESSION_DEFAULTS): TCP keepalives and a connect
timeout, so a primary that vanished without closing the socket is noticed in
seconds; a lock timeout and an idle-in-transaction timeout, so a frozen
scheduler (paused, or cut off mid-transaction) cannot hold the rows another
one needs. What AFE_DATABASE_URL sets itself wins. A migration still waits for
another scheduler's, however long it takes."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
import sqlalchemy as sa

from services.scheduler.store import migrate
from services.scheduler.store.database import pg_connect, pg_conninfo
from services.scheduler.store.store import Store


def _show(store: Store, name: str) -> str:
    with store.db.transaction() as conn:
        return str(conn.execute(sa.text(f"SHOW {name}")).scalar())


def test_conninfo_adds_the_failover_defaults_and_keeps_what_the_url_sets():
    text, settings = pg_conninfo("postgresql://u:p@db.example:5432/afe")
    info = psycopg.conninfo.conninfo_to_dict(text)
    assert info["keepalives"] == "1" and info["keepalives_idle"] == "5" and info["connect_timeout"] == "5"
    assert "options" not in info        # no startup `options`: connection poolers refuse it
    assert settings == {"lock_timeout": "30000", "idle_in_transaction_session_timeout": "15000"}
    text, settings = pg_conninfo("postgresql://u:p@db.example/afe?connect_timeout=9&options=-c%20lock_timeout%3D5")
    own = psycopg.conninfo.conninfo_to_dict(text)
    assert own["connect_timeout"] == "9" and own["options"] == "-c lock_timeout=5"
    assert settings == {"idle_in_transaction_session_timeout": "15000"}


def test_store_sessions_carry_the_failover_defaults(pg_url):
    store = Store.postgresql(pg_url, "the test database")
    try:
        assert _show(store, "lock_timeout") == "30s"
        assert _show(store, "idle_in_transaction_session_timeout") == "15s"
        with store.db.transaction() as conn:
            params = conn.connection.driver_connection.info.get_parameters()
        assert params["keepalives_idle"] == "5" and params["connect_timeout"] == "5"
    finally:
        store.close()
    # Positive control: a session made as before (the URL alone) has neither timeout.
    with psycopg.connect(pg_url) as plain:
        assert plain.execute("SHOW lock_timeout").fetchone() == ("0",)
        assert plain.execute("SHOW idle_in_transaction_session_timeout").fetchone() == ("0",)


def test_a_frozen_transaction_does_not_hold_the_rows_for_long(pg_url):
    """A session that took a ticket's row and stopped mid-transaction is ended by the
    server (the URL lowers the timeout to 1 s here): the store's write goes through.
    Positive control: the same hold from a session without the defaults blocks the
    write until its own lock timeout."""
    store = Store.postgresql(pg_url + "?options=-c%20lock_timeout%3D3000", "the test database")
    try:
        with store.db.transaction(write=True) as conn:
            conn.execute(sa.text("CREATE TABLE held (id int PRIMARY KEY, v int)"))
            conn.execute(sa.text("INSERT INTO held VALUES (1, 0)"))

        def write() -> float:
            t0 = time.monotonic()
            with store.db.transaction(write=True) as conn:
                conn.execute(sa.text("UPDATE held SET v = v + 1 WHERE id = 1"))
            return time.monotonic() - t0

        frozen = pg_connect(pg_url + "?options=-c%20idle_in_transaction_session_timeout%3D1000", "frozen")
        frozen.execute("SELECT v FROM held WHERE id = 1 FOR UPDATE")      # and then nothing: frozen
        assert write() < 2.9
        frozen.close()

        plain = psycopg.connect(pg_url)
        plain.execute("SELECT v FROM held WHERE id = 1 FOR UPDATE")
        with pytest.raises(sa.exc.OperationalError, match="lock timeout"):
            write()
        plain.close()
    finally:
        store.close()


def test_a_migration_waits_for_another_one_past_the_lock_timeout(pg_url):
    """Another scheduler migrating (its advisory lock held 2 s) outlasts this session's
    lock_timeout (0.5 s via the URL): the store opening now waits for it and opens."""
    url = pg_url + "?options=-c%20lock_timeout%3D500"
    holder = psycopg.connect(pg_url)
    holder.execute("SELECT pg_advisory_xact_lock(%s)", (migrate.MIGRATION_LOCK,))
    threading.Timer(2.0, holder.rollback).start()
    # Positive control: a session with that lock_timeout alone gives up on the lock.
    with pg_connect(url, "other", autocommit=True) as other, pytest.raises(psycopg.errors.LockNotAvailable):
        other.execute("SELECT pg_advisory_xact_lock(%s)", (migrate.MIGRATION_LOCK,))
    t0 = time.monotonic()
    store = Store.postgresql(url, "the test database")
    try:
        assert time.monotonic() - t0 > 0.5
    finally:
        store.close()
        holder.close()
