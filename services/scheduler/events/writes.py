"""Writing the event log's batches to the store (events.py), so that no
event is lost and no loss is hidden.

- A batch the store does not take now (`Unavailable`: the database did not
  answer within store/retry.py's budget) is kept in memory, in order with
  its seqs, and written again after a growing delay; later events join it.
- A batch whose commit was cut by a lost connection may be stored already:
  before anything is numbered again, the store's events at the batch's seqs
  are compared with it (ticket + seq, type, payload, time) and the ones it
  holds are not written twice (`_reconcile`).
- Numbering a batch again after the store's last seq happens only when
  another scheduler wrote the ticket meanwhile (docs/SCALE.md). Events that
  were truly never stored are never hidden that way: the ticket gets an
  `events.lost` event saying how many and why, where they went missing.
- A ticket this scheduler lost (its lease taken over, or given up by
  self-fencing, R45) is `fence`d here: its events not stored yet are
  dropped, as are those its stopping run still appends, and counted; a
  batch the store refuses with `LeaseLost` is counted the same way. The
  next attempt says the count in its `events.lost` (`unfence` hands it
  over): nothing of the lost attempt is written late, nothing is hidden.
- A batch is written on the store's own thread (store/worker.py), never on
  the event loop: `_write` queues it there (one `Chain`: a batch after one
  that failed is not written) and `_written` takes the outcome on the loop,
  batch by batch in order. A failed batch and every later one in flight go
  back to the front of what waits. While the store is failing only the batch
  in flight is out; the others wait for its outcome. A store without its own
  thread (tools, tests) writes at once, in the caller's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from dataclasses import dataclass, field
from time import time_ns
from typing import Any, cast

from services.common.errors import FailedPrecondition, Unavailable

from ..store.base import EventRecord, LeaseLost
from ..store.store import Store
from ..store.worker import Chain, StoreJob, ThreadedStore, store_failing, submit

log = logging.getLogger(__name__)

STORE_TRIES = 5          # batches re-numbered after another scheduler wrote the same ticket
# A store that does not answer (after its own retries, store/retry.py): the
# events wait in memory, written again after these delays, in order with
# their seqs. Past MAX_UNSTORED events, streamed output (DROPPABLE) is no
# longer kept but counted, and the ticket's `events.lost` event says how much
# went and why; state events are always kept.
RETRY_DELAYS_S = (0.5, 1.0, 2.0, 5.0)
MAX_UNSTORED = 100_000
DROPPABLE = frozenset({"node.output", "agent.message", "agent.thought"})
LOST_EVENT = "events.lost"

@dataclass
class _LossMarker:
    seq: int
    at_ms: int
    count: int = 0
    types: dict[str, int] = field(default_factory=dict)
    sealed: bool = False     # its payload went out with a batch: later losses count in a new marker


Event = tuple[str, int, str, str, int]      # EventRecord's fields, in order
# A batch handed to the store's thread: (the events as kept, as written with the
# losses filled in, its job).
InFlight = tuple[list[Event], list[Event], StoreJob[None]]


def _json(data: object) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def _now_ms() -> int:
    return time_ns() // 1_000_000


class EventWrites:
    """The store side of `EventLog`: what it writes, keeps and reports lost."""

    store: Store
    _seq: dict[str, int]
    _buffer: list[tuple[str, int, str, str, int]]
    _unstored: list[tuple[str, int, str, str, int]]
    _inflight: deque[InFlight]
    _inflight_n: int
    _chain: Chain
    _retry_handle: asyncio.TimerHandle | None
    _retries: int
    _lost_marker: dict[str, _LossMarker]
    _markers: dict[tuple[str, int], _LossMarker]
    unavailable_since: int | None
    unavailable_reason: str
    lost_metric: Any
    _watchers: dict[str, set[Any]]   # the watch queues of EventLog (log.py)
    _fenced: set[str]
    _dropped: dict[str, int]

    def _init_writes(self) -> None:
        # Redacted events not handed to the store yet, in seq order (flush).
        self._unstored = []
        # Batches on the store's thread, oldest first, and how many events they hold.
        self._inflight = deque()
        self._inflight_n = 0
        self._chain = Chain()
        self._retry_handle = None
        self._retries = 0
        self._lost_marker = {}          # ticket -> the marker its losses count in now
        self._markers = {}              # (ticket, seq) -> every marker not stored yet
        self.unavailable_since = None   # ms: the store has not taken events since
        self.unavailable_reason = ""
        self.lost_metric = None         # counter {reason} (metrics.SchedulerMetrics.events_lost)
        self._fenced = set()            # tickets lost here: their appends are counted, not written
        self._dropped = {}              # ticket -> its lost attempt's events never stored (fence, LeaseLost)

    def flush(self, write: bool = True) -> None:
        raise NotImplementedError

    def delivered(self, batch: Any) -> None:
        raise NotImplementedError

    # -- the store's thread ------------------------------------------------------------

    def _write(self) -> None:
        """Hand the events that wait to the store's thread (after the batches in flight)."""
        if not self._unstored:
            return
        if self._inflight and store_failing(self.store):
            return      # the batch in flight meets the store first; these follow its outcome
        batch, self._unstored = self._unstored, []
        sent = self._finish_markers(batch)
        job = submit(self.store, lambda s: s.events.append(cast(list[EventRecord], sent)), self._chain)
        entry: InFlight = (batch, sent, job)
        self._inflight.append(entry)
        self._inflight_n += len(batch)
        if not isinstance(self.store, ThreadedStore):
            self._written(entry)            # written here, in this call
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            job.done.wait()                 # no loop (a tool): wait for it here
            self._written(entry)
            return

        def done(_job: StoreJob[None]) -> None:
            with contextlib.suppress(RuntimeError):     # the loop is closed: the process is stopping
                loop.call_soon_threadsafe(self._written, entry)
        job.add_done_callback(done)

    def _written(self, entry: InFlight) -> None:
        """A batch's outcome, on the loop, in the order the batches went out."""
        if not self._inflight or self._inflight[0] is not entry:
            return      # handed back already: an earlier batch failed
        self._inflight.popleft()
        batch, sent, job = entry
        self._inflight_n -= len(batch)
        if job.error is None:
            self._stored(sent)
            if self._unstored and self.unavailable_since is None:
                self._write()
            return
        later = [ev for b, _sent, _job in self._inflight for ev in b]     # not written either (Chain)
        self._inflight.clear()
        self._inflight_n = 0
        self._chain = Chain()
        back = batch + later
        if self._fenced:
            # A ticket lost here while its batch was on the store's thread (R45): the batch failed
            # (the database away), so it never met the fence check; kept, it would be written once
            # the database answers and the fence is forgotten -- after the takeover. Counted instead.
            for tid in {ev[0] for ev in back} & self._fenced:
                self._count_dropped(tid, [ev for ev in back if ev[0] == tid])
            back = [ev for ev in back if ev[0] not in self._fenced]
        self._unstored = back + self._unstored
        if isinstance(job.error, Unavailable):
            self._unavailable(job.error)
            return
        self._write_now()       # refused (a takeover, another writer, an error): handled here, as before

    def _write_now(self) -> None:
        """Write what waits in this call, through `_store`'s checks (on a
        ThreadedStore, each statement a synchronous call of its thread)."""
        batch = self._unstored
        try:
            stored = self._store(batch)
        except Unavailable as exc:
            self._unavailable(exc)
            return
        except Exception as exc:  # noqa: BLE001 - refused for good: said loudly, on the ticket too
            stored = self._store_apart(batch, exc)
        self._unstored = []
        self._markers = {k: m for k, m in self._markers.items() if not m.sealed}
        self._stored(stored)

    def _stored(self, stored: list[Event]) -> None:
        if self._markers:
            for ev in stored:
                if ev[2] == LOST_EVENT:
                    self._markers.pop((ev[0], ev[1]), None)
        self._stored_again()
        if self._watchers and stored:
            self.delivered(stored)

    def _unavailable(self, exc: Exception) -> None:
        """Keep what was not stored; past MAX_UNSTORED, count further events
        as lost instead of buffering them (append)."""
        if self.unavailable_since is None:
            self.unavailable_since = time_ns() // 1_000_000
            log.warning("events: %d event(s) kept in memory until the store answers: %s", len(self._unstored), exc)
        self.unavailable_reason = str(exc)
        self._retry_later()

    def _retry_later(self) -> None:
        if self._retry_handle is not None:
            return
        delay = RETRY_DELAYS_S[min(self._retries, len(RETRY_DELAYS_S) - 1)]
        self._retries += 1
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return    # no loop (a tool, a test): the next flush tries again
        self._retry_handle = loop.call_later(delay, self._retry_now)

    def _retry_now(self) -> None:
        self._retry_handle = None
        self.flush()

    def _stored_again(self) -> None:
        if self.unavailable_since is not None:
            log.warning("events: the store answers again; the events kept since %d are stored", self.unavailable_since)
        self._available()

    def _nothing_waits(self) -> None:
        """No event waits for the store any more although none was stored: the ones kept were
        dropped (their ticket was lost here, `fence`). Nothing is kept in memory, so the log is
        not "unavailable" (readiness, append's limit); the next write finds out whether the
        store answers."""
        log.warning("events: no event waits for the store any more (the ones kept since %d were dropped)",
                    self.unavailable_since)
        self._available()

    def _available(self) -> None:
        self.unavailable_since = None
        self.unavailable_reason = ""
        self._retries = 0
        self._lost_marker.clear()       # a marker still waiting is in _markers
        if self._retry_handle is not None:
            self._retry_handle.cancel()
            self._retry_handle = None

    def _lose(self, ticket_id: str, type_: str) -> int:
        """An event that finds the memory for unstored events full: it is not
        kept, and the ticket's `events.lost` event (one per outage, written
        where the loss began) counts it. Returns the marker's seq."""
        marker = self._lost_marker.get(ticket_id)
        if marker is None or marker.sealed:
            seq = self._seq.get(ticket_id, 0) + 1
            self._seq[ticket_id] = seq
            marker = self._lost_marker[ticket_id] = _LossMarker(seq, time_ns() // 1_000_000)
            self._markers[(ticket_id, seq)] = marker
            self._buffer.append((ticket_id, seq, LOST_EVENT, "", marker.at_ms))
        marker.count += 1
        marker.types[type_] = marker.types.get(type_, 0) + 1
        if self.lost_metric is not None:
            self.lost_metric.labels(reason="store_unavailable").inc()
        return marker.seq

    def _finish_markers(self, batch: list[tuple[str, int, str, str, int]]) -> list[tuple[str, int, str, str, int]]:
        """Fill in the payload of the `events.lost` events of this batch (a
        copy: the batch keeps them empty, to be filled again if it comes back)."""
        if not self._markers:
            return batch
        out = []
        for ev in batch:
            marker = self._markers.get((ev[0], ev[1])) if ev[2] == LOST_EVENT and not ev[3] else None
            if marker is not None:
                marker.sealed = True
                text = _json({"count": marker.count, "types": marker.types,
                                 "reason": "the store did not answer and the events kept in memory reached "
                                           f"{MAX_UNSTORED}: {self.unavailable_reason}"[:2000]})
                ev = (ev[0], ev[1], ev[2], text, ev[4])
            out.append(ev)
        return out

    # -- writing ---------------------------------------------------------------

    def _store(self, batch: list[tuple[str, int, str, str, int]]) -> list[tuple[str, int, str, str, int]]:
        """Write the batch; returns what was stored (for the watchers). On a
        shared store (docs/SCALE.md) another scheduler may have written a
        ticket's events meanwhile (an approval given through it), and a batch
        whose commit was cut by a lost connection may be stored already:
        `_reconcile` tells the two apart. A ticket this scheduler lost to
        another (`LeaseLost`, R37) has its events dropped, never written."""
        batch = self._finish_markers(batch)
        already: list[tuple[str, int, str, str, int]] = []
        for _ in range(STORE_TRIES):
            try:
                # Plain tuples in EventRecord's column order: SQLite binds them fastest.
                self.store.events.append(cast(list[EventRecord], batch))
                return already + batch
            except LeaseLost as exc:
                log.warning("events of ticket %s not written: %s", exc.ticket_id, exc.message)
                self._seq.pop(exc.ticket_id, None)
                self._count_dropped(exc.ticket_id, [ev for ev in batch if ev[0] == exc.ticket_id])
                batch = [ev for ev in batch if ev[0] != exc.ticket_id]
                if not batch:
                    return already
            except FailedPrecondition:
                if not self.store.shared:
                    raise
                stored, batch = self._reconcile(batch)
                already += stored
                if not batch:
                    return already
        self.store.events.append(cast(list[EventRecord], batch))
        return already + batch

    def _reconcile(self, batch: list[tuple[str, int, str, str, int]]
                   ) -> tuple[list[tuple[str, int, str, str, int]], list[tuple[str, int, str, str, int]]]:
        """(events of the batch the store already holds, the rest numbered
        after the store's last seq). An event is held when the store has the
        same type, payload and time at its seq: the batch's own commit, cut
        by a lost connection (written once, never twice). Events another
        scheduler wrote at those seqs are not ours: ours follow them. If the
        store's seqs stop short of the batch, events before it were never
        stored: an `events.lost` event says so instead of closing the gap."""
        held: list[tuple[str, int, str, str, int]] = []
        out: list[tuple[str, int, str, str, int]] = []
        for tid in dict.fromkeys(ev[0] for ev in batch):
            mine = [ev for ev in batch if ev[0] == tid]
            stored = {e[1]: e for e in self.store.events.read(tid, mine[0][1], len(mine))}
            while mine and (e := stored.get(mine[0][1])) is not None and tuple(e)[2:] == mine[0][2:]:
                held.append(mine.pop(0))
            last = self.store.events.last_seq(tid)
            if mine and mine[0][1] > last + 1:
                missing = mine[0][1] - last - 1
                log.error("events: %d event(s) of ticket %s before seq %d were never stored", missing, tid,
                          mine[0][1])
                out.append((tid, last + 1, LOST_EVENT, _json(
                    {"count": missing, "reason": "events before these were never stored"}), _now_ms()))
                last += 1
            for ev in mine:
                last += 1
                out.append((tid, last, ev[2], ev[3], ev[4]))
            if mine:
                self._seq[tid] = last
        return held, out

    def _store_apart(self, batch: list[tuple[str, int, str, str, int]],
                     exc: Exception) -> list[tuple[str, int, str, str, int]]:
        """The store refused the batch with an error no retry can mend (a bug,
        a value it cannot hold). Each ticket's events are tried alone; those
        of a ticket the store still refuses are lost, and the ticket gets an
        `events.lost` event saying how many and why (never a renumbered run
        that hides them)."""
        log.error("events: the store refused a batch of %d event(s)", len(batch), exc_info=exc)
        stored: list[tuple[str, int, str, str, int]] = []
        for tid in dict.fromkeys(ev[0] for ev in batch):
            mine = [ev for ev in batch if ev[0] == tid]
            try:
                stored += self._store(mine)
                continue
            except Exception as one:  # noqa: BLE001 - reported below, on the ticket
                reason = f"the store refused them: {one.__class__.__name__}"
            if self.lost_metric is not None:
                self.lost_metric.labels(reason="store_error").inc(len(mine))
            last = self.store.events.last_seq(tid)
            lost = (tid, last + 1, LOST_EVENT, _json({"count": len(mine), "reason": reason}), _now_ms())
            try:
                self.store.events.append(cast(list[EventRecord], [lost]))
            except Exception:
                log.exception("events: %d event(s) of ticket %s are lost and could not be marked", len(mine), tid)
                self._seq.pop(tid, None)
                continue
            self._seq[tid] = last + 1
            stored.append(lost)
        return stored

    # -- a ticket lost here (R45) ---------------------------------------------------------

    def fence(self, ticket_id: str) -> None:
        """The ticket was lost here: drop its events not handed to the store yet, and every one its
        stopping run still appends, counting them (`unfence` hands the count over). Events already on
        the store's thread meet the store's fence check: refused, they are counted too."""
        if ticket_id in self._fenced:
            return
        self._fenced.add(ticket_id)
        mine = [ev for ev in self._buffer if ev[0] == ticket_id] + [ev for ev in self._unstored if ev[0] == ticket_id]
        if mine:
            self._buffer = [ev for ev in self._buffer if ev[0] != ticket_id]
            self._unstored = [ev for ev in self._unstored if ev[0] != ticket_id]
        self._count_dropped(ticket_id, mine)
        self._seq.pop(ticket_id, None)
        self._lost_marker.pop(ticket_id, None)
        if self.unavailable_since is not None and not (self._buffer or self._unstored or self._inflight):
            self._nothing_waits()

    def unfence(self, ticket_id: str) -> int:
        """The lost attempt is over (its run stopped, nothing of it on the store's thread any
        more): the ticket's events are written again, and the count of the ones that never were
        is returned, for the next attempt's `events.lost`."""
        self._fenced.discard(ticket_id)
        return self._dropped.pop(ticket_id, 0)

    def fenced(self, ticket_id: str) -> bool:
        return ticket_id in self._fenced

    def _count_dropped(self, ticket_id: str, events: list[Event]) -> None:
        n = 0
        for ev in events:
            if ev[2] == LOST_EVENT:         # an outage's marker: the events it counted are lost as well
                marker = self._markers.pop((ev[0], ev[1]), None)
                n += marker.count if marker is not None else 0
            else:
                n += 1
        if not n:
            return
        self._dropped[ticket_id] = self._dropped.get(ticket_id, 0) + n
        if self.lost_metric is not None:
            self.lost_metric.labels(reason="lease_lost").inc(n)

    def holds_unstored(self, ticket_id: str) -> bool:
        """Whether events of this ticket wait in memory for the store (or are on their way to it)."""
        return (any(ev[0] == ticket_id for ev in self._unstored) or any(ev[0] == ticket_id for ev in self._buffer)
                or any(ev[0] == ticket_id for b, _sent, _job in self._inflight for ev in b))
