"""No event lost when the database goes away (issue: the event log survives a
database restart): a real PostgreSQL restarted (`-m fast`, `-m immediate`,
kill -9 of its postmaster) while a ticket streams output and a watcher
follows it; a commit cut by a lost connection; a store that refuses a
ticket's events for good; an outage longer than the store's retries; and
SQLite's busy lock. Each with the failure shown happening first (positive
control): today's drop-and-renumber code loses lines and hides the gap."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading

import psycopg
import pytest
from prometheus_client import CollectorRegistry

from services.common.observability.metrics import scheduler_metrics
from services.common.secrecy.redact import Redactor
from services.scheduler.events import writes as event_writes
from services.scheduler.events.log import EventLog
from services.scheduler.store import database
from services.scheduler.store import store as store_module
from services.scheduler.store.base import EventRecord
from services.scheduler.store.events import Events
from services.scheduler.store.store import Store
from tests.support import postgres

pytestmark = pytest.mark.timeout(180)

LINES = 100


def _metrics(log: EventLog) -> tuple[CollectorRegistry, object]:
    registry = CollectorRegistry()
    m = scheduler_metrics(registry)
    log.lost_metric = m.events_lost
    log.store._retry.metric = m.store_retries   # type: ignore[attr-defined]
    return registry, m


def _retries(registry: CollectorRegistry, store: str) -> float:
    total = 0.0
    for fam in registry.collect():
        if fam.name == "afe_store_retries":
            total += sum(s.value for s in fam.samples if s.name.endswith("_total") and s.labels["store"] == store)
    return total


def _lines(events: list[EventRecord]) -> list[str]:
    return [json.loads(e.payload_json)["text"] for e in events if e.type == "node.output"]


def _old_renumber(self, batch):
    """Today's code (the positive control): number the batch after the stored
    seq, whatever is missing before it."""
    last = {tid: self.store.events.last_seq(tid) for tid in {ev[0] for ev in batch}}
    out = []
    for ev in batch:
        last[ev[0]] += 1
        out.append((ev[0], last[ev[0]], ev[2], ev[3], ev[4]))
    self._seq.update(last)
    return [], out


def _todays_flush(monkeypatch) -> None:
    """Today's code (the positive controls): the store does not retry, and a
    batch it did not take is gone (the error went to the loop's log)."""
    def drop(self, batch, exc):
        return []

    def drop_unavailable(self, exc):    # today's code kept nothing for a store that did not answer
        self._unstored = []
    # no repository method retries (the event writes ask several)
    monkeypatch.setattr(store_module, "retry_methods", lambda repo, retrier: repo)
    monkeypatch.setattr(EventLog, "_store_apart", drop)
    monkeypatch.setattr(EventLog, "_unavailable", drop_unavailable)
    # The first batch after the restart meets the connection the restart broke, as the store's own
    # thread now often replaces it first (a read of another statement): the failure made certain.
    restarted = threading.Event()
    real_restart, real_append = postgres.restart_server, Events.append

    def restart(*args, **kw):  # type: ignore[no-untyped-def]
        out = real_restart(*args, **kw)
        restarted.set()
        return out

    def append(self, events):  # type: ignore[no-untyped-def]
        if restarted.is_set():
            restarted.clear()
            raise psycopg.OperationalError("consuming input failed: server closed the connection unexpectedly")
        return real_append(self, events)
    monkeypatch.setattr(postgres, "restart_server", restart)
    monkeypatch.setattr(Events, "append", append)


async def _stream(log: EventLog, tid: str, on_line: int, action, watch: bool = True) -> list[EventRecord]:
    """`LINES` output events 20 ms apart, `action` run in a thread after line
    `on_line`, a live watcher from seq 1 (unless `watch` is false: then the
    event log's write is the first statement after `action`); returns what
    the watcher saw."""
    seen: list[EventRecord] = []
    done = asyncio.Event()

    async def follow() -> None:
        async for ev in log.watch(tid, 1, True, done.is_set):
            seen.append(ev)
            if ev.type == "ticket.finished":
                return

    watcher = asyncio.create_task(follow() if watch else done.wait())
    for i in range(1, LINES + 1):
        log.append(tid, "node.output", {"text": f"line-{i}"})
        if i == on_line:
            await asyncio.sleep(0.05)             # line `on_line` is stored and seen
            await asyncio.to_thread(action)
        await asyncio.sleep(0.02)
    log.append(tid, "ticket.finished", {})
    done.set()
    log.flush()
    await asyncio.wait_for(watcher, 60)
    return seen


def _pg_log(server: postgres.PgServer) -> tuple[EventLog, str]:
    name = server.fresh_database()
    store = postgres.open_store_url(server.app_url(name))
    return EventLog(store, Redactor()), name


@pytest.mark.parametrize("mode", ["fast", "immediate", "kill9"])
async def test_events_streamed_through_a_postgresql_restart_are_stored_once_in_order(durable_pg, mode):
    log, _ = _pg_log(durable_pg)
    registry, _m = _metrics(log)
    log.append("T1", "ticket.created", {})
    log.flush()
    # The failure the store must survive: a connection opened before the restart fails at its next statement.
    bystander = psycopg.connect(durable_pg.admin_url(), autocommit=True)
    seen = await _stream(log, "T1", 20, lambda: postgres.restart_server(durable_pg, mode))
    with pytest.raises(psycopg.OperationalError):
        bystander.execute("SELECT 1")
    bystander.close()

    stored = log.store.events.read("T1", 1, 10_000)
    assert [e.seq for e in stored] == list(range(1, len(stored) + 1))        # gap-free
    assert _lines(stored) == [f"line-{i}" for i in range(1, LINES + 1)]      # each line once, in order
    assert [tuple(e) for e in seen] == [tuple(e) for e in stored]            # the watcher saw exactly that
    assert "events.lost" not in {e.type for e in stored}
    assert _retries(registry, "postgresql") >= 1                             # a write did meet the restart
    log.store.close()


async def test_positive_control_todays_drop_and_renumber_loses_lines_and_hides_the_gap(durable_pg, monkeypatch):
    _todays_flush(monkeypatch)
    monkeypatch.setattr(EventLog, "_reconcile", _old_renumber)
    log, _ = _pg_log(durable_pg)
    log.append("T1", "ticket.created", {})
    log.flush()
    await _stream(log, "T1", 20, lambda: postgres.restart_server(durable_pg, "fast"), watch=False)
    stored = log.store.events.read("T1", 1, 10_000)
    lines = _lines(stored)
    assert len(lines) < LINES                                                # lines lost...
    assert [e.seq for e in stored] == list(range(1, len(stored) + 1))        # ...and the seqs look whole
    log.store.close()


async def test_positive_control_a_dropped_batch_is_named_on_the_ticket_not_renumbered_away(durable_pg, monkeypatch):
    """Even a batch that is dropped (today's flush) is not hidden any more:
    the next batch finds the store's seqs short of it and says so."""
    _todays_flush(monkeypatch)
    log, _ = _pg_log(durable_pg)
    log.append("T1", "ticket.created", {})
    log.flush()
    await _stream(log, "T1", 20, lambda: postgres.restart_server(durable_pg, "fast"), watch=False)
    stored = log.store.events.read("T1", 1, 10_000)
    lost = [json.loads(e.payload_json) for e in stored if e.type == "events.lost"]
    assert len(lost) == 1 and lost[0]["count"] == LINES - len(_lines(stored)) > 0
    assert [e.seq for e in stored] == list(range(1, len(stored) + 1))
    log.store.close()


def _patch_append(monkeypatch, store: Store, fn) -> None:
    """The store's event append replaced by `fn(events)`, retried as the store retries it."""
    monkeypatch.setattr(store.events, "append", database._wrap(store.db.retry, fn))


def _cut_after_commit(monkeypatch, store: Store, times: int = 1) -> list[int]:
    """The connection dies right after the batch's COMMIT reached the server:
    the client cannot know it was stored."""
    repo = store.events
    cuts: list[int] = []

    def append_then_cut(events):
        Events.append(repo, events)
        if len(cuts) < times:
            cuts.append(len(events))
            conn = store.db._conn
            assert conn is not None
            conn.invalidate()                    # the connection is gone
            raise psycopg.OperationalError("consuming input failed: server closed the connection unexpectedly")

    _patch_append(monkeypatch, store, append_then_cut)
    return cuts


async def test_a_batch_whose_commit_was_cut_is_found_stored_not_written_twice(pg_url, monkeypatch):
    store = postgres.open_store_url(pg_url)
    log = EventLog(store, Redactor())
    cuts = _cut_after_commit(monkeypatch, store)
    for i in range(5):
        log.append("T1", "node.output", {"text": f"line-{i}"})
    log.append("T2", "node.output", {"text": "other"})
    log.flush()
    assert cuts == [6]                                          # the first write committed, then was cut
    log.append("T1", "node.output", {"text": "line-5"})
    log.flush()
    stored = store.events.read("T1", 1, 100)
    assert _lines(stored) == [f"line-{i}" for i in range(6)] and [e.seq for e in stored] == list(range(1, 7))
    assert _lines(store.events.read("T2", 1, 100)) == ["other"]
    store.close()


async def test_positive_control_a_cut_commit_written_again_by_todays_renumbering_is_duplicated(pg_url, monkeypatch):
    monkeypatch.setattr(EventLog, "_reconcile", _old_renumber)
    store = postgres.open_store_url(pg_url)
    log = EventLog(store, Redactor())
    _cut_after_commit(monkeypatch, store)
    for i in range(3):
        log.append("T1", "node.output", {"text": f"line-{i}"})
    log.flush()
    assert _lines(store.events.read("T1", 1, 100)) == ["line-0", "line-1", "line-2"] * 2
    store.close()


async def test_events_the_store_refuses_for_good_are_named_on_their_ticket(pg_url, monkeypatch):
    store = postgres.open_store_url(pg_url)
    repo = store.events

    def refuse_t2(events):
        if any(ev[0] == "T2" and ev[2] == "node.output" for ev in events):
            raise psycopg.errors.DataError("value out of range")   # no retry mends it
        Events.append(repo, events)

    _patch_append(monkeypatch, store, refuse_t2)
    log = EventLog(store, Redactor())
    registry, _m = _metrics(log)
    with pytest.raises(psycopg.errors.DataError):      # the refusal itself, as the store gives it
        store.events.append([EventRecord("T2", 1, "node.output", "{}", 1)])
    log.append("T1", "node.output", {"text": "kept"})
    log.append("T2", "node.output", {"text": "refused-1"})
    log.append("T2", "node.output", {"text": "refused-2"})
    log.flush()
    assert _lines(store.events.read("T1", 1, 10)) == ["kept"]
    t2 = store.events.read("T2", 1, 10)
    assert [e.type for e in t2] == ["events.lost"] and t2[0].seq == 1
    assert json.loads(t2[0].payload_json) == {"count": 2, "reason": "the store refused them: DataError"}
    assert registry.get_sample_value("afe_events_lost_total", {"reason": "store_error"}) == 2
    store.close()


async def test_an_outage_past_the_retries_keeps_events_and_names_what_memory_could_not_hold(
        durable_pg, monkeypatch):
    monkeypatch.setattr(event_writes, "MAX_UNSTORED", 40)
    monkeypatch.setattr("services.scheduler.events.log.MAX_UNSTORED", 40)
    monkeypatch.setattr(event_writes, "RETRY_DELAYS_S", (0.2,))
    log, _ = _pg_log(durable_pg)
    registry, _m = _metrics(log)
    log.store._retry.budget_s = 0.5                  # type: ignore[attr-defined]
    log.append("T1", "node.started", {})
    log.flush()
    postgres.stop_only(durable_pg)
    try:
        for i in range(60):
            log.append("T1", "node.output", {"text": f"line-{i}"})
            await asyncio.sleep(0.01)
        log.append("T1", "node.finished", {})           # a state event is always kept
        log.flush()
        assert log.unavailable_since is not None and log.holds_unstored("T1")
    finally:
        postgres.start_again(durable_pg)
    for _ in range(200):                                # the retry timer writes what was kept
        if log.unavailable_since is None:
            break
        await asyncio.sleep(0.05)
    stored = log.store.events.read("T1", 1, 1000)
    assert [e.seq for e in stored] == list(range(1, len(stored) + 1))
    types = [e.type for e in stored]
    # one loss, said once -- or in two records when more was lost while the first was being written
    # (the writes are on the store's own thread; docs/SCALE.md)
    assert types[0] == "node.started" and types[-1] == "node.finished" and types.count("events.lost") in (1, 2)
    losses = [json.loads(e.payload_json) for e in stored if e.type == "events.lost"]
    count = sum(x["count"] for x in losses)
    kept = _lines(stored)
    assert kept == [f"line-{i}" for i in range(len(kept))]           # the lines before the loss, in order
    assert count == 60 - len(kept) > 0 and all(x["types"] == {"node.output": x["count"]} for x in losses)
    assert registry.get_sample_value("afe_events_lost_total", {"reason": "store_unavailable"}) == count
    log.store.close()


def _hold_lock(path, locked: threading.Event, release: threading.Event) -> None:
    other = sqlite3.connect(str(path), isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    locked.set()
    release.wait(30)
    other.execute("COMMIT")
    other.close()


async def test_sqlite_busy_events_are_kept_until_the_lock_is_released(tmp_path, monkeypatch):
    monkeypatch.setattr(event_writes, "RETRY_DELAYS_S", (0.1,))
    monkeypatch.setattr(database, "BUSY_TIMEOUT_MS", 20)
    store = Store.sqlite(tmp_path / "afe.db")
    store._retry.budget_s = 0.3
    log = EventLog(store, Redactor())
    registry, _m = _metrics(log)
    log.append("T1", "node.started", {})
    log.flush()
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_lock, args=(tmp_path / "afe.db", locked, release))
    holder.start()
    locked.wait(10)
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked"):   # what today's flush dropped
            store.db.connection().connection.driver_connection.execute(
                "INSERT INTO events (ticket_id, seq, type, payload_json, at_ms) VALUES ('X', 1, 'x', '{}', 1)")
        for i in range(10):
            log.append("T1", "node.output", {"text": f"line-{i}"})
        log.flush()
        assert log.unavailable_since is not None and log.holds_unstored("T1")
    finally:
        release.set()
        holder.join()
    for _ in range(100):
        if log.unavailable_since is None:
            break
        await asyncio.sleep(0.05)
    stored = store.events.read("T1", 1, 100)
    assert [e.seq for e in stored] == list(range(1, 12))
    assert _lines(stored) == [f"line-{i}" for i in range(10)]
    assert _retries(registry, "sqlite") >= 1
    store.close()


async def test_sqlite_a_lock_shorter_than_the_retries_only_delays_the_write(tmp_path, monkeypatch):
    monkeypatch.setattr(database, "BUSY_TIMEOUT_MS", 20)
    store = Store.sqlite(tmp_path / "afe.db")
    log = EventLog(store, Redactor())
    registry, _m = _metrics(log)
    locked, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_lock, args=(tmp_path / "afe.db", locked, release))
    holder.start()
    locked.wait(10)
    threading.Timer(0.3, release.set).start()
    log.append("T1", "node.output", {"text": "line-0"})
    log.flush()                                       # waits out the lock within the store's retries
    holder.join()
    assert log.unavailable_since is None
    assert _lines(store.events.read("T1", 1, 10)) == ["line-0"]
    assert _retries(registry, "sqlite") >= 1
    store.close()


async def test_events_kept_for_a_ticket_lost_here_are_dropped_and_the_log_is_available_again(
        tmp_path, monkeypatch):
    """A ticket lost here (R45 `fence`) while its events waited for a store that did not
    answer: they are dropped and counted, and with nothing left waiting the log no longer
    says it is unavailable (the scheduler's /readyz names the store while it does: it stayed
    503 for good after a failover, though the database answered). Positive control: the same
    without the clearing keeps the log "unavailable" with nothing in it."""
    from services.common.errors import Unavailable

    for control in (False, True):
        store = Store.sqlite(tmp_path / f"events-{control}.db")
        log = EventLog(store, Redactor())
        if control:
            monkeypatch.setattr(EventLog, "_nothing_waits", lambda self: None)

        def refuse(events):
            raise Unavailable("the test database does not answer")
        with monkeypatch.context() as m:
            _patch_append(m, store, refuse)
            for i in range(5):
                log.append("T1", "node.output", {"text": f"line-{i}"})
            log.flush()
            assert log.unavailable_since is not None and log.holds_unstored("T1")
            log.fence("T1")                        # the lease was lost here
        assert not log.holds_unstored("T1") and log.unfence("T1") == 5
        log.flush()
        if control:
            assert log.unavailable_since is not None        # stuck, with nothing kept
        else:
            assert log.unavailable_since is None
            log.append("T2", "node.output", {"text": "after"})
            log.flush()
            assert [e.type for e in store.events.read("T2", 1)] == ["node.output"]
        store.close()
