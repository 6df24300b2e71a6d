"""R41 in the executor's fast tier (real engine and store, in-process broker
fakes): the verification of a head runs once in a fresh `<ticket>-verify`
sandbox of the workspace's own settings, is stored, is carried by the
approval request, is not run again by a resumed ticket, and `builtin:merge`
refuses a head whose verification did not pass (positive control: a passing
one is merged)."""

from __future__ import annotations

import asyncio

from services._gen.afe.credentials.v1 import credentials_pb2 as cpb
from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services.scheduler.executor.nodes import verification
from services.scheduler.store.base import FAILED, SUCCEEDED, WAITING_APPROVAL

from .fakes import FakeCredentials, FakeSandbox

HEAD = "c" * 40


def workflow(commands: str, base_paths: str = "[tests/]") -> str:
    return f"""\
kind: Workflow
name: review
workspace: ws
verify:
  run: {commands}
  base_paths: {base_paths}
  timeout: 30
nodes:
  - {{id: test, run: "echo tests pass in the workspace"}}
  - {{id: pr, uses: "builtin:open_pr", needs: [test]}}
  - {{id: merge, uses: "builtin:merge", needs: [pr]}}
"""


class Checkouts(FakeCredentials):
    """FakeCredentials with the verification checkout's two calls, recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.verifications: list[tuple[str, str, list[str]]] = []
        self.released: list[str] = []

    async def prepare_verification(self, ticket_id: str, workspace: str, sha: str,
                                   base_paths: list[str]) -> cpb.PrepareVerificationResponse:
        self._call("prepare_verification")
        self.verifications.append((ticket_id, sha, list(base_paths)))
        return cpb.PrepareVerificationResponse(sha=sha, base_sha="b" * 40, tree="e" * 40, commit="f" * 40,
                                               workspace_ticket=ticket_id + "-verify")

    async def release_verification(self, ticket_id: str, workspace: str) -> None:
        self._call("release_verification")
        self.released.append(ticket_id)


class Specs(FakeSandbox):
    def __init__(self) -> None:
        super().__init__()
        self.specs: dict[str, spb.SandboxSpec] = {}

    async def create(self, ticket_id: str, spec: spb.SandboxSpec) -> spb.Sandbox:
        self.specs[ticket_id] = spec
        return await super().create(ticket_id, spec)


def _harness(harness, wf: str):
    h = harness(wf)
    h.credentials, h.sandbox = Checkouts(), Specs()
    return h


async def test_r41_verification_runs_once_per_head_in_a_fresh_sandbox_and_a_pass_is_merged(harness):
    h = _harness(harness, workflow('["echo unit {{ticket.title}}", "echo lint"]'))
    engine = await h.start()
    tid = h.create("review", title="x; exit 9")
    t = await h.until(tid, (WAITING_APPROVAL,))
    vid = tid + "-verify"
    assert h.credentials.verifications == [(tid, HEAD, ["tests/"])] and h.credentials.released == [tid]
    spec = h.sandbox.specs[vid]
    assert spec.image == "afe/sandbox:latest" and not spec.relay and list(spec.env_names) == []
    # a leftover is destroyed before the create, the sandbox after the commands
    assert h.sandbox.destroyed.count(vid) == 2 and h.sandbox.created.count(vid) == 1
    # the commands ran in the verification sandbox, the ticket's title as $1, never as shell code (R36)
    ran = [(s, c) for s, c in h.sandbox.started if s == vid]
    assert len(ran) == 2 and "exit 9" not in ran[0][1] and ran[1][1] == "echo lint"
    finished = h.events(tid, "verification.finished")
    assert len(finished) == 1 and finished[0][1]["passed"] is True
    assert [c["command"] for c in finished[0][1]["commands"]] == ["echo unit {{ticket.title}}", "echo lint"]
    assert [c["exit_code"] for c in finished[0][1]["commands"]] == [0, 0]
    started = h.events(tid, "verification.started")[0][1]
    assert started["sha"] == HEAD and started["base_paths"] == ["tests/"]
    assert any(p["stream"] == "stdout" for _, p in h.events(tid, "verification.output"))
    asked = h.events(tid, "approval.requested")[0][1]
    assert asked["verification"]["passed"] is True and asked["verification"]["base_paths"] == ["tests/"]
    rec = h.store.verification(tid, HEAD)
    assert rec is not None and rec.passed and rec.result == finished[0][1]

    engine = await h.restart()                 # a resumed ticket asks again: the stored result, no new run
    await h.until(tid, (WAITING_APPROVAL,))
    await asyncio.sleep(0.05)
    assert h.credentials.calls.count("prepare_verification") == 1
    assert len(h.events(tid, "verification.started")) == 1
    await engine.approve(tid, "bob", t.awaiting_sha)
    t = await h.until(tid)
    assert t.state == SUCCEEDED, t.error
    assert h.credentials.merged == [(tid, HEAD)]                                  # positive control


async def test_r41_a_failed_verification_is_shown_on_the_approval_and_the_merge_is_refused(harness):
    h = _harness(harness, workflow('["echo unit; exit 1", "echo never"]'))
    engine = await h.start()
    tid = h.create("review")
    t = await h.until(tid, (WAITING_APPROVAL,))
    asked = h.events(tid, "approval.requested")[0][1]["verification"]
    assert asked["passed"] is False
    assert [(c["command"], c["exit_code"]) for c in asked["commands"]] == [("echo unit; exit 1", 1)]  # stopped there
    assert all(c != "echo never" for _, c in h.sandbox.started)
    assert h.sandbox.destroyed.count(tid + "-verify") == 2 and h.credentials.released == [tid]
    await engine.approve(tid, "bob", t.awaiting_sha)     # a person may approve; the merge still refuses
    t = await h.until(tid)
    assert t.state == FAILED
    assert ("builtin:merge refused: verification failed: `echo unit; exit 1` exited 1 (tests/ from main)"
            in t.error), t.error
    assert "send a follow-up" in t.error
    assert h.credentials.merged == [] and h.credentials.calls.count("merge") == 0
    assert h.credentials.calls.count("prepare_verification") == 1     # not retried


async def test_r41_merge_refuses_a_head_without_a_stored_verification(harness):
    h = _harness(harness, workflow('["echo ok"]'))
    await h.start()
    tid = h.create("review")
    await h.until(tid, (WAITING_APPROVAL,))

    class Ctx:
        workflow = h.config.workflows["review"]
        store = h.store
        ticket = h.store.get_ticket(tid)
    node = Ctx.workflow.node("merge")
    verification.check_mergeable(Ctx, node, HEAD)         # type: ignore[arg-type]  # verified: passes
    try:
        verification.check_mergeable(Ctx, node, "d" * 40)  # type: ignore[arg-type]
    except verification.VerificationFailed as exc:
        assert "has no verification" in exc.message and "send a follow-up" in exc.message
    else:
        raise AssertionError("a head without a verification was mergeable")
