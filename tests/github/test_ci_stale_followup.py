"""A CI round queued while its ticket runs (docs/GITHUB.md, "Failing CI"):
the failing check of head H1 arrives while a re-run of the ticket is under
way; its follow-up waits (`queued`). When that re-run ends having pushed a
newer head, the failure of H1 is stale: the follow-up is dropped with a
`followup.dropped` event saying why, the ticket is not re-opened, and the
round does not count against on_ci_failure. The comment that announced the
round on the pull request (while the ticket ran: "once its current run
ends, unless ...") is corrected: not taken up. Positive control: a re-run
that pushed nothing (the head is still H1) is followed by the CI round's
re-run, and the comment still announces the round. A head that moved within
the CI settle window starts no round and announces none.

The real gateway process gets GitHub's example `check_run` payload, signed;
the engine's dispatcher runs with each run held (`HeldRuns`)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from services.scheduler.engine.followups import follow_up
from services.scheduler.store.base import PullRequestRecord
from services.scheduler.store.ci_records import QUIET, ROUND

from .test_ci import NUMBER, SHA, _check_run, _serve_failing_check
from .test_ci import _afe_ticket as _ticket_with_pr
from .test_review_gathering import HeldRuns

pytestmark = pytest.mark.timeout(120)

NEWER = "c" * 40


def _events(store, tid: str, type_: str) -> list[dict]:
    return [json.loads(e.payload_json) for e in store.events.read(tid, 1, 100_000) if e.type == type_]


async def _until(cond, deadline_s: float = 20) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("pushed", [True, False], ids=["newer-head-pushed", "positive-control-same-head"])
async def test_a_ci_round_queued_while_the_ticket_runs_is_dropped_once_its_head_is_old(stack, examples, pushed):
    tid = _ticket_with_pr(stack, rounds=2)
    _serve_failing_check(stack)
    engine, store = stack.scheduler.engine, stack.scheduler.store
    runs = HeldRuns(engine)
    await follow_up(engine, tid, "Rename the function", principal="alice")     # a re-run, from H1
    await runs.started(1)
    status, doc = await stack.post("check_run", _check_run(examples))       # CI of H1 fails meanwhile
    assert (status, doc["reason"]) == (202, "followup")
    await _until(lambda: bool(store.followups.pending_followups(tid)))
    [received] = [r for r in _events(store, tid, "followup.received") if r["source"] == "github:ci"]
    assert received["taken"] == "queued"
    assert store.ci.ci_failure(tid, SHA).state == ROUND
    announced = "CI failed on `bbbbbbbbbbbb`: `test`; afe takes it up as round 1 of 2 once its current run ends"
    await _until(lambda: announced in _pr_comment(stack))
    if pushed:      # what builtin:open_pr records when the re-run pushes a new head to the pull request
        pr = store.prs.get_pr(tid)
        store.prs.put_pr(PullRequestRecord(tid, pr.number, pr.url, pr.head_branch, pr.base_branch, NEWER, "open"))
    await runs.finish(0)
    if not pushed:
        await runs.started(2)
        assert runs.seen[1][0].startswith(f"CI failed on commit {SHA}:")       # the round's re-run
        assert _events(store, tid, "followup.dropped") == []
        assert announced in _pr_comment(stack)
        return
    await _until(lambda: bool(_events(store, tid, "followup.dropped")))
    [dropped] = _events(store, tid, "followup.dropped")
    assert (dropped["stale_head"], dropped["head"], dropped["count"]) == (SHA, NEWER, 1)
    assert f"CI failed on {SHA[:12]}, which is no longer the pull request's head ({NEWER[:12]})" \
        in dropped["reason"]
    assert [f["source"] for f in dropped["followups"]] == ["github:ci"]
    await asyncio.sleep(0.5)
    assert len(runs.seen) == 1 and store.followups.pending_followups(tid) == []
    assert sum(e.type == "ticket.reopened" for e in store.events.read(tid, 1)) == 1    # only the first re-run
    row = store.ci.ci_failure(tid, SHA)
    assert (row.state, row.doc["reason"]) == (QUIET, "stale_head")          # the round did not count
    # The announcement is corrected, in the same (edited) comment: one comment per head (R37).
    await _until(lambda: "Not taken up" in _pr_comment(stack))
    body = _pr_comment(stack)
    assert announced not in body and "round 1 of 2" not in body
    assert f"afe's run meanwhile pushed `{NEWER[:12]}`, a newer head whose own CI decides" in body
    assert len([c for c in stack.github.comments if c["number"] == NUMBER and "CI failed" in c["body"]]) == 1


async def test_a_head_that_moved_within_the_settle_window_starts_and_announces_no_round(stack, examples):
    tid = _ticket_with_pr(stack, rounds=2)
    _serve_failing_check(stack)
    store = stack.scheduler.store
    stack.scheduler.intake.ci_settle_s = 1.0
    status, doc = await stack.post("check_run", _check_run(examples))
    assert (status, doc["reason"]) == (202, "followup")
    pr = store.prs.get_pr(tid)        # a run pushed a newer head before the window ended
    store.prs.put_pr(PullRequestRecord(tid, pr.number, pr.url, pr.head_branch, pr.base_branch, NEWER, "open"))
    await _until(lambda: store.ci.ci_failure(tid, SHA).state != "gathering")
    row = store.ci.ci_failure(tid, SHA)
    assert (row.state, row.doc["reason"]) == (QUIET, "stale_head")
    [noted] = _events(store, tid, "ci.noted")
    assert f"no longer the pull request's head ({NEWER[:12]})" in noted["reason"]
    await asyncio.sleep(0.5)
    assert store.followups.followups(tid, 0) == [] and stack.github.comments == []
    assert store.tickets.get(tid).reopened_at_ms == 0


def _pr_comment(stack) -> str:
    """The CI round's comment on the pull request ("" before there is one)."""
    bodies = [c["body"] for c in stack.github.comments if c["number"] == NUMBER and "CI failed" in c["body"]]
    return bodies[0] if bodies else ""
