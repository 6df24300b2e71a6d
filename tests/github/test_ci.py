"""Failing CI on afe's pull requests (docs/GITHUB.md, "Failing CI"): GitHub's
own example payloads of check_run.completed, check_suite.completed and
status, signed here and sent to the real gateway process; the scheduler
turns a failure on the head of a pull request afe opened into ONE follow-up
round of its ticket, whose text (the failing checks, their summaries and
the redacted tail of the Actions job log, read by the real credential
broker from the fake GitHub, which checks every call against GitHub's
OpenAPI description) reaches the prompt only quoted (R36)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from services.scheduler.executor.quoting import followup_section, unquote
from services.scheduler.github.poll import Poller
from services.scheduler.store.base import QUEUED, SUCCEEDED, WAITING_APPROVAL, PullRequestRecord
from services.scheduler.store.ci_records import OVER, QUIET, ROUND

from .conftest import TOKEN, example

pytestmark = pytest.mark.timeout(120)

SHA, OLD = "b" * 40, "a" * 40
NUMBER = 2


def _afe_ticket(stack, *, rounds: int, state: str = SUCCEEDED, sha: str = SHA) -> str:
    """A ticket that opened pull request NUMBER with head `sha` (engine not started: a re-opened
    ticket stays queued), its Workflow with on_ci_failure: {max: rounds} (0: without)."""
    cfg = stack.scheduler.intake.config
    cfg.workflows["iterate"] = dataclasses.replace(cfg.workflows["iterate"], ci_rounds=rounds)
    stack.scheduler.intake.ci_settle_s = 0.5
    engine = stack.scheduler.engine
    tid = engine.create_ticket("hello", "iterate", "#1 fix", "body", {}, "alice").ticket.id
    engine.store.tickets.update(tid, state=state, torn_down=True)
    engine.store.prs.put_pr(PullRequestRecord(tid, str(NUMBER), f"https://github.com/{stack.repo}/pull/{NUMBER}",
                                          f"afe/{tid}", "main", sha, "open"))
    return tid


def _check_run(examples, *, sha: str = SHA, name: str = "test", conclusion: str = "failure") -> dict:
    e = example(examples, "check_run", "completed")
    r = e["check_run"]
    r.update(head_sha=sha, name=name, conclusion=conclusion, id=42)
    r["output"].update(title="1 test failed", summary="tests/test_calc.py::test_add failed")
    for pr in r["pull_requests"]:
        pr["number"], pr["head"]["sha"] = NUMBER, sha
    return e


def _status(examples, *, sha: str = SHA, context: str = "ci/build", state: str = "failure",
            branch: str = "") -> dict:
    """GitHub's status example; `branch` added to the branches that contain the commit (as GitHub lists
    afe's branch `afe/<ticket>` for a commit of afe's pull request)."""
    e = example(examples, "status")
    e.update(sha=sha, context=context, state=state, description="The build failed")
    if branch:
        e["branches"].append({"name": branch, "commit": {"sha": SHA, "url": ""}, "protected": False})
    return e


def _suite(examples, *, sha: str = SHA, conclusion: str = "failure") -> dict:
    e = example(examples, "check_suite", "completed")
    e["check_suite"].update(head_sha=sha, conclusion=conclusion)
    return e


def _serve_failing_check(stack) -> str:
    log = "".join(f"\x1b[36m2026-01-01T00:00:{i % 60:02d}Z\x1b[0m step {i}\n" for i in range(500))
    log += f"Using token {TOKEN} to fetch\n\x1b[31mE   assert add(1, 1) == 3\x1b[0m\n"
    stack.github.check_runs.append({"id": 42, "name": "test", "head_sha": SHA, "conclusion": "failure",
                                    "output": {"title": "1 test failed", "summary": "tests/test_calc.py::test_add "
                                               "failed", "text": None, "annotations_count": 0}})
    stack.github.job_logs[42] = log
    return log


async def _until(cond, deadline_s: float = 20) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end
        await asyncio.sleep(0.05)


def _round_done(stack, tid: str, sha: str = SHA):
    def done() -> bool:
        row = stack.scheduler.store.ci.ci_failure(tid, sha)
        return row is not None and row.state != "gathering" and not stack.scheduler.store.followups.pending_followups(tid)
    return done


async def test_r36_a_failing_check_run_starts_one_round_with_its_log_tail_quoted(stack, examples):
    tid = _afe_ticket(stack, rounds=2)
    raw = _serve_failing_check(stack)
    status, doc = await stack.post("check_run", _check_run(examples))
    assert (status, doc["outcome"], doc["reason"], doc["tickets"]) == (202, "accepted", "followup", [tid])
    # The same failure as GitHub also reports it: the suite and a status of the same head join the round.
    status, doc = await stack.post("check_suite", _suite(examples))
    assert (status, doc["reason"]) == (202, "gathered"), doc
    status, doc = await stack.post("status", _status(examples))
    assert (status, doc["reason"]) == (202, "gathered"), doc
    await _until(_round_done(stack, tid))
    store = stack.scheduler.store
    t = store.tickets.get(tid)
    assert t.state == QUEUED and t.reopened_at_ms > 0
    assert sum(e.type == "ticket.reopened" for e in store.events.read(tid, 1)) == 1
    (f,) = store.followups.followups(tid, t.reopened_at_ms)
    assert (f.source, f.author) == ("github:ci", "test")
    for want in ("CI failed on commit " + SHA, "Check test (check_run by github-actions): failure",
                 "Summary: tests/test_calc.py::test_add failed", "Check ci/build (status): failure",
                 "Description: The build failed", "E   assert add(1, 1) == 3", "step 499"):
        assert want in f.text, want
    # Bounded, ANSI stripped, and the token (in the raw log: the positive control) redacted by the broker.
    assert TOKEN in raw and "\x1b" in raw
    assert TOKEN not in f.text and "\x1b" not in f.text and "step 100\n" not in f.text
    assert len(f.text.encode()) <= 8 * 1024
    assert all(d["authorization"] == "" for d in stack.github.downloads) and stack.github.downloads
    section = followup_section([f])
    block = section[section.index("<<<QUOTED"):]
    assert unquote(block) == f.text and "failing CI checks" in block
    row = store.ci.ci_failure(tid, SHA)
    assert (row.state, row.doc["round"]) == (ROUND, 1)
    assert [c["name"] for c in row.doc["checks"]] == ["test", "ci/build"]
    comments = [c["body"] for c in stack.github.comments if c["number"] == NUMBER]
    assert len(comments) == 1 and "CI failed on `bbbbbbbbbbbb`: `test`, `ci/build`; afe is on it, round 1 of 2" \
        in comments[0]
    # A later delivery of the same failure changes nothing.
    status, doc = await stack.post("check_run", _check_run(examples))
    assert (status, doc["reason"]) == (202, "duplicate")


async def test_success_an_older_head_and_other_pull_requests_start_nothing(stack, examples):
    tid = _afe_ticket(stack, rounds=2)
    for event, payload, reason in (
            ("check_run", _check_run(examples, conclusion="success"), "passing"),
            ("check_run", _check_run(examples, conclusion="cancelled"), "passing"),
            ("check_suite", _suite(examples, conclusion="success"), "passing"),
            ("status", _status(examples, state="pending"), "passing"),
            ("check_run", _check_run(examples, sha=OLD), "stale_head"),
            # A status names no pull request: an older head of afe's is known by afe's branch containing it
            # (docs/GITHUB.md says `stale_head`); the example's own branches are no afe pull request's.
            ("status", _status(examples, sha=OLD, branch=f"afe/{tid}"), "stale_head"),
            ("status", _status(examples, sha=OLD), "not_afe_pull_request"),
            ("status", _status(examples, sha=OLD, branch="afe/t-someone-elses"), "not_afe_pull_request")):
        status, doc = await stack.post(event, payload)
        assert (status, doc["outcome"], doc["reason"]) == (202, "ignored", reason), (event, doc)
    assert stack.scheduler.store.ci.ci_failures(tid) == []


@pytest.mark.parametrize("context", ["afe/iterate", "afe", "afe/verify"])
async def test_r36_afe_own_failing_status_starts_nothing(stack, examples, context):
    tid = _afe_ticket(stack, rounds=2)
    status, doc = await stack.post("status", _status(examples, context=context))
    assert (status, doc["outcome"], doc["reason"]) == (202, "ignored", "own_check")
    assert stack.scheduler.store.ci.ci_failures(tid) == []
    # Positive control: the same payload with another context starts a round.
    status, doc = await stack.post("status", _status(examples, context="ci/" + context))
    assert (status, doc["outcome"], doc["reason"]) == (202, "accepted", "followup")
    await _until(_round_done(stack, tid))
    assert stack.scheduler.store.ci.ci_failure(tid, SHA).state == ROUND


async def test_rounds_are_bounded_then_a_comment_asks_a_person(stack, examples):
    tid = _afe_ticket(stack, rounds=1, state=WAITING_APPROVAL)
    store = stack.scheduler.store
    assert store.ci.claim_ci_failure(tid, OLD, "earlier", 1)
    store.ci.put_ci_failure(tid, OLD, {"state": ROUND, "round": 1, "checks": []})     # the one round, done before
    # Answered as what happens: no round (not `accepted/followup`), also for the same failure's other reports.
    status, doc = await stack.post("status", _status(examples))
    assert (status, doc["outcome"], doc["reason"], doc["tickets"]) == (202, "ignored", "past_max", [tid])
    status, doc = await stack.post("check_suite", _suite(examples))
    assert (status, doc["outcome"], doc["reason"]) == (202, "ignored", "past_max")
    await _until(_round_done(stack, tid))
    assert store.ci.ci_failure(tid, SHA).state == OVER
    assert store.followups.followups(tid, 0) == [] and store.tickets.get(tid).state == WAITING_APPROVAL
    assert any(e.type == "ci.rounds_exhausted" for e in store.events.read(tid, 1))
    (body,) = [c["body"] for c in stack.github.comments if c["number"] == NUMBER]
    assert "CI still fails on `bbbbbbbbbbbb` (`ci/build`) after 1 round(s)" in body and "a person must look" in body


async def test_without_on_ci_failure_a_failure_is_only_noted(stack, examples):
    tid = _afe_ticket(stack, rounds=0)
    status, doc = await stack.post("status", _status(examples))
    assert (status, doc["outcome"], doc["reason"], doc["tickets"]) == (202, "ignored", "no_ci_iteration", [tid])
    await _until(_round_done(stack, tid))
    store = stack.scheduler.store
    assert store.ci.ci_failure(tid, SHA).state == QUIET and store.followups.followups(tid, 0) == []
    assert [e.type for e in store.events.read(tid, 1) if e.type.startswith("ci.")] == ["ci.failed", "ci.noted"]
    assert store.tickets.get(tid).state == SUCCEEDED and stack.github.comments == []


async def test_polling_sees_a_failing_check_and_starts_one_round_not_two(stack, examples):
    tid = _afe_ticket(stack, rounds=3)
    _serve_failing_check(stack)
    stack.github.statuses.append({"sha": SHA, "state": "failure", "context": "afe/iterate",
                                  "description": "afe's own", "target_url": None})
    ws = stack.scheduler.intake.config.workspaces["hello"]
    poller = Poller(stack.scheduler.intake, interval_s=0)
    await poller.poll_once(ws)
    await _until(_round_done(stack, tid))
    store = stack.scheduler.store
    row = store.ci.ci_failure(tid, SHA)
    assert (row.state, [c["name"] for c in row.doc["checks"]]) == (ROUND, ["test"])    # not afe's own status
    t = store.tickets.get(tid)
    (f,) = store.followups.followups(tid, t.reopened_at_ms)
    assert "E   assert add(1, 1) == 3" in f.text and TOKEN not in f.text
    store.tickets.update(tid, state=SUCCEEDED)      # as if the re-run ended without a new head
    before = stack.github.rate_remaining
    await poller.poll_once(ws)          # the events unchanged (304) and this head had its round: no request
    await asyncio.sleep(1.0)
    assert stack.github.rate_remaining == before
    assert len(store.ci.ci_failures(tid)) == 1 and len(store.followups.followups(tid, 0)) == 1
    assert sum(e.type == "ticket.reopened" for e in store.events.read(tid, 1)) == 1


async def test_polling_a_head_whose_checks_still_run_asks_github_conditionally(stack, examples):
    """A head still being checked is asked again each poll, with the last answers' ETags: GitHub
    answers 304, which costs no rate limit; the failure, once there, changes the answer and
    starts the round. Control: the first poll, with no ETag to send, is counted."""
    tid = _afe_ticket(stack, rounds=3)
    stack.github.check_runs.append({"id": 7, "name": "test", "head_sha": SHA, "status": "in_progress",
                                    "conclusion": None})
    ws = stack.scheduler.intake.config.workspaces["hello"]
    poller = Poller(stack.scheduler.intake, interval_s=0)
    first, seen = stack.github.rate_remaining, stack.github.not_modified
    await poller.poll_once(ws)
    assert stack.scheduler.store.ci.ci_failure(tid, SHA) is None       # pending: no round yet
    assert stack.github.rate_remaining <= first - 2 and stack.github.not_modified == seen    # counted
    before, seen = stack.github.rate_remaining, stack.github.not_modified
    await poller.poll_once(ws)
    assert stack.github.not_modified == seen + 2                    # check runs and combined status: 304
    assert stack.github.rate_remaining == before                    # nothing counted
    stack.github.check_runs[-1].update(status="completed", conclusion="failure")
    await poller.poll_once(ws)                                      # the answer changed: a new ETag
    await _until(_round_done(stack, tid))
    assert stack.scheduler.store.ci.ci_failure(tid, SHA).state == ROUND
