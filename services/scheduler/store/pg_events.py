"""Writing a batch of ticket events to PostgreSQL so that each ticket's seqs
stay 1..n whatever the number of schedulers writing.

Event seqs: `event_counters` holds each ticket's last stored seq. A batch
moves it from exactly `first - 1` to its last seq in the transaction that
inserts the events; the UPDATE locks the counter's row, so of two writers
that both hold seq n, one commits n+1.. and the other finds the counter moved
and is refused (`FailedPrecondition`) with nothing written. A ticket's seqs
are 1..n with no gap and no duplicate whatever the number of writers.
"""

from __future__ import annotations

import psycopg

from services.common.errors import FailedPrecondition

from .base import EventRecord

COPY_FROM = 64                # batches of this many events or more go in with COPY
_INSERT_EVENT = "INSERT INTO events (ticket_id, seq, type, payload_json, at_ms) VALUES (%s,%s,%s,%s,%s)"


def insert_events(cur: psycopg.Cursor, events: list[EventRecord]) -> None:
    """Inside the caller's transaction: move each ticket's counter over its
    events (refusing a batch that does not start right after the stored
    seq), then insert them."""
    if not events:
        return
    spans: dict[str, list[int]] = {}   # ticket -> [first seq, last seq]
    for ev in events:
        tid, seq = ev[0], ev[1]
        span = spans.get(tid)
        if span is None:
            spans[tid] = [seq, seq]
        elif seq == span[1] + 1:
            span[1] = seq
        else:
            raise ValueError(f"events of ticket {tid} are not consecutive: seq {seq} after {span[1]}")
    for tid, (first, last) in spans.items():
        if first == 1:
            cur.execute("INSERT INTO event_counters (ticket_id, last_seq) VALUES (%s,%s) "
                        "ON CONFLICT (ticket_id) DO NOTHING", (tid, last))
        else:
            cur.execute("UPDATE event_counters SET last_seq=%s WHERE ticket_id=%s AND last_seq=%s",
                        (last, tid, first - 1))
        if cur.rowcount != 1:
            row = cur.execute("SELECT last_seq FROM event_counters WHERE ticket_id=%s", (tid,)).fetchone()
            stored = int(row[0]) if row else 0
            raise FailedPrecondition(
                f"events of ticket {tid} from seq {first} do not follow its stored events (last seq "
                f"{stored}): another scheduler wrote this ticket's events; nothing of this batch was stored")
    if len(events) >= COPY_FROM:
        with cur.copy("COPY events (ticket_id, seq, type, payload_json, at_ms) FROM STDIN") as copy:
            for ev in events:
                copy.write_row(ev)
    else:
        cur.executemany(_INSERT_EVENT, events)
