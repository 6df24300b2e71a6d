"""Reporting back to GitHub (docs/GITHUB.md, "Reporting back"): a ticket a
GitHub Trigger made (from GitHub's own `issues.labeled` example payload)
gets a comment with its link when it starts, an `afe/<workflow>` commit
status on its pull request's head while it runs and when it ends, and a
final comment with what was done, the tests' result, tokens and duration.

All real but GitHub: the credential broker is a separate PROCESS
(tests/support/credential_process.py, killed with SIGKILL in the R37 test),
the scheduler's core in-process over its real gRPC link (its engine not
started: the test moves the ticket through its states with the engine's own
Transitions), the store SQLite and PostgreSQL, and a fake GitHub that fails
the test on any call GitHub's OpenAPI description does not document."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from services.common.config.manifests import load_config
from services.common.layout import Layout
from services.common.rpc.links import LinkSecrets
from services.common.secrecy.redact import Redactor
from services.scheduler.app import SchedulerOptions, build_app
from services.scheduler.executor.transitions import state_event
from services.scheduler.store.base import FAILED, N_FAILED, N_SUCCEEDED, RUNNING, SUCCEEDED, PullRequestRecord
from tests.support.credential_process import CredentialProcess
from tests.support.fakes.github import FakeGitHub
from tests.support.postgres import open_store_url

from .conftest import TOKEN, example, write_config

pytestmark = pytest.mark.timeout(180)

PUBLIC = "https://afe.example.test"
MARK = re.compile(r"<!-- afe-report (\S+) (\S+) ([0-9a-f]{40}) -->\Z")


class Reporting:
    def __init__(self, app, github: FakeGitHub, broker: CredentialProcess, payload: dict) -> None:
        self.app = app
        self.github = github
        self.broker = broker
        self.payload = payload
        self.issue = payload["issue"]["number"]

    @property
    def store(self):
        return self.app.store

    async def ticket_from_issue(self) -> str:
        """The Trigger's way in: GitHub's issues.labeled example, by a writer."""
        self.github.permissions[self.payload["sender"]["login"]] = "write"
        out = await self.app.intake.deliver(str(uuid.uuid4()), "issues", json.dumps(self.payload).encode())
        assert (out.outcome, out.reason) == ("accepted", "ok"), out
        return out.ticket_ids[0]

    async def move(self, tid: str, state: str, **fields) -> None:
        self.app.engine.transitions.move(tid, state, state_event(state), **fields)
        await self.app.reporter.idle()

    async def open_pr(self, tid: str, sha: str) -> None:
        """What builtin:open_pr records, then its notice to the listeners."""
        self.store.prs.put_pr(PullRequestRecord(tid, "7", f"https://github.com/{self.github.repo}/pull/7",
                                            f"afe/{tid}", "main", sha, "open"))
        self.app.engine.transitions.notify(tid, RUNNING)
        await self.app.reporter.idle()

    def issue_comments(self) -> list[str]:
        return [c["body"] for c in self.github.comments if c["number"] == self.issue]


@pytest.fixture
async def reporting(examples, openapi, store_url, tmp_path):
    payload = example(examples, "issues", "labeled")
    repo = payload["repository"]["full_name"]
    root = Path(tempfile.mkdtemp(prefix="afe-report-", dir="/tmp"))
    layout = Layout(root / "data", root / "run")
    layout.ensure()
    async with FakeGitHub(TOKEN, repo=repo, openapi=openapi) as github:
        cfg = write_config(root / "cfg", repo, github.url, label=payload["label"]["name"], assignee="nobody")
        broker = CredentialProcess(cfg, layout, {"GH_TOKEN": TOKEN})
        await broker.start()
        app = build_app(load_config(cfg), layout, LinkSecrets(serve={}, call={"credentials": broker.secret}),
                        Redactor(), SchedulerOptions(recovery_interval=0, public_url=PUBLIC + "/"),
                        store=open_store_url(store_url, tmp_path))
        app.reporter.retry_s = 0.2
        try:
            yield Reporting(app, github, broker, payload)
        finally:
            await app.reporter.stop()
            await app.credentials.close()
            await app.sandbox.close()
            app.store.close()
            await broker.stop()
        assert github.undocumented == [], github.undocumented
    shutil.rmtree(root, ignore_errors=True)


async def test_report_start_comment_status_and_final_comment(reporting):
    r = reporting
    tid = await r.ticket_from_issue()
    assert r.github.comments == [] and r.github.statuses == []      # queued: nothing said yet
    await r.move(tid, RUNNING)
    [started] = r.issue_comments()
    link = f"{PUBLIC}/#/t/{tid}"
    assert f"[`{tid}`]({link})" in started and "workflow `fix`" in started
    m = MARK.search(started)
    assert m is not None and m.group(1, 2) == (tid, "started")

    sha = "c0ffee" + "0" * 34
    await r.open_pr(tid, sha)
    assert r.github.statuses == [{"sha": sha, "state": "pending", "context": "afe/fix",
                                  "description": f"afe ticket {tid}: running", "target_url": link}]
    await r.move(tid, RUNNING)                  # nothing changed: nothing is sent again
    assert len(r.github.comments) == 1 and len(r.github.statuses) == 1

    r.store.tickets.update_node(tid, "work", state=N_SUCCEEDED)
    r.store.tickets.update_node(tid, "gate", state=N_SUCCEEDED)
    t = r.store.tickets.get(tid)
    await r.move(tid, SUCCEEDED, tokens_used=1234)
    assert [s["state"] for s in r.github.statuses] == ["pending", "success"]
    assert r.github.statuses[-1]["sha"] == sha
    started_again, final = r.issue_comments()
    assert started_again == started
    assert f"**afe ticket [`{tid}`]({link}) succeeded**" in final
    assert f"- Pull request: https://github.com/{r.github.repo}/pull/7" in final
    assert "- Tests: 1 of 1 passed" in final and "- Tokens: 1234" in final
    assert re.search(r"- Duration: \d+s", final) and MARK.search(final).group(2) == "final"
    assert r.store.tickets.get(tid).updated_at_ms >= t.created_at_ms
    assert r.github.edits == []


async def test_report_failure_status_and_failed_tests(reporting):
    r = reporting
    tid = await r.ticket_from_issue()
    await r.move(tid, RUNNING)
    sha = "feed" + "1" * 36
    await r.open_pr(tid, sha)
    r.store.tickets.update_node(tid, "work", state=N_FAILED)
    await r.move(tid, FAILED, error="node work failed: exit status 1\n`rm -rf` <b>")
    assert [(s["sha"], s["state"]) for s in r.github.statuses] == [(sha, "pending"), (sha, "failure")]
    final = r.issue_comments()[-1]
    assert "failed**" in final and "- Tests: 0 of 1 passed (failed: `work`)" in final
    # The error is sandbox-made text: one line of inline code, no backticks of its own.
    assert "- Error: `node work failed: exit status 1 'rm -rf' <b>`" in final


async def test_report_only_github_tickets(reporting):
    """A ticket filed by a person (no GitHub origin) and without a pull request says nothing on GitHub."""
    r = reporting
    tid = r.app.engine.create_ticket("hello", "fix", "by hand", "", {"issue": "x", "link": "y", "who": "z"},
                                       "alice").ticket.id
    await r.move(tid, RUNNING)
    await r.move(tid, SUCCEEDED)
    assert r.github.comments == [] and r.github.statuses == []


def _kill_after_first_comment(r: Reporting) -> asyncio.Event:
    """The broker dies after GitHub stored the comment and before its answer reaches the scheduler."""
    killed = asyncio.Event()

    async def kill(cid: int) -> None:
        r.github.after_comment = None
        await r.broker.kill()
        killed.set()
    r.github.after_comment = kill
    return killed


async def _crash_between_post_and_record(r: Reporting) -> str:
    tid = await r.ticket_from_issue()
    killed = _kill_after_first_comment(r)
    r.app.engine.transitions.move(tid, RUNNING, state_event(RUNNING))
    await killed.wait()                                              # the post happened, then the kill
    assert len(r.github.comments) == 1
    assert r.store.reports.report(tid, "started") is None                   # the scheduler never heard back
    await r.broker.start()
    await r.app.reporter.idle()                                      # its retry reaches the new broker
    assert r.broker.starts == 2
    return tid


async def test_r37_report_comment_after_a_broker_crash_is_edited_not_repeated(reporting):
    r = reporting
    tid = await _crash_between_post_and_record(r)
    assert len(r.issue_comments()) == 1                              # found by its mark: not posted again
    assert r.store.reports.report(tid, "started")[0] == "1"
    # A later change of the same report edits that comment.
    r.store.tickets.update(tid, reopened_at_ms=1)
    await r.move(tid, RUNNING)
    [started] = r.issue_comments()
    assert "again, for a follow-up" in started and r.github.edits == [1]


async def test_r37_positive_control_without_the_mark_a_second_comment_appears(reporting):
    """The same crash, but GitHub keeps no mark (as if the broker wrote none): the lookup finds
    nothing and the retry posts the comment again."""
    r = reporting
    r.github.strip_marks = True
    tid = await _crash_between_post_and_record(r)
    bodies = r.issue_comments()
    assert len(bodies) == 2 and bodies[0] == bodies[1] and tid in bodies[0]


async def test_r37_a_copied_mark_in_a_later_comment_is_not_taken_for_afes(reporting):
    """Someone copies afe's posted comment, mark and all: afe edits its own (the earliest), not theirs."""
    r = reporting
    tid = await r.ticket_from_issue()
    await r.move(tid, RUNNING)
    mine = r.issue_comments()[0]
    r.github.comments.append({"number": r.issue, "body": "copied:\n" + mine.split("\n", 1)[1]
                              if "\n" in mine else mine})
    r.store.reports.put_report(tid, "started", "1", "lost", 0)                # the scheduler forgot what it said
    r.store.tickets.update(tid, reopened_at_ms=1)
    await r.move(tid, RUNNING)
    assert r.github.edits == [1]
    assert "again" in r.github.comments[0]["body"] and "again" not in r.github.comments[1]["body"]


@pytest.mark.parametrize("fixed", [True, False], ids=["superseded", "positive-control-without-it"])
async def test_a_head_a_re_opened_run_replaced_gets_a_final_status(reporting, monkeypatch, fixed):
    """The ticket waits for approval of H1, a follow-up re-opens it and its run pushes H2: H1's
    `afe/fix` status was left "pending: running" (the reporter only ever looked at the current head);
    now it gets `error`, "superseded by H2". Control: without that step, H1 stays pending."""
    r = reporting
    if not fixed:
        async def nothing(self, t, head) -> None:
            return None
        monkeypatch.setattr(type(r.app.reporter), "_superseded", nothing)
    tid = await r.ticket_from_issue()
    await r.move(tid, RUNNING)
    h1, h2 = "1" * 40, "2" * 40
    await r.open_pr(tid, h1)
    await r.move(tid, "waiting_approval")
    r.store.tickets.update(tid, reopened_at_ms=1)                     # Engine.reopen: the follow-up's run
    await r.move(tid, RUNNING)
    await r.open_pr(tid, h2)
    latest = {}
    for s in r.github.statuses:
        latest[s["sha"]] = (s["state"], s["description"])
    assert latest[h2] == ("pending", f"afe ticket {tid}: running")
    if not fixed:
        assert latest[h1] == ("pending", f"afe ticket {tid}: running")
        return
    assert latest[h1] == ("error", f"afe ticket {tid}: superseded by {h2[:12]}")
    assert [s["sha"] for s in r.github.statuses].count(h1) == 4       # running, waiting, running, superseded
    before = len(r.github.statuses)
    await r.move(tid, SUCCEEDED)                                     # H2 ends; H1 is not touched again
    assert [(s["sha"], s["state"]) for s in r.github.statuses[before:]] == [(h2, "success")]
