"""The store's own thread (store/worker.py, issue 32): every statement runs on
one thread that owns the connection, never on the event loop; a database
that does not answer (here SQLite locked by another connection, a real
SQLITE_BUSY) holds neither the loop nor a synchronous caller, an awaited
call rides it out, a call whose caller stopped waiting is never written,
and the event log's batches go out in order and reach their watchers once
stored. Each with today's shape (the store called on the loop) shown
freezing the loop first. PostgreSQL stopped under a running scheduler:
test_store_outage.py."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time

import pytest

from services.common.secrecy.redact import Redactor
from services.scheduler.events.log import EventLog
from services.scheduler.store import database
from services.scheduler.store.base import EventRecord, TicketRecord
from services.scheduler.store.retry import StoreUnavailable
from services.scheduler.store.store import Store
from services.scheduler.store.worker import (
    Chain,
    Skipped,
    ThreadedStore,
    run_in_store,
    store_answers,
    store_failing,
)

pytestmark = pytest.mark.timeout(60)

LOCK_S = 1.0


@pytest.fixture
def store_file(tmp_path, monkeypatch):
    # SQLite's own wait for a lock, before the store's retries (5 s in the scheduler): short here.
    monkeypatch.setattr(database, "BUSY_TIMEOUT_MS", 20)
    return tmp_path / "afe.db"


def _ticket(tid: str) -> TicketRecord:
    return TicketRecord(id=tid, workspace="ws", workflow="wf", title="t", body="", inputs={}, state="queued",
                        created_at_ms=1, updated_at_ms=1)


def _lock(path) -> sqlite3.Connection:
    """Another connection holding the write lock (as another process would)."""
    other = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    return other


class Ticker:
    """How long the event loop went without running a task (the freeze)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            self.worst = max(self.worst, now - last)
            last = now

    def __enter__(self) -> Ticker:  # noqa: PYI034
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


def _statement_threads(store: Store) -> set[int]:
    seen: set[int] = set()
    raw = store.db.connection().connection.driver_connection      # the store's one sqlite3 connection
    raw.set_trace_callback(lambda _sql: seen.add(threading.get_ident()))
    return seen


async def test_every_statement_runs_on_the_store_thread_never_on_the_loop(store_file, tmp_path):
    loop_thread = threading.get_ident()
    # Positive control: today's shape, the store called on the loop, runs its statements there.
    raw = Store.sqlite(tmp_path / "raw.db")
    seen = _statement_threads(raw)
    raw.tickets.create(_ticket("t-1"), [], [])
    assert seen == {loop_thread}
    raw.close()

    inner = Store.sqlite(store_file)
    seen = _statement_threads(inner)
    store = ThreadedStore(inner)
    try:
        store.tickets.create(_ticket("t-1"), [], [])                               # a synchronous call
        assert await run_in_store(store, lambda s: s.tickets.get("t-1")) is not None   # an awaited one
        log = EventLog(store, Redactor())
        for i in range(50):
            log.append("t-1", "x", {"i": i})
        log.flush()
        assert store.events.last_seq("t-1") == 50      # submitted after the flush: runs after its batch
        assert await store_answers(store) and store.ping()
        store.checkpoint()                      # SQLite's WAL checkpoint, on the thread too
        assert seen == {store.thread._thread.ident} and loop_thread not in seen
    finally:
        store.close()
    assert not store.thread._thread.is_alive()


@pytest.mark.slow
async def test_a_database_that_does_not_answer_holds_neither_the_loop_nor_a_synchronous_call(store_file):
    store = ThreadedStore(Store.sqlite(store_file))
    other = _lock(store_file)
    try:
        with Ticker() as ticker:
            # An awaited write rides the outage on the store's thread ...
            write = asyncio.create_task(run_in_store(store, lambda s: s.intake.claim_once("kept", 1)))
            while not store_failing(store):  # noqa: ASYNC110 - the store's thread says so
                await asyncio.sleep(0.01)
            # ... a synchronous call is refused at once, naming the store ...
            start = time.monotonic()
            with pytest.raises(StoreUnavailable, match=r"the SQLite store afe\.db does not answer"):
                store.tickets.get("t-1")
            refused_s = time.monotonic() - start
            assert not await store_answers(store)         # readiness: at once not ready
            # ... and an awaited call that stops waiting is given up, never written.
            with pytest.raises(StoreUnavailable, match=r"no answer within 0\.2 s"):
                await run_in_store(store, lambda s: s.intake.claim_once("given-up", 1), timeout=0.2)
            await asyncio.sleep(LOCK_S)
            assert not write.done()
            other.execute("ROLLBACK")                     # the database answers again
            assert await asyncio.wait_for(write, 10) is True
        assert refused_s < 0.1, refused_s
        assert ticker.worst < 0.25, f"the loop stood still {ticker.worst:.2f} s"
        assert not store_failing(store) and await store_answers(store)
        assert store.intake.claim_once("kept", 2) is False                 # written once, by the awaited call
        assert store.intake.claim_once("given-up", 2) is True              # the given-up call wrote nothing
    finally:
        other.close()
        store.close()


@pytest.mark.slow
async def test_positive_control_todays_store_on_the_loop_freezes_it(store_file):
    store = Store.sqlite(store_file)
    other = _lock(store_file)
    threading.Timer(LOCK_S, lambda: other.execute("ROLLBACK")).start()
    try:
        with Ticker() as ticker:
            await asyncio.sleep(0.05)
            assert store.intake.claim_once("kept", 1) is True         # retried on the loop's own thread
            await asyncio.sleep(0.05)
        assert ticker.worst > LOCK_S * 0.8, f"the loop stood still only {ticker.worst:.2f} s"
    finally:
        other.close()
        store.close()


@pytest.mark.slow
async def test_event_batches_written_through_an_outage_in_order_and_delivered_once_stored(store_file):
    store = ThreadedStore(Store.sqlite(store_file))
    store.tickets.create(_ticket("t-1"), [], [])
    log = EventLog(store, Redactor())
    seen: list[int] = []

    async def follow() -> None:
        async for ev in log.watch("t-1", 1, True, lambda: False):
            seen.append(ev.seq)
            if ev.seq == 400:
                return
    watcher = asyncio.create_task(follow())
    await asyncio.sleep(0.1)            # the watcher has read the (empty) history and waits live
    other = _lock(store_file)
    try:
        with Ticker() as ticker:
            for i in range(400):
                log.append("t-1", "node.output", {"text": f"line-{i}"})
                if i % 50 == 0:
                    log.flush()       # as a state change does: returns at once, the batch is queued
                await asyncio.sleep(0.002)
            assert seen == [] and log.holds_unstored("t-1")     # nothing delivered before it is stored
            other.execute("ROLLBACK")
            await asyncio.wait_for(watcher, 20)
        assert ticker.worst < 0.25, f"the loop stood still {ticker.worst:.2f} s"
    finally:
        other.close()
    assert seen == list(range(1, 401))
    stored = store.events.read("t-1", 1, 1000)
    assert [e.seq for e in stored] == list(range(1, 401))
    assert [e.payload_json for e in stored] == [f'{{"text":"line-{i}"}}' for i in range(400)]
    assert not log.holds_unstored("t-1") and log.unavailable_since is None
    store.close()


async def test_a_chain_stops_at_its_first_failure(store_file):
    store = ThreadedStore(Store.sqlite(store_file))
    chain = Chain()
    ran: list[int] = []

    def job(i: int):
        def run(s) -> int:
            ran.append(i)
            if i == 1:
                raise ValueError("refused")
            return i
        return run
    jobs = [store.thread.submit(job(i), chain) for i in range(4)]
    for j in jobs:
        j.done.wait(5)
    assert ran == [0, 1]
    assert jobs[0].result() == 0 and isinstance(jobs[1].error, ValueError)
    assert all(isinstance(j.error, Skipped) for j in jobs[2:])
    assert store.thread.submit(job(5), Chain()).done.wait(5) and ran == [0, 1, 5]   # a new chain runs
    store.close()


def test_close_runs_what_is_queued_then_closes_on_the_thread(store_file):
    store = ThreadedStore(Store.sqlite(store_file))
    store.tickets.create(_ticket("t-1"), [], [])
    jobs = [store.thread.submit(lambda s, i=i: s.events.append([EventRecord("t-1", i, "x", "{}", 1)]))
            for i in range(1, 51)]
    store.close()
    assert all(j.done.is_set() and j.error is None for j in jobs)
    assert store.inner.db._conn is None          # closed (on the store's thread)
    again = Store.sqlite(store_file)
    assert again.events.last_seq("t-1") == 50
    again.close()
