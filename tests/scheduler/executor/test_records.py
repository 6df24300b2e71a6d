"""Records outlive the ticket (fast tier, fakes): the final diff, the test
node's output, the pull request and the usage are kept with the ticket and
shown for succeeded, failed, rejected and cancelled tickets, through the
same path the UI and `afe ticket show --diff` take (Scheduler.GetTicket /
GetTicketDiff -> gateway/convert.py -> the CLI's printing); a local-forge
pull request becomes the gateway's page URL, and GetPullRequest finds its
ticket."""

from __future__ import annotations

import pytest

from gateway import convert
from services._gen.afe.credentials.v1 import credentials_pb2 as cpb
from services.cli import tickets as cli
from services.common.errors import NotFound
from services.scheduler.executor.nodes import NODE_KINDS
from services.scheduler.servicer import ticket_pb
from services.scheduler.store.base import CANCELLED, FAILED, SUCCEEDED, WAITING_APPROVAL

from .test_recovery import MODEL, Forge, RecoveryHarness

ORIGIN = "http://127.0.0.1:8420"

WORKFLOWS = MODEL + """\
kind: Workflow
name: reviewed
workspace: ws
nodes:
  - {id: fix, model: fixer, prompt: "make the tests pass"}
  - {id: test, run: "echo TESTS-RAN-5 passed", needs: [fix]}
  - {id: pr, uses: builtin:open_pr, needs: [test]}
  - {id: merge, uses: builtin:merge, needs: [pr]}
---
kind: Workflow
name: late-failure
workspace: ws
nodes:
  - {id: fix, model: fixer, prompt: "make the tests pass"}
  - {id: pr, uses: builtin:open_pr, needs: [fix]}
  - {id: test, run: "echo TESTS-FAILED-5 one failed; exit 1", needs: [pr]}
"""


class LocalForge(Forge):
    """Pull requests named the way the local forge names them (credentials/forges/local.py)."""

    async def open_pr(self, ticket_id: str, workspace: str, title: str, body: str,
                      fence: int = 0) -> cpb.PullRequest:
        pr = await super().open_pr(ticket_id, workspace, title, body)
        pr.url = f"local:{workspace}/pulls/{pr.number}"
        return pr


@pytest.fixture
async def h(tmp_path, monkeypatch):
    async def fake_model(ctx, node):      # a model node that used tokens
        ctx.add_tokens(1234)
        return "edited"

    monkeypatch.setitem(NODE_KINDS, "model", fake_model)
    harness = RecoveryHarness(tmp_path, WORKFLOWS)
    harness.credentials = LocalForge()
    yield harness
    await harness.stop()


async def _end(h, engine, how: str) -> str:
    """A ticket ended `how`: succeeded, failed, rejected or cancelled."""
    tid = h.create("late-failure" if how == "failed" else "reviewed")
    if how != "failed":
        t = await h.until(tid, (WAITING_APPROVAL,))
        if how == "succeeded":
            await engine.approve(tid, "alice", t.awaiting_sha)
        elif how == "rejected":
            await engine.reject(tid, "alice", "not like this")
        else:
            await engine.cancel(tid, "alice")
    await h.until(tid)
    return tid


@pytest.mark.parametrize(("how", "state", "marker"), [
    ("succeeded", SUCCEEDED, "TESTS-RAN-5"), ("failed", FAILED, "TESTS-FAILED-5"),
    ("rejected", FAILED, "TESTS-RAN-5"), ("cancelled", CANCELLED, "TESTS-RAN-5")])
async def test_diff_test_output_pr_and_usage_are_kept_and_shown_once_the_ticket_ended(h, how, state, marker,
                                                                                       capsys):
    engine = await h.start()
    tid = await _end(h, engine, how)
    t = h.store.tickets.get(tid)
    assert t.state == state and t.torn_down, (t.state, t.error)
    if how == "rejected":
        assert "rejected by alice" in t.error

    # What the UI and the CLI receive (the gateway's JSON of GetTicket and GetTicketDiff).
    shown = convert.ticket(ticket_pb(engine.view(tid)), ORIGIN)
    diff, _, recorded = await engine.diff(tid)
    assert recorded and f"+fixed for {tid}" in diff
    test_node = next(n for n in shown["nodes"] if n["id"] == "test")
    assert marker in test_node["output"]
    assert shown["usage"] == {"tokens": 1234}
    number = shown["pr"]["number"]
    assert shown["pr"]["url"] == f"{ORIGIN}/pulls/ws/{number}" and shown["pr"]["ref"] == f"local:ws/pulls/{number}"

    # `afe ticket show ID --diff` prints all four from that JSON.
    cli._print_ticket(shown)
    cli._print_test_output(shown)
    out = capsys.readouterr().out
    assert f"{ORIGIN}/pulls/ws/{number}" in out and "usage: 1234 model tokens" in out
    assert "test output of test" in out and marker in out

    # The pull request's page finds the ticket by workspace and number.
    assert engine.pull_request("ws", number).ticket.id == tid


async def test_a_pull_request_afe_did_not_open_is_not_found_and_says_so(h):
    engine = await h.start()
    with pytest.raises(NotFound, match="has no pull request '99' that afe opened"):
        engine.pull_request("ws", "99")
    with pytest.raises(NotFound, match="no workspace 'nope'"):
        engine.pull_request("nope", "1")


def test_github_pull_request_urls_stay_links_to_github():
    gh = "https://github.com/acme/app/pull/7"
    assert convert.pr_url(gh, ORIGIN) == gh
    assert convert.pr_url("local:demo/pulls/2", ORIGIN) == f"{ORIGIN}/pulls/demo/2"
    assert convert.pr_url("local:demo/pulls/2/../x", ORIGIN) == "local:demo/pulls/2/../x"   # not the local form


async def test_watching_a_re_opened_ticket_from_the_start_goes_past_its_earlier_end(h):
    engine = await h.start()
    tid = await _end(h, engine, "rejected")
    await engine.retry(tid, "", "alice")
    await h.until(tid, (WAITING_APPROVAL,))
    t = h.store.tickets.get(tid)
    await engine.approve(tid, "alice", t.awaiting_sha)
    await h.until(tid)
    seen = [ev.type async for ev in engine.watch(tid, 1, True)]
    assert seen.count("ticket.finished") == 2 and seen[-1] == "ticket.finished", seen   # both ends, then done
    assert "ticket.reopened" in seen and seen.index("ticket.reopened") > seen.index("ticket.finished")
