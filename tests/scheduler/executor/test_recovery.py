"""Recovery in the executor's fast tier: `afe ticket retry [--from NODE]`,
update-branch and `on_failure` rounds (Engine.retry / update_branch /
reopen, TicketRun._feedback_round), the stored final diff, and R16 after a
re-open: an approval given before it never merges what the re-run pushes."""

from __future__ import annotations

import asyncio

import pytest

from services._gen.afe.credentials.v1 import credentials_pb2 as cpb
from services.common.config.manifests import load_config
from services.common.errors import ConfigError, FailedPrecondition, InvalidArgument
from services.scheduler.executor.nodes import NODE_KINDS
from services.scheduler.store.base import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED, WAITING_APPROVAL

from .conftest import WORKSPACE, Harness
from .fakes import FakeCredentials, FakeSandbox

MODEL = """\
kind: Model
name: fixer
provider: replay
script: fix.yaml
---
"""

WORKFLOWS = MODEL + """\
kind: Workflow
name: chain
workspace: ws
nodes:
  - {id: first, run: "echo one"}
  - {id: check, run: "once check; echo fixed", needs: [first]}
  - {id: after, run: "echo after", needs: [check]}
---
kind: Workflow
name: review
workspace: ws
nodes:
  - {id: pr, uses: builtin:open_pr}
  - {id: merge, uses: builtin:merge, needs: [pr]}
---
kind: Workflow
name: loop
workspace: ws
nodes:
  - {id: fix, model: fixer, prompt: "make the tests pass"}
  - {id: test, run: "echo FAIL-MARK-7; exit 1", needs: [fix], on_failure: {retry_from: fix, max: 2}}
  - {id: pr, uses: builtin:open_pr, needs: [test]}
---
kind: Workflow
name: heals
workspace: ws
nodes:
  - {id: fix, model: fixer, prompt: "make the tests pass"}
  - {id: test, run: "once test; echo green", needs: [fix], on_failure: {retry_from: fix, max: 3}}
"""


class Forge(FakeCredentials):
    """The fake forge plus a diff, a merge that conflicts while `conflict`,
    and update_branch (a new head, or conflicting paths)."""

    def __init__(self) -> None:
        super().__init__()
        self.conflict = False
        self.conflicts: list[str] = []

    async def diff(self, ticket_id: str, workspace: str, max_bytes: int) -> cpb.DiffResponse:
        self._call("diff")
        return cpb.DiffResponse(diff=f"--- a/calc.py\n+++ b/calc.py\n+fixed for {ticket_id}\n")

    async def merge(self, ticket_id, workspace, number, principal, sha, at_ms, method="", fence=0,
                    accepted_harness_change=(), expected_base_sha=""):
        if self.conflict:
            self._call("merge")
            raise FailedPrecondition(f"pull request {number} conflicts with main; update the branch and approve "
                                     "again")
        return await super().merge(ticket_id, workspace, number, principal, sha, at_ms, method)

    async def update_branch(self, ticket_id: str, workspace: str, fence: int = 0) -> cpb.UpdateBranchResponse:
        self._call("update_branch")
        if self.conflicts:
            return cpb.UpdateBranchResponse(head_sha="c" * 40, conflicts=self.conflicts)
        self.prs[ticket_id].head_sha = "d" * 40
        self.conflict = False
        return cpb.UpdateBranchResponse(head_sha="d" * 40, changed=True)


class RecoveryHarness(Harness):
    """The harness with the replay Model's script file and the `Forge` fake."""

    def __init__(self, root, workflows: str) -> None:
        cfg = root / "cfg"
        cfg.mkdir()
        (cfg / "fix.yaml").write_text("[]\n")
        (cfg / "afe.yaml").write_text(WORKSPACE + workflows)
        self.config = load_config(cfg)
        self.db = root / "afe.db"
        self.sandbox = FakeSandbox()
        self.credentials = Forge()
        self.engine = None
        self.store = None


@pytest.fixture
async def rh(tmp_path):
    h = RecoveryHarness(tmp_path, WORKFLOWS)
    yield h
    await h.stop()


@pytest.fixture
def prompts(monkeypatch):
    """The model node kind replaced by one that records the prompt it was given."""
    seen: list[str] = []

    async def fake_model(ctx, node):
        seen.append(ctx.prompt(node))
        return "edited"

    monkeypatch.setitem(NODE_KINDS, "model", fake_model)
    return seen


def _started(h, tid: str) -> list[str]:
    return [p["node"] for _, p in h.events(tid, "node.started")]


async def test_retry_runs_the_failed_node_and_what_follows_and_keeps_what_succeeded(rh):
    engine = await rh.start()
    tid = rh.create("chain")
    t = await rh.until(tid)
    assert t.state == FAILED and "node check failed" in t.error
    assert rh.nodes(tid)["after"].state == "skipped"
    v = await engine.retry(tid, "", "alice")
    assert v.ticket.state in (QUEUED, RUNNING)
    t = await rh.until(tid)
    assert t.state == SUCCEEDED, t.error
    assert _started(rh, tid) == ["first", "check", "check", "after"]      # first kept its result
    nodes = rh.nodes(tid)
    assert nodes["first"].output == "one\n" and nodes["check"].attempt == 2
    reopened = rh.events(tid, "ticket.reopened")
    assert reopened[0][1]["principal"] == "alice" and reopened[0][1]["nodes"] == ["check", "after"]
    assert rh.credentials.calls.count("prepare") == 2      # the workspace came back for the re-run


async def test_retry_from_a_node_runs_it_and_its_dependents_only(rh):
    engine = await rh.start()
    tid = rh.create("chain")
    await rh.until(tid)
    await engine.retry(tid, "", "alice")
    assert (await rh.until(tid)).state == SUCCEEDED
    rh.store.tickets.update(tid, state=FAILED)      # as if a later step had failed
    await engine.retry(tid, "check", "alice")
    assert (await rh.until(tid)).state == SUCCEEDED
    assert _started(rh, tid) == ["first", "check", "check", "after", "check", "after"]


async def test_retry_refuses_what_cannot_be_retried_and_says_what_to_do(rh):
    engine = await rh.start()
    tid = rh.create("chain")
    await rh.until(tid)
    with pytest.raises(InvalidArgument, match="has no node 'nope'; its nodes: first, check, after"):
        await engine.retry(tid, "nope", "alice")
    await engine.retry(tid, "", "alice")
    with pytest.raises(FailedPrecondition, match="only a failed or cancelled ticket can be retried"):
        await engine.retry(tid, "", "alice")      # queued or running now
    assert (await rh.until(tid)).state == SUCCEEDED
    with pytest.raises(FailedPrecondition, match="only a failed or cancelled ticket"):
        await engine.retry(tid, "", "alice")


async def test_a_cancelled_ticket_can_be_retried(rh):
    engine = await rh.start()
    tid = rh.create("review")
    await rh.until(tid, (WAITING_APPROVAL,))
    await engine.cancel(tid, "alice")
    assert (await rh.until(tid)).state == CANCELLED
    await engine.retry(tid, "", "alice")
    t = await rh.until(tid, (WAITING_APPROVAL,))
    assert t.awaiting_sha == "c" * 40
    assert rh.credentials.calls.count("open_pr") == 1      # the pr node kept its result: one pull request (R37)


async def test_the_final_diff_is_stored_and_shown_after_the_workspace_is_gone(rh):
    engine = await rh.start()
    tid = rh.create("chain")
    t = await rh.until(tid)
    assert t.state == FAILED and t.torn_down
    diff, truncated, recorded = await engine.diff(tid)
    assert f"+fixed for {tid}" in diff and recorded and not truncated
    calls = rh.credentials.calls.count("diff")
    await engine.diff(tid)
    assert rh.credentials.calls.count("diff") == calls      # from the store, not the (gone) workspace


async def test_r16_an_approval_from_before_a_retry_does_not_merge_the_re_run(rh):
    engine = await rh.start()
    rh.credentials.conflict = True
    tid = rh.create("review")
    t = await rh.until(tid, (WAITING_APPROVAL,))
    await engine.approve(tid, "bob", t.awaiting_sha)
    t = await rh.until(tid)
    assert t.state == FAILED and "update the branch" in t.error
    rh.credentials.conflict = False
    await engine.retry(tid, "merge", "alice")
    t = await rh.until(tid, (WAITING_APPROVAL, SUCCEEDED, FAILED))
    assert t.state == WAITING_APPROVAL and rh.credentials.merged == []      # asks again, same head or not
    await engine.approve(tid, "carol", t.awaiting_sha)
    assert (await rh.until(tid)).state == SUCCEEDED
    assert rh.credentials.merged == [(tid, "c" * 40)]

    # Positive control: without reopened_at_ms the old approval of the same head merges at once.
    rh.credentials.conflict = True
    tid2 = rh.create("review")
    t = await rh.until(tid2, (WAITING_APPROVAL,))
    await engine.approve(tid2, "bob", t.awaiting_sha)
    assert (await rh.until(tid2)).state == FAILED
    rh.credentials.conflict = False
    engine.dispatch.started = False              # hold the dispatcher while the defence is taken away
    await engine.retry(tid2, "merge", "alice")
    rh.store.tickets.update(tid2, reopened_at_ms=0)
    engine.dispatch.started = True
    engine.dispatch.kick()
    t = await rh.until(tid2, (WAITING_APPROVAL, SUCCEEDED, FAILED))
    assert t.state == SUCCEEDED and (tid2, "c" * 40) in rh.credentials.merged


async def test_r16_update_branch_merges_the_base_and_the_new_head_needs_its_own_approval(rh):
    engine = await rh.start()
    rh.credentials.conflict = True
    tid = rh.create("review")
    t = await rh.until(tid, (WAITING_APPROVAL,))
    await engine.approve(tid, "bob", t.awaiting_sha)
    assert (await rh.until(tid)).state == FAILED
    rh.credentials.conflicts = ["calc.py", "README.md"]
    with pytest.raises(FailedPrecondition, match=r"conflicts in: calc\.py, README\.md; resolve them"):
        await engine.update_branch(tid, "alice")
    assert rh.store.tickets.get(tid).state == FAILED
    assert rh.events(tid, "branch.conflict")[0][1]["paths"] == ["calc.py", "README.md"]
    rh.credentials.conflicts = []
    await engine.update_branch(tid, "alice")
    t = await rh.until(tid, (WAITING_APPROVAL, SUCCEEDED, FAILED))
    assert t.state == WAITING_APPROVAL and t.awaiting_sha == "d" * 40
    with pytest.raises(FailedPrecondition, match=r"head is d{40} now, not c{40}"):
        await engine.approve(tid, "bob", "c" * 40)      # the approval of the old head is no approval of this one
    await engine.approve(tid, "bob", "d" * 40)
    assert (await rh.until(tid)).state == SUCCEEDED
    assert rh.credentials.merged == [(tid, "d" * 40)]
    assert rh.credentials.calls.count("open_pr") == 1      # the same pull request (R37)


async def test_on_failure_gives_the_failure_to_the_fix_node_and_stops_after_max_rounds(rh, prompts):
    await rh.start()
    tid = rh.create("loop")
    t = await rh.until(tid)
    assert t.state == FAILED and "node test failed" in t.error
    assert _started(rh, tid) == ["fix", "test", "fix", "test", "fix", "test"]      # 1 run + max 2 rounds
    rounds = rh.events(tid, "node.feedback")
    assert [p["round"] for _, p in rounds] == [1, 2] and all(p["to"] == "fix" for _, p in rounds)
    assert "FAIL-MARK-7" in rounds[0][1]["error"]
    assert rh.events(tid, "node.feedback_spent")[0][1]["rounds"] == 2
    assert "FAIL-MARK-7" not in prompts[0]
    assert all("FAIL-MARK-7" in p and "<<<QUOTED" in p for p in prompts[1:])    # fed back, delimited (R36)
    nodes = rh.nodes(tid)
    assert nodes["test"].rounds == 2 and "FAIL-MARK-7" in nodes["fix"].feedback
    assert nodes["pr"].state == "skipped" and rh.credentials.calls.count("open_pr") == 0


async def test_on_failure_rounds_end_when_the_node_passes(rh, prompts):
    await rh.start()
    tid = rh.create("heals")
    t = await rh.until(tid)
    assert t.state == SUCCEEDED, t.error
    assert _started(rh, tid) == ["fix", "test", "fix", "test"]
    assert [p["round"] for _, p in rh.events(tid, "node.feedback")] == [1]
    assert "first" in prompts[1]


def test_on_failure_must_name_an_earlier_model_or_agent_node(tmp_path):
    bad = MODEL + """\
kind: Workflow
name: w
workspace: ws
nodes:
  - {id: fix, model: fixer, prompt: p}
  - {id: lint, run: "true"}
  - {id: test, run: "true", needs: [lint], on_failure: {retry_from: fix}}
  - {id: t2, run: "true", needs: [lint], on_failure: {retry_from: lint}}
  - {id: t3, run: "true", needs: [fix], on_failure: {retry_from: fix, max: 99}}
"""
    (tmp_path / "fix.yaml").write_text("[]\n")
    (tmp_path / "afe.yaml").write_text(WORKSPACE + bad)
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    text = str(err.value)
    assert "node 'test' does not need 'fix'" in text or 'node "test" does not need "fix"' in text, text
    assert "is not a model or agent node" in text and "at most 20 rounds" in text


class Workspaces(Forge):
    """The forge whose diff, as the credential broker's, needs a prepared
    workspace: prepare makes one, release removes it."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared: set[str] = set()

    async def prepare(self, ticket_id: str, workspace: str) -> cpb.PrepareWorkspaceResponse:
        self.prepared.add(ticket_id)
        return await super().prepare(ticket_id, workspace)

    async def release(self, ticket_id: str, workspace: str) -> None:
        self.prepared.discard(ticket_id)
        await super().release(ticket_id, workspace)

    async def diff(self, ticket_id: str, workspace: str, max_bytes: int) -> cpb.DiffResponse:
        if ticket_id not in self.prepared:
            self._call("diff")
            raise FailedPrecondition(f"ticket {ticket_id} has no prepared workspace; prepare it first")
        return await super().diff(ticket_id, workspace, max_bytes)


async def test_a_retry_after_a_rejection_shows_the_live_diff_while_it_waits_for_approval(rh):
    rh.credentials = Workspaces()
    engine = await rh.start()
    tid = rh.create("review")
    t = await rh.until(tid, (WAITING_APPROVAL,))
    await engine.reject(tid, "bob", "try again")
    t = await rh.until(tid)
    assert t.state == FAILED and t.torn_down and tid not in rh.credentials.prepared
    diff, _, recorded = await engine.diff(tid)
    assert recorded and f"+fixed for {tid}" in diff                    # the stored diff of the ended run
    await asyncio.sleep(0.002)     # a decision of the re-open's own millisecond would count for the re-run
    await engine.retry(tid, "", "alice")
    t = await rh.until(tid, (WAITING_APPROVAL, SUCCEEDED, FAILED))
    assert t.state == WAITING_APPROVAL, t.error
    assert _started(rh, tid) == ["pr", "merge", "merge"]                # only the rejected merge ran again
    diff, _, recorded = await engine.diff(tid)
    assert not recorded and f"+fixed for {tid}" in diff                # the live workspace's, prepared again
    assert rh.credentials.calls.count("prepare") == 2
    await engine.approve(tid, "carol", t.awaiting_sha)
    assert (await rh.until(tid)).state == SUCCEEDED
    assert rh.credentials.merged == [(tid, "c" * 40)]
