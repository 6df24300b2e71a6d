"""The event pipeline: per-ticket monotonic `seq`, redacted JSON payloads,
group-committed to the store, then delivered to live watchers.

`append` encodes the payload, assigns the seq at once and buffers the
event; the buffer is written with one batched insert a moment later (2 ms,
or at once when it grows large, or before any state change), and only then
handed to watchers. So a watcher never sees an event the store does not
hold, and `watch` (history, then live, with the seq as the cursor) has no
gap and no duplicate.

Redaction is checked once per batch, on the batch's JSON texts joined with
NUL separators (R27). A JSON text without a backslash holds every string of
its payload verbatim, each between quotes: a match inside one string is a
match inside the joined text, so nothing is missed. Payloads whose JSON has
escapes (or strings to cut, or keys that are not strings) add their strings
themselves to the checked text. Only when the check changes anything is
each event of the batch checked on its own, and the ones that need it
re-encoded from their redacted, decoded payload.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from operator import itemgetter
from time import time_ns
from typing import Any

import orjson

from services.common.errors import NotFound, Unavailable
from services.common.secrecy.redact import Redactor

from ..store.base import EventRecord
from ..store.retry import count_outages
from ..store.store import Store
from .writes import DROPPABLE, MAX_UNSTORED, EventWrites

log = logging.getLogger(__name__)

FLUSH_AT = 2048          # events buffered before a synchronous flush
FLUSH_DELAY_S = 0.002    # group commit: events of this window share one transaction
GROUP_AT = 256           # events of one window that wait for the batch on the store's thread (_flush_soon)
MAX_STRING = 64 * 1024   # characters of one payload string; longer ones are cut
FINAL_EVENT = "ticket.finished"
# Batches a live watcher may have waiting. A watcher that falls further behind
# (a caller reading slower than the ticket writes) stops being handed batches
# and reads what it missed from the store instead, so its memory is bounded
# and it still gets every event once, in order.
WATCH_BACKLOG = 256
# A store shared by several schedulers (docs/SCALE.md): a watcher also reads
# the store by seq this often, for the events another scheduler writes.
WATCH_POLL_S = 0.25
_SEP = "\x00"

# JSON types only: dataclasses, datetimes and subclasses of str/int/dict/list
# take the slow path (which refuses what the standard encoder refuses).
_OPTS = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_SUBCLASS
_dumps = orjson.dumps
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_payload = itemgetter(3)
_type = itemgetter(2)


class _Inbox(asyncio.Queue[list[EventRecord]]):
    """A watcher's queue of delivered batches; `behind` is set when a batch was
    dropped because the queue was full (the store has it)."""

    behind = False


def now_ms() -> int:
    return time_ns() // 1_000_000


def _cut(s: str) -> str:
    return s[:MAX_STRING] + f"... [{len(s) - MAX_STRING} characters cut]"


def _to_json(data: object) -> str:
    """Compact JSON text of a payload made of JSON types."""
    try:
        return _dumps(data, option=_OPTS).decode()
    except TypeError:   # orjson.JSONEncodeError: a big int, a str subclass, ...
        return _encode(data)


def _prepare(obj: object, strings: list[str]) -> object:
    """Cap long strings, turn keys into strings, and collect every string
    (keys too) for the redaction check."""
    if isinstance(obj, str):
        if len(obj) > MAX_STRING:
            obj = _cut(obj)
        strings.append(obj)
        return obj
    if isinstance(obj, dict):
        out: dict[str, object] = {}
        for k, v in obj.items():
            if k.__class__ is not str:
                k = str(k)
            strings.append(k)
            out[k] = _prepare(v, strings)
        return out
    if isinstance(obj, (list, tuple)):
        return [_prepare(v, strings) for v in obj]
    return obj


def _strings_of(obj: object, strings: list[str]) -> None:
    """Every string of a decoded JSON value, keys included."""
    if obj.__class__ is str:
        strings.append(obj)
    elif obj.__class__ is dict:
        for k, v in obj.items():
            strings.append(k)
            _strings_of(v, strings)
    elif obj.__class__ is list:
        for v in obj:
            _strings_of(v, strings)


def _encode_payload(payload: object, strings: list[str]) -> str:
    """The payload's JSON text. When that text alone cannot stand for the
    payload's strings in the redaction check, the strings go to `strings`."""
    try:
        text = _dumps(payload, option=_OPTS).decode()
    except TypeError:
        text = None
    if text is None or "\\" in text or len(text) > MAX_STRING:
        text = _encode_slow(payload, strings)
    return text


def _encode_slow(payload: object, strings: list[str]) -> str:
    """Escapes, strings to cut, keys to convert or types orjson leaves to the
    standard encoder (which raises on what is not JSON, here, before any seq
    is taken)."""
    mine: list[str] = []
    text = _to_json(_prepare(payload, mine))
    strings.extend(mine)
    return text


class EventLog(EventWrites):
    def __init__(self, store: Store, redactor: Redactor, metrics: Any = None) -> None:
        """`metrics`: the scheduler's (metrics.SchedulerMetrics), to count the
        store's retries and the events it could not take."""
        self.store = store
        self.redactor = redactor
        self._seq: dict[str, int] = {}
        self._buffer: list[tuple[str, int, str, str, int]] = []   # EventRecord's fields, in order
        self._strings: list[str] = []   # strings of buffered events whose JSON has escapes
        self._watchers: dict[str, set[_Inbox]] = {}
        self._flush_scheduled = False
        self._init_writes()
        if metrics is not None:
            count_outages(store, self, metrics)

    def next_seq(self, ticket_id: str) -> int:
        seq = self._seq.get(ticket_id)
        if seq is None:
            seq = self.store.events.last_seq(ticket_id)
        seq += 1
        self._seq[ticket_id] = seq
        return seq

    def _redacted(self, text: str) -> str:
        """One event's JSON text with its strings redacted (decoded, checked,
        re-encoded only when something changes)."""
        data = json.loads(text)   # the standard decoder: big ints stay ints
        strings: list[str] = []
        _strings_of(data, strings)
        one = _SEP.join(strings)
        if self.redactor.redact(one) == one:
            return text
        return _to_json(self.redactor.redact_obj(data))

    def make(self, ticket_id: str, type_: str, payload: dict[str, Any] | None = None) -> EventRecord:
        """A redacted event, not buffered (for events stored together with other rows)."""
        text = self._redacted(_encode_payload(payload or {}, []))
        return EventRecord(ticket_id, self.next_seq(ticket_id), type_, text, now_ms())

    def append(self, ticket_id: str, type_: str, payload: dict[str, Any] | None = None) -> int:
        """Buffer an event; returns its seq (0: the ticket was lost here, the event is only counted)."""
        if self._fenced and ticket_id in self._fenced:
            self._dropped[ticket_id] = self._dropped.get(ticket_id, 0) + 1
            if self.lost_metric is not None:
                self.lost_metric.labels(reason="lease_lost").inc()
            return 0
        # _encode_payload, inlined: this runs for every line of command output.
        try:
            text = _dumps(payload or {}, option=_OPTS).decode()
        except TypeError:
            text = None
        if text is None or "\\" in text or len(text) > MAX_STRING:
            text = _encode_slow(payload or {}, self._strings)
        if self.unavailable_since is not None and type_ in DROPPABLE and (
                len(self._unstored) + len(self._buffer) + self._inflight_n >= MAX_UNSTORED):
            return self._lose(ticket_id, type_)
        try:
            seq = self._seq[ticket_id] + 1
        except KeyError:
            seq = self.store.events.last_seq(ticket_id) + 1
        self._seq[ticket_id] = seq
        buffer = self._buffer
        buffer.append((ticket_id, seq, type_, text, time_ns() // 1_000_000))
        if len(buffer) >= FLUSH_AT:
            self.flush(write=not self._inflight)
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            try:
                asyncio.get_running_loop().call_later(FLUSH_DELAY_S, self._flush_soon)
            except RuntimeError:
                self.flush()
        return seq

    def _flush_soon(self) -> None:
        """The group commit's timer: while the store does not answer, the
        events join the kept ones without another try (the retry timer's).
        Many events in one window (a ticket streaming fast) while a batch is on
        the store's thread wait for it and go with the next (`_written`): a
        store slower than the tickets writes fewer, larger transactions. A few
        (a ticket starting, a slow stream) go at once, for their latency. (An
        explicit `flush`, before a state change, hands everything over at once:
        the statement after it runs after them.)"""
        hold = bool(self._inflight) and len(self._buffer) >= GROUP_AT
        self.flush(write=self.unavailable_since is None and not hold)

    def flush(self, write: bool = True) -> None:
        """Redact the buffered events and hand them to the store, after any
        earlier ones it did not take yet (writes.py: on the store's own
        thread, in order; a statement submitted after this call runs after
        them). Never raises for the store: events it cannot take now are
        kept, in order with their seqs, and written again later
        (`_retry_later`); only what it refuses for good is reported on the
        ticket as lost (`_store_apart`)."""
        self._flush_scheduled = False
        if self._buffer:
            batch, self._buffer = self._buffer, []
            strings, self._strings = self._strings, []
            joined = _SEP.join(map(_payload, batch))
            if strings:
                joined += _SEP + _SEP.join(strings)
            if self.redactor.redact(joined) != joined:
                redacted = self._redacted
                batch = [ev if (text := redacted(ev[3])) is ev[3] else (ev[0], ev[1], ev[2], text, ev[4])
                         for ev in batch]
            if self._unstored:
                self._unstored.extend(batch)
            else:
                self._unstored = batch
        elif not self._unstored:
            if self.unavailable_since is not None and not self._inflight:
                self._nothing_waits()   # what waited was dropped (a ticket lost here): not unavailable any more
            return
        if write:
            self._write()

    def delivered(self, batch: Sequence[tuple[str, int, str, str, int]]) -> None:
        """Hand stored events to live watchers (also used for events the store
        wrote itself, e.g. together with a new ticket). Each watcher gets the
        list of its ticket's events, in seq order."""
        watchers = self._watchers
        if not watchers:
            return
        tids = {ev[0] for ev in batch}
        new = tuple.__new__   # EventRecord from a tuple, without its Python-level __new__
        for tid in tids:
            queues = watchers.get(tid)
            if queues:
                mine = batch if len(tids) == 1 else [ev for ev in batch if ev[0] == tid]
                evs = [new(EventRecord, ev) for ev in mine]   # the buffer holds plain tuples
                for q in queues:
                    try:
                        q.put_nowait(evs)
                    except asyncio.QueueFull:
                        q.behind = True

    async def _read_through(self, ticket_id: str, from_seq: int, limit: int) -> list[EventRecord]:
        """A read for an open watch: while the store does not answer, the watch waits and reads
        again (it never ends UNAVAILABLE halfway through; its client could not tell where)."""
        while True:
            try:
                return list(self.store.events.read(ticket_id, from_seq, limit))
            except Unavailable:
                await asyncio.sleep(WATCH_POLL_S)

    async def watch(self, ticket_id: str, from_seq: int, follow: bool,
                    is_terminal: Callable[[], bool]) -> AsyncGenerator[EventRecord, None]:
        """History from `from_seq` (inclusive), then live events if `follow`.

        Ends after the final event, or after the history when the ticket is
        already terminal or `follow` is false.
        """
        self.flush()
        # Events kept in memory while the store does not answer count as written here.
        last = max(self.store.events.last_seq(ticket_id), self._seq.get(ticket_id, 0))
        start = max(from_seq, 1)
        if start > last + 1:
            raise NotFound(f"event seq {from_seq} does not exist for ticket {ticket_id} "
                           f"(its last seq is {last}); resume from a seq up to {last + 1}")
        q: _Inbox = _Inbox(maxsize=WATCH_BACKLOG)
        self._watchers.setdefault(ticket_id, set()).add(q)
        try:
            sent = start - 1
            while True:
                try:
                    page = self.store.events.read(ticket_id, sent + 1, 1000)
                except Unavailable:
                    # The store does not answer (a database restart while the history is read, the
                    # ticket still writing): the watch stays open and reads from its cursor again.
                    await asyncio.sleep(WATCH_POLL_S)
                    continue
                if not page:
                    break
                for ev in page:
                    yield ev
                    sent = ev.seq
                    # A re-opened ticket (Engine.reopen) has events after an earlier end: go on to them.
                    if ev.type == FINAL_EVENT and not await self._read_through(ticket_id, ev.seq + 1, 1):
                        return
            if not follow:
                return
            try:
                ended = is_terminal()
            except Unavailable:
                ended = False      # the store does not answer: follow live; the end comes as an event
            if ended and not self.holds_unstored(ticket_id):
                # The final event is appended in the same loop turn as the
                # terminal state: flush and send what is left. (Events still
                # waiting for the store come through the queue once stored.)
                self.flush()
                for ev in await self._read_through(ticket_id, sent + 1, 1_000_000):
                    yield ev
                return
            poll = WATCH_POLL_S if self.store.shared else None
            while True:
                try:
                    evs = await (q.get() if poll is None else asyncio.wait_for(q.get(), poll))
                except TimeoutError:
                    q.behind = True    # another scheduler may have written: read the store from the cursor
                    evs = []
                if q.behind:
                    # Batches were dropped: forget the queue, read the store from the cursor on. Batches
                    # delivered meanwhile are skipped below by their seq.
                    while not q.empty():
                        q.get_nowait()
                    q.behind = False
                    try:
                        while page := self.store.events.read(ticket_id, sent + 1, 1000):
                            for ev in page:
                                yield ev
                                sent = ev.seq
                                if ev.type == FINAL_EVENT:
                                    return
                    except Unavailable:
                        # The store does not answer (store/worker.py): the watch stays open and reads
                        # from its cursor again once it does; nothing it missed is skipped.
                        q.behind = True
                        await asyncio.sleep(WATCH_POLL_S)
                    continue
                # The common case: the next events in order, none of them final.
                if (evs[0][1] == sent + 1 and evs[-1][1] == sent + len(evs)
                        and FINAL_EVENT not in map(_type, evs)):
                    for ev in evs:
                        yield ev
                    sent = evs[-1][1]
                    continue
                for ev in evs:
                    if ev.seq <= sent:
                        continue
                    if ev.seq != sent + 1:  # cannot happen with one writer; read the store to be sure
                        try:
                            missed = self.store.events.read(ticket_id, sent + 1, ev.seq - sent - 1)
                        except Unavailable:
                            q.behind = True    # read from the cursor once the store answers (above)
                            break
                        for old in missed:
                            yield old
                            sent = old.seq
                    yield ev
                    sent = ev.seq
                    if ev.type == FINAL_EVENT:
                        return
        finally:
            watchers = self._watchers.get(ticket_id)
            if watchers is not None:
                watchers.discard(q)
                if not watchers:
                    del self._watchers[ticket_id]
