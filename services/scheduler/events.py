"""The event pipeline: per-ticket monotonic `seq`, redacted JSON payloads,
group-committed to the store, then delivered to live watchers.

`append` assigns the seq at once and buffers the event; the buffer is
written with one batched insert a moment later (2 ms, or at once when it
grows large, or before any state change), and only then handed to watchers. So a watcher never
sees an event the store does not hold, and `watch` (history, then live, with
the seq as the cursor) has no gap and no duplicate.

Redaction is checked once per batch: every string of the batch is joined
with NUL separators and passed through the redactor; only when that changes
anything are the batch's payloads redacted one by one (R27). A match inside
one string is a match inside the joined text, so nothing is missed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

from services.common.errors import NotFound
from services.common.redact import Redactor

from .store import EventRecord, Store

log = logging.getLogger(__name__)

FLUSH_AT = 2048          # events buffered before a synchronous flush
FLUSH_DELAY_S = 0.002    # group commit: events of this window share one transaction
MAX_STRING = 64 * 1024   # characters of one payload string; longer ones are cut
FINAL_EVENT = "ticket.finished"
_SEP = "\x00"

_encode = json.JSONEncoder(ensure_ascii=False, separators=(", ", ": ")).encode
_estr = json.encoder.encode_basestring  # type: ignore[attr-defined]


def now_ms() -> int:
    return int(time.time() * 1000)


def _cut(s: str) -> str:
    return s[:MAX_STRING] + f"... [{len(s) - MAX_STRING} characters cut]"


def _to_json(data: object) -> str:
    """JSON text of a payload; flat objects of strings and ints take a fast path."""
    if data.__class__ is dict:
        parts = []
        for k, v in data.items():  # type: ignore[union-attr]
            cls = v.__class__
            if cls is str:
                parts.append(_estr(k) + ": " + _estr(v))
            elif cls is int:
                parts.append(_estr(k) + ": " + int.__repr__(v))
            elif v is True or v is False or v is None:
                parts.append(_estr(k) + ": " + ("true" if v is True else "false" if v is False else "null"))
            else:
                return _encode(data)
        return "{" + ", ".join(parts) + "}"
    return _encode(data)


def _prepare(obj: object, strings: list[str], clean_keys: frozenset[str] | set[str] = frozenset()) -> object:
    """Cap long strings and collect every string for the redaction check (keys
    too, unless already known clean)."""
    if isinstance(obj, str):
        if len(obj) > MAX_STRING:
            obj = _cut(obj)
        strings.append(obj)
        return obj
    if obj.__class__ is dict:
        # Fast path: a flat payload of short strings and scalars is kept as is
        # (payloads are built for the call and not mutated afterwards).
        flat = True
        for k, v in obj.items():  # type: ignore[union-attr]
            cls = v.__class__
            if k.__class__ is not str or not (cls is str and len(v) <= MAX_STRING or cls is int
                                               or v is None or cls is bool or cls is float):
                flat = False
                break
        if flat:
            for k, v in obj.items():  # type: ignore[union-attr]
                if k not in clean_keys:
                    strings.append(k)
                if v.__class__ is str:
                    strings.append(v)
            return obj
    if isinstance(obj, dict):
        out: dict[str, object] = {}
        for k, v in obj.items():
            if k.__class__ is not str:
                k = str(k)
            if k not in clean_keys:
                strings.append(k)
            if v.__class__ is str:
                if len(v) > MAX_STRING:
                    v = _cut(v)
                strings.append(v)
                out[k] = v
            elif isinstance(v, (int, float, bool)) or v is None:
                out[k] = v
            else:
                out[k] = _prepare(v, strings, clean_keys)
        return out
    if isinstance(obj, (list, tuple)):
        return [_prepare(v, strings, clean_keys) for v in obj]
    return obj


class EventLog:
    def __init__(self, store: Store, redactor: Redactor) -> None:
        self.store = store
        self.redactor = redactor
        self._seq: dict[str, int] = {}
        self._buffer: list[tuple[str, int, str, object, int]] = []
        self._strings: list[str] = []   # every string of the buffered events, for the redaction check
        self._watchers: dict[str, set[asyncio.Queue]] = {}
        self._flush_scheduled = False
        # Payload keys seen in clean batches (keys are mostly constants of the
        # code); forgotten whenever a secret is registered.
        self._clean_keys: set[str] = set()
        self._clean_for = redactor.count

    def next_seq(self, ticket_id: str) -> int:
        seq = self._seq.get(ticket_id)
        if seq is None:
            seq = self.store.last_seq(ticket_id)
        seq += 1
        self._seq[ticket_id] = seq
        return seq

    def make(self, ticket_id: str, type_: str, payload: dict | None = None) -> EventRecord:
        """A redacted event, not buffered (for events stored together with other rows)."""
        clean = self.redactor.redact_obj(_prepare(payload or {}, []))
        return EventRecord(ticket_id, self.next_seq(ticket_id), type_, _encode(clean), now_ms())

    def append(self, ticket_id: str, type_: str, payload: dict | None = None) -> int:
        """Buffer an event; returns its seq."""
        data = _prepare(payload or {}, self._strings, self._clean_keys)
        seq = self._seq.get(ticket_id)
        if seq is None:
            seq = self.store.last_seq(ticket_id)
        seq += 1
        self._seq[ticket_id] = seq
        self._buffer.append((ticket_id, seq, type_, data, int(time.time() * 1000)))
        if len(self._buffer) >= FLUSH_AT:
            self.flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            try:
                asyncio.get_running_loop().call_later(FLUSH_DELAY_S, self.flush)
            except RuntimeError:
                self.flush()
        return seq

    def flush(self) -> None:
        self._flush_scheduled = False
        if not self._buffer:
            return
        batch, self._buffer = self._buffer, []
        strings, self._strings = self._strings, []
        redact = self.redactor.redact
        joined = _SEP.join(strings)
        # Keys skipped as "known clean" were checked against the secrets known
        # then; if one was registered since, check every event in full.
        clean = redact(joined) == joined and self._clean_for == self.redactor.count
        if clean:
            if len(self._clean_keys) < 4096:
                for item in batch:
                    d = item[3]
                    if d.__class__ is dict:
                        self._clean_keys.update(d)  # type: ignore[arg-type]
            records = [EventRecord(tid, seq, type_, _to_json(data), at) for tid, seq, type_, data, at in batch]
        else:
            self._clean_keys = set()
            self._clean_for = self.redactor.count
            records = []
            for tid, seq, type_, data, at in batch:
                mine: list[str] = []
                _prepare(data, mine)
                one = _SEP.join(mine)
                if redact(one) != one:
                    data = self.redactor.redact_obj(data)
                records.append(EventRecord(tid, seq, type_, _to_json(data), at))
        self.store.append_events(records)
        self.delivered(records)

    def delivered(self, batch: list[EventRecord]) -> None:
        """Hand stored events to live watchers (also used for events the store
        wrote itself, e.g. together with a new ticket)."""
        if not self._watchers:
            return
        per: dict[str, list[EventRecord]] = {}
        for ev in batch:
            if ev.ticket_id in self._watchers:
                per.setdefault(ev.ticket_id, []).append(ev)
        for tid, evs in per.items():
            for q in self._watchers.get(tid, ()):
                q.put_nowait(evs)

    async def watch(self, ticket_id: str, from_seq: int, follow: bool,
                    is_terminal: Callable[[], bool]) -> AsyncIterator[EventRecord]:
        """History from `from_seq` (inclusive), then live events if `follow`.

        Ends after the final event, or after the history when the ticket is
        already terminal or `follow` is false.
        """
        self.flush()
        last = self.store.last_seq(ticket_id)
        start = max(from_seq, 1)
        if start > last + 1:
            raise NotFound(f"event seq {from_seq} does not exist for ticket {ticket_id} "
                           f"(its last seq is {last}); resume from a seq up to {last + 1}")
        q: asyncio.Queue[list[EventRecord]] = asyncio.Queue()
        self._watchers.setdefault(ticket_id, set()).add(q)
        try:
            sent = start - 1
            while True:
                page = self.store.events(ticket_id, sent + 1, 1000)
                if not page:
                    break
                for ev in page:
                    yield ev
                    sent = ev.seq
                    if ev.type == FINAL_EVENT:
                        return
            if not follow:
                return
            if is_terminal():
                # The final event is appended in the same loop turn as the
                # terminal state: flush and send what is left.
                self.flush()
                for ev in self.store.events(ticket_id, sent + 1, 1_000_000):
                    yield ev
                return
            while True:
                for ev in await q.get():
                    if ev.seq <= sent:
                        continue
                    if ev.seq != sent + 1:  # cannot happen with one writer; read the store to be sure
                        for old in self.store.events(ticket_id, sent + 1, ev.seq - sent - 1):
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
