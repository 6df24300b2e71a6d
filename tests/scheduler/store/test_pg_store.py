"""What only the PostgreSQL store has to show: per-ticket event seqs stay
gap-free and duplicate-free with several writers on several connections, a
lost connection is replaced, and `afe check` / `afe up` say what to change
when the database is unreachable, refuses the login (without repeating the
password, R29) or is at a newer schema. A throwaway server per session
(tests/support/postgres.py)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa

from services.common.errors import FailedPrecondition, Unavailable
from services.common.layout import Layout
from services.launcher.launch import Options, preflight
from services.scheduler.events.log import EventLog
from services.scheduler.store import migrate
from services.scheduler.store.base import EventRecord, TicketRecord
from tests.scheduler.conftest import write_config
from tests.support.postgres import open_store_url

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
WRONG_PASSWORD = "Wrong-pg-Pass-91e3f7"
WORKFLOW = """\
kind: Workflow
name: quick
workspace: ws
nodes:
  - {id: one, run: "true"}
"""


def _events(tid: str, first: int, n: int) -> list[EventRecord]:
    return [EventRecord(tid, s, "x", f'{{"s":{s}}}', 1) for s in range(first, first + n)]


def _seqs(store, tid: str) -> list[int]:
    return [e.seq for e in store.events.read(tid, 1, 1_000_000)]


def test_seq_gap_and_duplicate_are_refused_with_nothing_written(pg_url):
    store = open_store_url(pg_url)
    store.events.append(_events("t-1", 1, 5))
    for bad_first in (8, 3, 1):     # a gap after 5, a duplicate, a restart from 1
        with pytest.raises(FailedPrecondition, match="do not follow its stored events"):
            store.events.append(_events("t-1", bad_first, 2) + _events("t-2", 1, 1))
    assert _seqs(store, "t-1") == [1, 2, 3, 4, 5] and _seqs(store, "t-2") == []   # the whole batch was refused
    store.events.append(_events("t-1", 6, 2))
    assert _seqs(store, "t-1") == list(range(1, 8)) and store.events.last_seq("t-1") == 7
    # Positive control: the events table alone (its primary key) takes a gap; the counter is the defence.
    with psycopg.connect(pg_url, autocommit=True) as db:
        db.execute("INSERT INTO events VALUES ('t-1', 10, 'x', '{}', 1)")
    assert _seqs(store, "t-1")[-1] == 10
    store.close()


def test_concurrent_writers_on_one_ticket_leave_no_gap_and_no_duplicate(pg_url):
    """Four writers, each on its own connection, race for the next seqs of
    one ticket (reading the last seq, then appending a batch after it). The
    ones that lose a race are refused and retry; the stored seqs are 1..n."""
    open_store_url(pg_url).close()
    writers, rounds = 4, 40
    stores = [open_store_url(pg_url) for _ in range(writers)]
    stored: list[int] = [0] * writers
    refused: list[int] = [0] * writers
    start = threading.Barrier(writers)

    def write(i: int) -> None:
        store = stores[i]
        start.wait()
        done = 0
        while done < rounds:
            first = store.events.last_seq("t-race") + 1
            try:
                store.events.append(_events("t-race", first, 1 + (done + i) % 3))
            except FailedPrecondition:
                refused[i] += 1
                continue
            stored[i] += 1 + (done + i) % 3
            done += 1

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(stored)
    assert _seqs(stores[0], "t-race") == list(range(1, total + 1))
    assert stores[0].events.last_seq("t-race") == total
    for s in stores:
        s.close()


async def test_event_log_on_postgresql_continues_after_a_restart(pg_url):
    log = EventLog(open_store_url(pg_url), _redactor())
    assert [log.append("t-1", "x", {"i": i}) for i in range(300)] == list(range(1, 301))
    log.flush()                      # 300 events: one batch
    log.store.close()
    again = EventLog(open_store_url(pg_url), _redactor())
    assert again.append("t-1", "x", {}) == 301
    again.flush()
    assert _seqs(again.store, "t-1") == list(range(1, 302))
    again.store.close()


def _backend_pid(store) -> int:
    with store.db.transaction() as conn:
        return int(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar())


def _redactor():
    from services.common.secrecy.redact import Redactor

    return Redactor()


def test_a_lost_connection_is_replaced(pg_server, pg_url):
    store = open_store_url(pg_url)
    store.tickets.create(TicketRecord(id="t-1", workspace="ws", workflow="wf", title="kept", body="", inputs={},
                                     state="queued", created_at_ms=1, updated_at_ms=1), [], [])
    pid = _backend_pid(store)
    pg_server.sql(f"SELECT pg_terminate_backend({pid})")
    store.ping()                     # may fail once: that is how the loss is noticed
    assert store.ping() and _backend_pid(store) != pid
    assert store.tickets.get("t-1").title == "kept"
    store.close()


@pytest.fixture
def closed_port():
    """A loopback port that refuses connections: bound for the whole test (so no other
    process, e.g. a parallel test worker's server, takes it), never listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def _afe_check(url: str, tmp_path: Path) -> subprocess.CompletedProcess:
    cfg = write_config(tmp_path, WORKFLOW)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8", "AFE_DATABASE_URL": url}
    return subprocess.run([sys.executable, "-m", "services.cli.main", "check", "--config", str(cfg),
                           "--data", str(tmp_path / "data")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60, check=False)


def test_r29_afe_check_reports_the_database_without_repeating_the_url(pg_server, pg_url, tmp_path, closed_port):
    dbname = pg_url.rsplit("/", 1)[1]
    ok = _afe_check(pg_url, tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert f"the PostgreSQL database {dbname} on 127.0.0.1 port {pg_server.port}: reachable and empty" in ok.stdout
    open_store_url(pg_url).close()
    assert f"schema {migrate.head()} (current)" in _afe_check(pg_url, tmp_path).stdout

    cases = {
        "bad password": (pg_server.app_url(dbname, WRONG_PASSWORD), "refused the user name or password"),
        "unreachable": (f"postgresql://afe_app:{WRONG_PASSWORD}@127.0.0.1:{closed_port}/{dbname}",
                        "cannot reach the PostgreSQL database"),
        "no such database": (pg_server.app_url("afe_missing"), "does not exist"),
    }
    for name, (url, words) in cases.items():
        password = urllib.parse.urlsplit(url).password
        assert password and password in url   # positive control: the URL handed to afe carries one
        r = _afe_check(url, tmp_path)
        out = r.stdout + r.stderr
        assert r.returncode == 1, (name, out)
        assert words in out and "AFE_DATABASE_URL" in out, (name, out)
        assert password not in out and url not in out and "Traceback" not in out, (name, out)


def test_newer_schema_stops_afe_check_and_afe_up_before_any_process_starts(pg_url, tmp_path, closed_port):
    open_store_url(pg_url).close()
    with psycopg.connect(pg_url, autocommit=True) as db:
        db.execute("UPDATE alembic_version SET version_num='9999'")   # a revision this afe does not know
        db.execute("INSERT INTO schema_version VALUES (12, '9.8.7', 0)")
    r = _afe_check(pg_url, tmp_path)
    assert r.returncode == 1 and "afe 9.8.7 or later" in r.stderr and "newer than this afe" in r.stderr

    cfg = write_config(tmp_path / "up", WORKFLOW)
    layout = Layout(tmp_path / "up" / "data", tmp_path / "up" / "run")
    opts = Options(config_dir=cfg, layout=layout, check_images=False)
    env = {"PATH": "/usr/bin:/bin", "AFE_DATABASE_URL": pg_url}
    with pytest.raises(FailedPrecondition, match=re.escape("afe 9.8.7 or later")):
        preflight(opts, env, progress=lambda m: None)
    down = dict(env, AFE_DATABASE_URL=pg_url.rsplit("@", 1)[0] + f"@127.0.0.1:{closed_port}/x")
    with pytest.raises(Unavailable, match="cannot reach") as exc:
        preflight(opts, down, progress=lambda m: None)
    assert "pg-Test-Password" not in str(exc.value)
    # Positive control: at this afe's schema the same pre-flight passes.
    with psycopg.connect(pg_url, autocommit=True) as db:
        db.execute("UPDATE alembic_version SET version_num=%s", (migrate.head(),))
        db.execute("DELETE FROM schema_version WHERE version > 11")
    assert preflight(opts, env, progress=lambda m: None).workflows["quick"]
