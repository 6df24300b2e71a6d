"""A ticket's events (the events and event_counters tables): appended in
batches, read by seq.

Seqs: `event_counters` holds each ticket's last stored seq. A batch moves it
from exactly `first - 1` to its last seq in the transaction that inserts the
events; the UPDATE locks the counter's row, so of two writers that both hold
seq n, one commits n+1.. and the other finds the counter moved and is
refused (`FailedPrecondition`) with nothing written. A ticket's seqs are
1..n with no gap and no duplicate whatever the number of writers.

Fencing (R45, leases.py): the batch's transaction first checks this
scheduler's fence of every ticket in it that it holds; a lost one refuses
the whole batch (`LeaseLost`, nothing written, nothing renumbered in: the
event log drops that ticket's events and writes the rest again).

Lost events (lost_events): the old owner of a ticket it lost reports how
many events its attempt (its fence) could not store (`report_lost`, not
fenced: it no longer owns the ticket, and the row is its own report); the
new owner takes the reports (`take_lost_reports`, fenced) and says them in
an `events.lost` event.
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Sequence
from itertools import chain
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from services.common.errors import FailedPrecondition

from .base import EventRecord
from .database import Repository, db_now_ms
from .repos.base import insert_for
from .schema import event_counters, events, lost_events

_e = events.c
_c = event_counters.c
_l = lost_events.c
_COLS = ("ticket_id", "seq", "type", "payload_json", "at_ms")
_INSERTS: dict[str, str] = {}
MAX_ROWS_PER_INSERT = 2048    # SQLite: rows of one INSERT (fewer when its variable limit is lower)


def _insert_sql(conn: Connection) -> str:
    """INSERT INTO events (the five columns) as the connection's driver takes it with
    positional parameters: the statement of `events`, compiled once per database, so a
    batch goes to the driver's executemany as plain tuples (the event log's hot path)."""
    name = conn.dialect.name
    sql = _INSERTS.get(name)
    if sql is None:
        dialect_cls: Any = type(conn.dialect)
        dialect = dialect_cls(paramstyle="qmark" if name == "sqlite" else "format")
        compiled = sa.insert(events).values({c: sa.bindparam(c) for c in _COLS}).compile(dialect=dialect)
        assert tuple(compiled.positiontup or ()) == _COLS, compiled.positiontup
        sql = _INSERTS[name] = compiled.string
    return sql


def spans(batch: Sequence[Sequence[object]]) -> dict[str, tuple[int, int]]:
    """Ticket -> (first seq, last seq) of its events in `batch`, which must be consecutive."""
    one, start = cast(str, batch[0][0]), cast(int, batch[0][1])
    # One ticket (the event log's usual batch): its seqs checked at C speed.
    if (batch[-1][0] == one and len({ev[0] for ev in batch}) == 1
            and [ev[1] for ev in batch] == list(range(start, start + len(batch)))):
        return {one: (start, start + len(batch) - 1)}
    out: dict[str, list[int]] = {}
    for ev in batch:
        tid, seq = ev[0], ev[1]
        span = out.get(tid)  # type: ignore[call-overload]
        if span is None:
            out[tid] = [seq, seq]  # type: ignore[index,list-item]
        elif seq == span[1] + 1:
            span[1] = seq
        else:
            raise ValueError(f"events of ticket {tid} are not consecutive: seq {seq} after {span[1]}")
    return {tid: (s[0], s[1]) for tid, s in out.items()}


def insert_events(conn: Connection, batch: Sequence[Sequence[object]],
                  by_ticket: dict[str, tuple[int, int]] | None = None) -> None:
    """Inside the caller's write transaction: move each ticket's counter over its
    events (refusing a batch that does not start right after the stored seq), then
    insert them."""
    if not batch:
        return
    for tid, (first, last) in (by_ticket or spans(batch)).items():
        if first == 1:
            moved = conn.execute(
                sa.insert(event_counters).from_select(
                    ["ticket_id", "last_seq"],
                    sa.select(sa.literal(tid), sa.literal(last))
                    .where(~sa.exists().where(_c.ticket_id == tid)))
                .returning(_c.ticket_id)).all()
        else:
            moved = conn.execute(sa.update(event_counters).where(_c.ticket_id == tid, _c.last_seq == first - 1)
                                 .values(last_seq=last).returning(_c.ticket_id)).all()
        if len(moved) != 1:
            stored = conn.execute(sa.select(_c.last_seq).where(_c.ticket_id == tid)).scalar() or 0
            raise FailedPrecondition(
                f"events of ticket {tid} from seq {first} do not follow its stored events (last seq "
                f"{stored}): another scheduler wrote this ticket's events; nothing of this batch was stored")
    if conn.dialect.name == "sqlite":
        _insert_sqlite(conn, batch)
        return
    # EventRecord is a tuple in column order; the drivers bind exact tuples fastest
    rows = batch if type(batch[0]) is tuple else [tuple(ev) for ev in batch]
    conn.exec_driver_sql(_insert_sql(conn), rows)


def _insert_sqlite(conn: Connection, batch: Sequence[Sequence[object]]) -> None:
    """The batch as a few multi-row INSERTs (a power of two rows each, so a handful of
    statement shapes stay in the driver's cache). SQLite's driver lets go of the GIL for
    each statement it steps; one statement per row (executemany) lets go and waits for
    it again per row, and a scheduler whose loop is busy holds the store's thread to a
    row per switch interval (5 ms). One statement per few hundred rows runs beside it."""
    info = conn.connection.info      # kept with the driver's connection
    most = info.get("event_rows_per_insert")
    if most is None:
        params = conn.connection.driver_connection.getlimit(   # type: ignore[union-attr]
            sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
        most = info["event_rows_per_insert"] = 1 << (min(params // len(_COLS), MAX_ROWS_PER_INSERT).bit_length() - 1)
    i, n = 0, len(batch)
    while i < n:
        size = 1 << (min(n - i, most).bit_length() - 1)
        conn.exec_driver_sql(_values_sql(size), tuple(chain.from_iterable(batch[i:i + size])))
        i += size


@functools.cache
def _values_sql(rows: int) -> str:
    return f"INSERT INTO events ({', '.join(_COLS)}) VALUES " + ",".join(["(?,?,?,?,?)"] * rows)


class Events(Repository):
    """Append and read a ticket's events."""

    def append(self, batch: Sequence[EventRecord] | Sequence[tuple[str, int, str, str, int]]) -> None:
        """Store `batch` (each ticket's events consecutive, following its stored ones) in
        one transaction, fenced for the tickets this scheduler holds."""
        if not batch:
            return
        by_ticket = spans(batch)
        try:
            with self._write(*by_ticket) as conn:
                insert_events(conn, batch, by_ticket)
        except sa.exc.IntegrityError:
            # two writers inserted a ticket's first events at once: the other one's committed
            raise FailedPrecondition(
                f"events of ticket(s) {', '.join(sorted(by_ticket))} collided with events another scheduler "
                "stored at the same seqs; nothing of this batch was stored") from None

    def read(self, ticket_id: str, from_seq: int, limit: int = 1000) -> list[EventRecord]:
        """The ticket's events from `from_seq` on, at most `limit`, in seq order."""
        with self._read() as conn:
            rows = conn.execute(
                sa.select(_e.ticket_id, _e.seq, _e.type, _e.payload_json, _e.at_ms)
                .where(_e.ticket_id == ticket_id, _e.seq >= from_seq).order_by(_e.seq).limit(limit)).all()
        return [EventRecord(*r) for r in rows]

    def last_seq(self, ticket_id: str) -> int:
        """The ticket's last stored seq (0: none)."""
        with self._read() as conn:
            value = conn.execute(sa.select(_c.last_seq).where(_c.ticket_id == ticket_id)).scalar()
        return int(value or 0)

    def report_lost(self, ticket_id: str, fence: int, count: int) -> None:
        """The attempt of `ticket_id` with `fence` ended with `count` events unstored (a later
        report of the same attempt replaces the earlier one). Not fenced: the report of a
        scheduler that lost the ticket, read by the new owner."""
        with self.db.transaction(write=True) as conn:
            q = insert_for(conn, lost_events).values(ticket_id=ticket_id, fence=fence, count=count,
                                                      at_ms=db_now_ms())
            conn.execute(q.on_conflict_do_update(index_elements=[_l.ticket_id, _l.fence],
                                                 set_={"count": q.excluded.count, "at_ms": q.excluded.at_ms}))

    def take_lost_reports(self, ticket_id: str) -> list[tuple[int, int]]:
        """The owner takes the ticket's reports of lost attempts, [(fence, count)] oldest
        attempt first, and deletes them (fenced: only the current owner takes them)."""
        with self._write(ticket_id) as conn:
            rows = conn.execute(sa.select(_l.fence, _l.count).where(_l.ticket_id == ticket_id)
                                .order_by(_l.fence)).all()
            if rows:
                conn.execute(sa.delete(lost_events).where(_l.ticket_id == ticket_id))
        return [(int(f), int(c)) for f, c in rows]
