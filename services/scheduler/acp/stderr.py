"""The agent's stderr -> `agent.stderr` ticket events, so a person can see
why an agent died (a missing key, a crash, a bad flag).

    log = StderrLog(record)         # record(event_type, payload), synchronous
    log.feed(chunk)                 # every stderr chunk the broker streams
    log.flush()                     # on a quiet moment: complete lines only
    log.flush(final=True)           # at the end: everything, then the tail
    log.last_line()                 # for the node's error message

Bounded per node: the first `head` bytes are recorded as they come (in
events of at most `MAX_EVENT_BYTES`, cut at line ends when there is one;
at most `MAX_HEAD_EVENTS` of them); after that only the last `tail` bytes
are kept, and recorded at the end as one event that says how many bytes
were left out between (`omitted_bytes`): the end of a log is where an agent
says why it stopped. Text is decoded as UTF-8 with replacement.

Not redacted here: the events go through the scheduler's event pipeline,
which redacts registered values and secret-looking strings (R27). Lines
are kept whole where possible so a secret is not split across two events
(and so escapes the patterns).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

MAX_STDERR = 64 * 1024      # bytes of stderr recorded per node (head + tail)
TAIL = 16 * 1024            # of which: the last bytes, recorded at the end
MAX_EVENT_BYTES = 4096      # bytes of stderr per event
MAX_HEAD_EVENTS = 64        # live events before the rest waits for the tail
FLUSH_AFTER_S = 1.0         # complete lines waiting this long are recorded on the next chunk
RECENT = 1024               # bytes kept for `last_line`

Record = Callable[[str, dict[str, Any]], None]


class StderrLog:
    def __init__(self, record: Record, *, limit: int = MAX_STDERR, tail: int = TAIL) -> None:
        self._record = record
        self._head_room = limit - tail      # bytes the live events may still take
        self._tail_limit = tail
        self._head_events = 0
        self._pending = bytearray()         # head bytes not yet recorded
        self._since = 0.0                   # when the oldest pending byte arrived
        self._tail = bytearray()            # the last bytes after the head
        self._after_head = 0                # bytes that went past the head
        self._recent = bytearray()
        self._closed = False
        self.total = 0                      # bytes seen

    def feed(self, data: bytes) -> None:
        if self._closed or not data:
            return
        self.total += len(data)
        self._recent += data
        del self._recent[: max(len(self._recent) - RECENT, 0)]
        take = min(len(data), self._head_room)
        if take:
            if not self._pending:
                self._since = time.monotonic()
            self._pending += data[:take]
            self._head_room -= take
        while len(self._pending) >= MAX_EVENT_BYTES:
            if not self._emit_head(final=False, whole=False):
                break
        if self._pending and time.monotonic() - self._since >= FLUSH_AFTER_S:
            self.flush()
        if take < len(data):
            # The head is full: it ends at its last line end; a started line belongs to the tail.
            nl = self._pending.rfind(b"\n")
            if nl >= 0:
                partial, self._pending = bytes(self._pending[nl + 1:]), self._pending[: nl + 1]
                self._to_tail(partial)
            self._to_tail(data[take:])      # after what the head held (or gave to the tail): in order

    def flush(self, *, final: bool = False) -> None:
        """Record pending complete lines (all pending bytes and the tail if `final`)."""
        if self._closed:
            return
        while self._pending:
            if not self._emit_head(final=final, whole=True):
                break
        if final:
            self._closed = True
            if self._tail:
                text = bytes(self._tail)
                omitted = self._after_head - len(text)
                if omitted > 0:
                    nl = text.find(b"\n")
                    if 0 <= nl < len(text) - 1:      # start at a line: no half line, no half secret
                        omitted += nl + 1
                        text = text[nl + 1:]
                payload: dict[str, Any] = {"text": text.decode("utf-8", "replace")}
                if omitted > 0:
                    payload["omitted_bytes"] = omitted
                self._record("agent.stderr", payload)

    def last_line(self, limit: int = 300) -> str:
        """The last non-empty line the agent wrote on stderr (clipped, control
        characters such as terminal escapes shown as '?'), or ''."""
        for line in reversed(bytes(self._recent).decode("utf-8", "replace").splitlines()):
            line = "".join(ch if ch.isprintable() else "?" for ch in line.strip())
            if line:
                return line if len(line) <= limit else line[: limit - 1] + "…"
        return ""

    # -- internals -----------------------------------------------------------

    def _to_tail(self, data: bytes) -> None:
        self._after_head += len(data)
        self._tail += data
        del self._tail[: max(len(self._tail) - self._tail_limit, 0)]

    def _emit_head(self, *, final: bool, whole: bool) -> bool:
        """Record one event from the pending head bytes; False if nothing was ready."""
        if self._head_events >= MAX_HEAD_EVENTS - 1 and not final:
            # Out of live events: what is pending, and all that follows, goes to the tail.
            pending, self._pending = bytes(self._pending), bytearray()
            self._head_room = 0
            self._to_tail(pending)
            return False
        piece = bytes(self._pending[:MAX_EVENT_BYTES])
        nl = piece.rfind(b"\n")
        if nl >= 0:
            piece = piece[: nl + 1]
        elif whole and not final and len(piece) < MAX_EVENT_BYTES:
            return False                     # a line still being written
        del self._pending[: len(piece)]
        self._since = time.monotonic()
        self._head_events += 1
        self._record("agent.stderr", {"text": piece.decode("utf-8", "replace")})
        return True
