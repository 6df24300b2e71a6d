"""The store side of the signed run records (R42, migration 0009) on SQLite
and PostgreSQL: one envelope per (ticket, head, kind), the first one kept
(a resumed ticket that signs again keeps what was attached), listed oldest
first, and under the store's retry wrapper like every store method."""

from __future__ import annotations

import pytest

from services.scheduler.store.run_records import DECISION, REQUEST, RunRecord
from tests.support.postgres import open_store_url

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def store(store_url, tmp_path):
    s = open_store_url(store_url, tmp_path)
    try:
        yield s
    finally:
        s.close()


def test_run_records_keep_the_first_envelope_per_ticket_head_and_kind(store):
    a, b = "a" * 40, "b" * 40
    assert store.run_records.run_record("t1", a, REQUEST) is None and store.run_records.run_records("t1") == []
    first = store.run_records.put_run_record(RunRecord("t1", a, REQUEST, '{"n": 1}', 10))
    assert first.envelope == '{"n": 1}'
    again = store.run_records.put_run_record(RunRecord("t1", a, REQUEST, '{"n": 2}', 11))
    assert again == first                                   # the stored one, not the new one
    store.run_records.put_run_record(RunRecord("t1", a, DECISION, '{"d": 1}', 20))
    store.run_records.put_run_record(RunRecord("t1", b, REQUEST, '{"n": 3}', 30))
    store.run_records.put_run_record(RunRecord("t2", a, REQUEST, '{"x": 1}', 5))
    assert [(r.sha, r.kind) for r in store.run_records.run_records("t1")] == [(a, REQUEST), (a, DECISION), (b, REQUEST)]
    assert store.run_records.run_record("t1", a, DECISION).envelope == '{"d": 1}'
    assert getattr(store.run_records.put_run_record, "__wrapped_store_method__", False)   # retried like the rest
