"""The polling cursor on both databases: the earliest next poll is kept with
the ETag and the newest event id. (A cursor an afe before version 8 of the
hand-written migrations left empty was made "listed, nothing seen" by that
migration; the store adopts only databases past it: test_store_migrations.py.)"""

from __future__ import annotations

import pytest

from services.scheduler.store.base import PollCursor
from tests.support.postgres import open_store_url

pytestmark = pytest.mark.timeout(120)

def test_both_stores_keep_the_next_poll_with_the_cursor(store_url, tmp_path):
    store = open_store_url(store_url, tmp_path)
    try:
        assert store.intake.poll_cursor("ws") == PollCursor()
        store.intake.put_poll_cursor("ws", PollCursor('W/"a"', "0", 1_800_000_000_000), 1)
        assert store.intake.poll_cursor("ws") == PollCursor('W/"a"', "0", 1_800_000_000_000)
        store.intake.put_poll_cursor("ws", PollCursor('W/"b"', "1234", 1_800_000_060_000), 2)
        assert store.intake.poll_cursor("ws") == PollCursor('W/"b"', "1234", 1_800_000_060_000)
        assert store.intake.poll_cursor("other") == PollCursor()
    finally:
        store.close()
