"""A live watcher whose caller reads slower than the ticket writes holds at
most WATCH_BACKLOG batches in the scheduler; past that it catches up from the
store, and still gets every event once, in order (docs/AUTOMATION.md)."""

from __future__ import annotations

import pytest

from services.common.secrecy.redact import Redactor
from services.scheduler.events import log as events_mod
from services.scheduler.events.log import EventLog
from services.scheduler.store.store import Store

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("backlog", [4, 0])   # 0: an unbounded queue, the behaviour without the bound
async def test_slow_watcher_memory_is_bounded_and_it_misses_nothing(tmp_path, monkeypatch, backlog):
    monkeypatch.setattr(events_mod, "WATCH_BACKLOG", backlog)
    log = EventLog(Store.sqlite(tmp_path / "afe.db"), Redactor())
    tid = "t-1"
    log.append(tid, "ticket.created", {})
    log.flush()
    watch = log.watch(tid, 1, True, lambda: False)
    first = await watch.__anext__()              # the watcher is live and registered
    assert first.seq == 1
    (inbox,) = log._watchers[tid]
    batches = 50
    for i in range(batches):                     # 50 flushes = 50 delivered batches, none read yet
        log.append(tid, "node.output", {"text": f"line {i}"})
        log.flush()
    if backlog:
        assert inbox.qsize() == backlog and inbox.behind     # bounded: the rest is left in the store
    else:
        assert inbox.qsize() == batches                       # control: without the bound it grows
    log.append(tid, "ticket.finished", {})
    log.flush()
    seqs = [first.seq] + [ev.seq async for ev in watch]
    assert seqs == list(range(1, batches + 3))
