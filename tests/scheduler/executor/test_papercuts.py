"""Small things users hit: the `afe_tickets` gauge counts finished tickets
(so the failed-tickets alert in OPERATIONS.md can fire), and a `run:` line
gets the ticket's title as one argument through the executor."""

from __future__ import annotations

import pytest

from services.scheduler.store.base import FAILED, SUCCEEDED

pytestmark = pytest.mark.timeout(10)

WORKFLOWS = """\
kind: Workflow
name: bad
workspace: ws
nodes:
  - {id: bad, run: "echo no; exit 4"}
---
kind: Workflow
name: good
workspace: ws
nodes:
  - {id: ok, run: "echo {{ticket.title}}"}
"""


def _gauge(engine, state: str) -> float:
    return engine.metrics.tickets.labels(state=state)._value.get()


async def test_tickets_gauge_counts_failed_and_succeeded_tickets(harness):
    h = harness(WORKFLOWS)
    engine = await h.start()
    bad1, bad2, good = h.create("bad"), h.create("bad"), h.create("good", title="one; two")
    assert (await h.until(bad1)).state == FAILED and (await h.until(bad2)).state == FAILED
    assert (await h.until(good)).state == SUCCEEDED
    assert _gauge(engine, "failed") == 2 and _gauge(engine, "succeeded") == 1
    assert _gauge(engine, "running") == 0
    # The run line was given the title as $1, not spliced into the shell text.
    assert [c for t, c in h.sandbox.started if t == good] == ['echo "${1}"']

    await h.restart()    # counted from the store again after a restart
    assert _gauge(h.engine, "failed") == 2
