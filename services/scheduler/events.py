"""The event pipeline: per-ticket monotonic `seq`, redacted JSON payloads,
group-committed to the store, then delivered to live watchers.

`append` assigns the seq at once and buffers the event; the buffer is
written with one batched insert at the end of the current loop turn (or
when it grows large), and only then handed to watchers. So a watcher never
sees an event the store does not hold, and `watch` (history, then live, with
the seq as the cursor) has no gap and no duplicate.
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

FLUSH_AT = 512          # events buffered before a synchronous flush
MAX_PAYLOAD = 64 * 1024  # characters of a payload's JSON; longer strings are cut
FINAL_EVENT = "ticket.finished"


def now_ms() -> int:
    return int(time.time() * 1000)


def _cap(obj: object, limit: int) -> object:
    if isinstance(obj, str) and len(obj) > limit:
        return obj[:limit] + f"... [{len(obj) - limit} characters cut]"
    if isinstance(obj, dict):
        return {k: _cap(v, limit) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cap(v, limit) for v in obj]
    return obj


class EventLog:
    def __init__(self, store: Store, redactor: Redactor) -> None:
        self.store = store
        self.redactor = redactor
        self._seq: dict[str, int] = {}
        self._buffer: list[EventRecord] = []
        self._watchers: dict[str, set[asyncio.Queue]] = {}
        self._flush_scheduled = False
        self.on_flush: list[Callable[[list[EventRecord]], None]] = []

    def next_seq(self, ticket_id: str) -> int:
        seq = self._seq.get(ticket_id)
        if seq is None:
            seq = self.store.last_seq(ticket_id)
        seq += 1
        self._seq[ticket_id] = seq
        return seq

    def make(self, ticket_id: str, type_: str, payload: dict | None = None) -> EventRecord:
        clean = self.redactor.redact_obj(_cap(payload or {}, MAX_PAYLOAD))
        return EventRecord(ticket_id, self.next_seq(ticket_id), type_,
                           json.dumps(clean, sort_keys=True, ensure_ascii=False), now_ms())

    def append(self, ticket_id: str, type_: str, payload: dict | None = None) -> EventRecord:
        ev = self.make(ticket_id, type_, payload)
        self._buffer.append(ev)
        if len(self._buffer) >= FLUSH_AT:
            self.flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:
                self.flush()
        return ev

    def flush(self) -> None:
        self._flush_scheduled = False
        if not self._buffer:
            return
        batch, self._buffer = self._buffer, []
        self.store.append_events(batch)
        self.delivered(batch)

    def delivered(self, batch: list[EventRecord]) -> None:
        """Hand stored events to live watchers (also used for events the store
        wrote itself, e.g. together with a new ticket)."""
        for ev in batch:
            for q in self._watchers.get(ev.ticket_id, ()):
                q.put_nowait(ev)
        for cb in self.on_flush:
            cb(batch)

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
        q: asyncio.Queue[EventRecord] = asyncio.Queue()
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
                ev = await q.get()
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
