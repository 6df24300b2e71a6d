"""A review's inline comments reach the re-run (docs/GITHUB.md, "Iteration"):
GitHub sends `pull_request_review` and then each of its
`pull_request_review_comment`s as separate deliveries. The scheduler's
dispatcher starts a re-opened ticket within milliseconds, so before this was
gathered the comments found the ticket running and were dropped as `busy`.
Now each is stored pending, the ticket re-opens once the settle window has
passed with all of them, what comes while it runs is queued for the next
re-run, and what can never run is said on the ticket and the pull request.

GitHub's own example payloads (`@octokit/webhooks-examples`: the review
237895671 and its comment, which carries `pull_request_review_id`), signed
and sent to the real gateway process. The engine's dispatcher is started,
with each run held (`HeldRuns`) until the test lets it end, recording the
follow-ups its model prompt would get (executor/context.py reads exactly
`followups(ticket, reopened_at_ms)`)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from services.scheduler.engine.followups import FollowUpQueue
from services.scheduler.store.base import QUEUED, RUNNING, SUCCEEDED, PullRequestRecord

from .conftest import example
from .old_intake import old_follow_ups
from .test_iteration import _afe_ticket, _review, _reviewer, _settled

pytestmark = pytest.mark.timeout(120)


class HeldRuns:
    """The engine's dispatcher as when the scheduler runs: a queued ticket is
    started at once; its run is held until `finish(i)`."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.seen: list[list[str]] = []          # per run: the follow-up texts it was given
        self.gates: list[asyncio.Event] = []
        engine.dispatch.launch = self._launch
        engine.dispatch.started = True

    def _launch(self, t, resumed: bool) -> None:
        engine = self.engine
        self.seen.append([f.text for f in engine.store.followups.followups(t.id, t.reopened_at_ms)])
        gate = asyncio.Event()
        self.gates.append(gate)

        async def run() -> None:
            await gate.wait()
            engine.transitions.move(t.id, SUCCEEDED, ("ticket.finished", {"state": SUCCEEDED, "error": ""}),
                                    torn_down=True)
            engine.dispatch.running.discard(t.id)

        task = asyncio.create_task(run())
        engine.dispatch.tasks[t.id] = task
        task.add_done_callback(lambda _t, tid=t.id: engine.dispatch.tasks.pop(tid, None))

    async def started(self, n: int, deadline_s: float = 15) -> None:
        end = time.monotonic() + deadline_s
        while len(self.seen) < n:
            assert time.monotonic() < end, f"{len(self.seen)} run(s) started, wanted {n}"
            await asyncio.sleep(0.01)

    async def finish(self, i: int) -> None:
        self.gates[i].set()
        await asyncio.sleep(0)


def _inline(examples, body: str, n: int) -> dict:
    """The example review's inline comment `n` (the example's comment, another id, line and text)."""
    e = example(examples, "pull_request_review_comment", "created")
    e["comment"]["body"] = body
    e["comment"]["id"] += n
    e["comment"]["line"] = 10 + n
    return e


def _events(store, tid: str, type_: str) -> list[dict]:
    return [json.loads(e.payload_json) for e in store.events.read(tid, 1, 100_000) if e.type == type_]


@pytest.mark.parametrize("fixed", [True, False], ids=["gathered", "positive-control-dropped-as-busy"])
async def test_a_review_and_its_inline_comments_are_one_rerun_and_late_ones_the_next(stack, examples, monkeypatch,
                                                                                    fixed):
    review = _review(examples, "Please handle the edge cases")
    number = review["pull_request"]["number"]
    tid = _afe_ticket(stack, number)
    stack.github.permissions[_reviewer(examples)] = "write"
    engine, store = stack.scheduler.engine, stack.scheduler.store
    if not fixed:
        old_follow_ups(monkeypatch, stack.scheduler.intake)
    runs = HeldRuns(engine)
    comments = [_inline(examples, f"inline comment {i}", i) for i in (1, 2, 3)]
    assert {c["comment"]["pull_request_review_id"] for c in comments} == {review["review"]["id"]}
    # As GitHub sends them: the review, then its comments, one delivery after the other.
    answers = [await stack.post("pull_request_review", review)]
    answers += [await stack.post("pull_request_review_comment", c) for c in comments]
    if not fixed:
        # Today's code: the review re-opened the ticket, which was running before the first comment
        # came; every comment was answered busy and is nowhere, not even on the ticket.
        assert [(s, d["reason"]) for s, d in answers] == [(202, "followup")] + [(202, "busy")] * 3
        await runs.started(1)
        assert runs.seen == [["Please handle the edge cases"]]
        assert [f.text for f in store.followups.followups(tid, 0)] == ["Please handle the edge cases"]
        assert not any("inline comment" in e.payload_json for e in store.events.read(tid, 1, 100_000))
        return
    assert [(s, d["outcome"], d["reason"], d["tickets"]) for s, d in answers] == (
        [(202, "accepted", "followup", [tid])] + [(202, "accepted", "gathered", [tid])] * 3)
    await runs.started(1)
    assert runs.seen == [["Please handle the edge cases", "inline comment 1", "inline comment 2",
                          "inline comment 3"]]
    assert store.tickets.get(tid).state == RUNNING
    given = store.followups.followups(tid, store.tickets.get(tid).reopened_at_ms)
    assert [(f.source, f.path, f.line) for f in given[1:]] == [
        ("github:review_comment", comments[0]["comment"]["path"], 11 + i) for i in range(3)]
    # A comment of the same review that comes after its re-run started: queued for the next one.
    status, doc = await stack.post("pull_request_review_comment", _inline(examples, "one more thing", 4))
    assert (status, doc["outcome"], doc["reason"]) == (202, "accepted", "queued")
    assert [f.text for f in store.followups.pending_followups(tid)] == ["one more thing"]
    await asyncio.sleep(0.3)
    assert len(runs.seen) == 1                                    # the running re-run is left alone
    await runs.finish(0)                                          # it ends (or waits for approval) ...
    await runs.started(2)                                         # ... and the queued one runs next
    assert runs.seen[1] == ["one more thing"]
    # Every arrival is on the ticket, saying how it was taken; two re-opens, each naming its follow-ups.
    received = _events(store, tid, "followup.received")
    assert [(r["taken"], r["review_id"]) for r in received] == (
        [("followup", review["review"]["id"])] + [("gathered", review["review"]["id"])] * 3
        + [("queued", review["review"]["id"])])
    assert [r["delivery"] for r in received] == stack.deliveries[-5:]
    reopened = _events(store, tid, "ticket.reopened")
    assert [len(r["followups"]) for r in reopened] == [4, 1]
    assert await stack.metric("accepted", "gathered") == 3 and await stack.metric("accepted", "queued") == 1


async def test_queued_follow_ups_of_a_pull_request_merged_meanwhile_are_said_dropped(stack, examples):
    review = _review(examples, "Rename the function")
    number = review["pull_request"]["number"]
    tid = _afe_ticket(stack, number)
    stack.github.permissions[_reviewer(examples)] = "write"
    engine, store = stack.scheduler.engine, stack.scheduler.store
    runs = HeldRuns(engine)
    assert (await stack.post("pull_request_review", review))[1]["reason"] == "followup"
    await runs.started(1)
    status, doc = await stack.post("pull_request_review_comment", _inline(examples, "and this one", 1))
    assert doc["reason"] == "queued"
    # The pull request is merged while the re-run runs: the queued comment can never run.
    pr = store.prs.get_pr(tid)
    store.prs.put_pr(PullRequestRecord(tid, pr.number, pr.url, pr.head_branch, pr.base_branch, pr.head_sha, "merged"))
    await runs.finish(0)
    end = time.monotonic() + 15
    while not _events(store, tid, "followup.dropped"):
        assert time.monotonic() < end
        await asyncio.sleep(0.02)
    [dropped] = _events(store, tid, "followup.dropped")
    assert dropped["count"] == 1 and "merged" in dropped["reason"]
    assert dropped["followups"][0]["source"] == "github:review_comment"
    assert len(runs.seen) == 1 and store.followups.pending_followups(tid) == []
    # ... and on the pull request, where the reviewer reads.
    def replies() -> list[dict]:       # (the reporter writes its own comments on the ticket's progress)
        return [c for c in stack.github.comments if "did not act on" in c["body"]]

    while not replies():
        assert time.monotonic() < end
        await asyncio.sleep(0.02)
    [reply] = replies()
    assert str(reply["number"]) == str(number) and "merged" in reply["body"] and tid in reply["body"]
    # A review that comes after the merge is refused at once, and that too is on the ticket.
    status, doc = await stack.post("pull_request_review", _review(examples, "too late"))
    assert (status, doc["outcome"], doc["reason"]) == (202, "ignored", "busy")
    assert [r["source"] for r in _events(store, tid, "followup.refused")] == ["github:review"]


@pytest.mark.parametrize("settle_s", [60.0])
async def test_follow_ups_pending_when_the_scheduler_stops_rerun_after_its_restart(stack, examples, settle_s):
    review = _review(examples, "Handle empty input")
    tid = _afe_ticket(stack, review["pull_request"]["number"])
    stack.github.permissions[_reviewer(examples)] = "write"
    store = stack.scheduler.store
    assert (await stack.post("pull_request_review", review))[1]["reason"] == "followup"
    assert (await stack.post("pull_request_review_comment", _inline(examples, "here", 1)))[1]["reason"] == "gathered"
    # The scheduler stops inside the settle window, as a state change wakes the follow-ups (the same
    # moment: asyncio.wait_for on Python 3.11 would swallow the cancel and wait out the window).
    intake = stack.scheduler.intake
    intake.followups.changed(tid, SUCCEEDED)
    await asyncio.wait_for(intake.stop(), 5)
    assert store.tickets.get(tid).state == SUCCEEDED and len(store.followups.pending_followups(tid)) == 2
    restarted = FollowUpQueue(stack.scheduler.engine, settle_s=0.1)
    restarted.start()
    try:
        await _settled(stack, tid)
        t = store.tickets.get(tid)
        assert t.state == QUEUED
        assert [f.text for f in store.followups.followups(tid, t.reopened_at_ms)] == ["Handle empty input", "here"]
    finally:
        await restarted.close()
