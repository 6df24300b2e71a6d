"""The event pipeline on a real store (SQLite and PostgreSQL): per-ticket monotonic seq,
history then live with no gap and no duplicate across reconnects, and
redacted payloads (R27)."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.common.errors import NotFound
from services.common.secrecy.redact import Redactor
from services.scheduler.events.log import GROUP_AT, EventLog
from services.scheduler.store.store import Store
from services.scheduler.store.worker import ThreadedStore
from tests.support.postgres import open_store_url

pytestmark = pytest.mark.timeout(60)

SECRET = "s3cr3t-Value-9f8e7d6c"


@pytest.fixture(params=["on-the-loop", "own-thread"])
def make_log(store_url, tmp_path, request):
    """An EventLog on a new store of each backend, called where it is made or,
    as in the scheduler, on the store's own thread (store/worker.py)."""
    stores = []

    def make(redactor: Redactor | None = None) -> EventLog:
        store = open_store_url(store_url, tmp_path)
        stores.append(ThreadedStore(store) if request.param == "own-thread" else store)
        return EventLog(stores[-1], redactor or Redactor())

    yield make
    for s in stores:
        s.close()


async def _collect(log: EventLog, tid: str, from_seq: int, n: int) -> list[int]:
    seqs = []
    async for ev in log.watch(tid, from_seq, True, lambda: False):
        seqs.append(ev.seq)
        if len(seqs) == n:
            break
    return seqs


async def test_seq_is_per_ticket_and_monotonic(make_log):
    log = make_log()
    a = [log.append("t-a", "x", {"i": i}) for i in range(3)]
    b = [log.append("t-b", "x", {"i": i}) for i in range(2)]
    log.flush()
    assert a == [1, 2, 3] and b == [1, 2]
    # A new EventLog on the same store continues the sequence (after a restart).
    log2 = EventLog(log.store, Redactor())
    assert log2.append("t-a", "x", {}) == 4


async def test_watch_has_no_gap_and_no_duplicate_while_events_arrive(make_log):
    log = make_log()
    total = 3000

    async def produce():
        for i in range(total):
            log.append("t-1", "node.output", {"i": i})
            if i % 7 == 0:
                await asyncio.sleep(0)

    producer = asyncio.create_task(produce())
    await asyncio.sleep(0)
    first = asyncio.create_task(_collect(log, "t-1", 1, total))
    # A second watcher joins late, reading history then live.
    await asyncio.sleep(0.01)
    late = asyncio.create_task(_collect(log, "t-1", 1, total))
    await producer
    assert await first == list(range(1, total + 1))
    assert await late == list(range(1, total + 1))
    # Reconnect from the middle: exactly the tail.
    log.append("t-1", "ticket.finished", {})
    tail = [e.seq async for e in log.watch("t-1", 2500, True, lambda: True)]
    assert tail == list(range(2500, total + 2))


async def test_watch_beyond_the_last_seq_is_not_found(make_log):
    log = make_log()
    log.append("t-1", "x", {})
    log.flush()
    assert [e.seq async for e in log.watch("t-1", 2, False, lambda: False)] == []
    with pytest.raises(NotFound):
        async for _ in log.watch("t-1", 3, True, lambda: False):
            pass


def _stored(log: EventLog, tid: str) -> list[str]:
    log.flush()
    return [e.payload_json for e in log.store.events.read(tid, 1)]


async def test_r27_registered_secret_and_secret_shapes_are_redacted_in_events(make_log, tmp_path):
    token = "ghp_" + "a1B2c3D4e5F6g7H8i9J0"
    payloads = [{"text": f"the value is {SECRET}"}, {"nested": [{"deep": f"token={token}"}]},
                {"clean": "nothing to hide"}, {SECRET: "as a key"}]
    # Positive control: without the defence the values reach the store.
    plain = EventLog(Store.sqlite(tmp_path / "plain.db"), Redactor())
    plain.redactor.redact = lambda text: text  # type: ignore[method-assign]
    plain.redactor.redact_obj = lambda obj: obj  # type: ignore[method-assign]
    for p in payloads:
        plain.append("t-1", "node.output", p)
    raw = "".join(_stored(plain, "t-1"))
    assert SECRET in raw and token in raw

    redactor = Redactor()
    redactor.register(SECRET)
    log = make_log(redactor)
    for p in payloads:
        log.append("t-1", "node.output", p)
    stored = _stored(log, "t-1")
    text = "".join(stored)
    assert SECRET not in text and token not in text and "[redacted]" in text
    assert json.loads(stored[2]) == {"clean": "nothing to hide"}      # clean events are untouched
    for s in stored:
        json.loads(s)


async def test_long_payload_strings_are_cut(make_log):
    log = make_log()
    log.append("t-1", "node.output", {"text": "x" * 200_000})
    (stored,) = _stored(log, "t-1")
    assert len(stored) < 70_000 and "characters cut" in stored


@pytest.mark.timeout(30)
async def test_pathological_output_does_not_hang_the_event_log(make_log):
    # A token-like run that ends in a near-miss used to make the redactor
    # backtrack for minutes; command output is attacker-controlled.
    nasty = "x" + "0123456789abcdef" * 8 + "AKIA" + "B" * 16
    log = make_log()
    for i in range(50):
        log.append("t-1", "node.output", {"text": f"https://u:p@h/{nasty}{i}"})
    stored = _stored(log, "t-1")
    assert len(stored) == 50 and all("[redacted]" in s for s in stored)


async def _group_commit_sizes(tmp_path, explicit: bool, n: int = GROUP_AT) -> tuple[list[int], list[int]]:
    """Batch sizes the store's thread was handed while its first batch was held up, and the
    seqs stored: n events go out, then 2n more in two timer windows (or two explicit flushes)."""
    import threading

    from services.scheduler.store.worker import threaded

    inner = Store.sqlite(tmp_path / "gc.db")
    gate, sizes = threading.Event(), []
    original = inner.events.append

    def held_append(batch):
        sizes.append(len(batch))
        if len(sizes) == 1:
            gate.wait(10)
        original(batch)

    inner.events.append = held_append
    store = threaded(inner)
    log = EventLog(store, Redactor())
    try:
        for part in range(3):
            for i in range(n):
                log.append("t-gc", "node.output", {"line": part * n + i})
            if explicit:
                log.flush()
            await asyncio.sleep(0.02)        # the group commit's timer (2 ms) has fired
        gate.set()
        for _ in range(500):
            if not log._inflight and not log._unstored:
                break
            await asyncio.sleep(0.01)
        return sizes, [ev.seq for ev in store.events.read("t-gc", 1)]
    finally:
        store.close()


async def test_a_fast_streams_timer_flushes_wait_for_the_batch_on_the_stores_thread_and_go_as_one(tmp_path):
    n = GROUP_AT
    sizes, seqs = await _group_commit_sizes(tmp_path, explicit=False)
    assert sizes == [n, 2 * n] and seqs == list(range(1, 3 * n + 1))
    # Controls: an explicit flush (before a state change) hands its events over at once, and a
    # few events of a window (a ticket starting) go at once too, for their latency.
    for sub, explicit, k in (("x", True, n), ("y", False, 10)):
        (tmp_path / sub).mkdir()
        sizes, seqs = await _group_commit_sizes(tmp_path / sub, explicit=explicit, n=k)
        assert sizes == [k, k, k] and seqs == list(range(1, 3 * k + 1)), (sub, sizes)
