"""The polling cursor in both stores: the earliest next poll is kept with
the ETag and the newest event id (migration 0008), and a cursor an older afe
left empty after a listing with no events becomes "listed, nothing seen",
so its next events are not taken for history."""

from __future__ import annotations

import sqlite3

import pytest

from services.scheduler.store.base import PollCursor
from services.scheduler.store.sqlite import MIGRATIONS, SqliteStore
from tests.support.postgres import open_store_url

pytestmark = pytest.mark.timeout(120)

BEFORE_0008 = 7         # the schema version an afe without the next poll left


def test_both_stores_keep_the_next_poll_with_the_cursor(store_url, tmp_path):
    store = open_store_url(store_url, tmp_path)
    try:
        assert store.poll_cursor("ws") == PollCursor()
        store.put_poll_cursor("ws", PollCursor('W/"a"', "0", 1_800_000_000_000), 1)
        assert store.poll_cursor("ws") == PollCursor('W/"a"', "0", 1_800_000_000_000)
        store.put_poll_cursor("ws", PollCursor('W/"b"', "1234", 1_800_000_060_000), 2)
        assert store.poll_cursor("ws") == PollCursor('W/"b"', "1234", 1_800_000_060_000)
        assert store.poll_cursor("other") == PollCursor()
    finally:
        store.close()


def test_an_old_empty_cursor_is_migrated_to_listed_nothing_seen(tmp_path):
    path = tmp_path / "afe.db"
    db = sqlite3.connect(path, isolation_level=None)
    for script in MIGRATIONS[:BEFORE_0008]:
        for stmt in script.split(";"):
            if stmt.strip():
                db.execute(stmt)
    db.execute(f"PRAGMA user_version={BEFORE_0008}")
    db.execute("INSERT INTO github_poll_cursors (workspace, etag, last_event_id, updated_at_ms) VALUES "
               "('empty', 'W/\"e\"', '', 1), ('seen', 'W/\"s\"', '1234', 1)")
    db.close()
    store = SqliteStore(path)
    try:
        assert store.poll_cursor("empty") == PollCursor('W/"e"', "0", 0)
        assert store.poll_cursor("seen") == PollCursor('W/"s"', "1234", 0)
        assert store.poll_cursor("never") == PollCursor()
    finally:
        store.close()
