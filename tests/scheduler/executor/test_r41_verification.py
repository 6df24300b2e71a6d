"""R41 in the executor's fast tier (real engine and store, in-process broker
fakes): the verification of a head runs once per base tip in a fresh
`<ticket>-verify` sandbox of the workspace's own settings, is stored, is
carried by the approval request, is not run again by a resumed ticket; a
failed one cannot be approved; a harness change needs an acknowledgement;
test counts decide as much as exit codes; a moved base verifies again before
the merge; a sandbox that could not run stores nothing (positive controls:
a passing, acknowledged, unmoved head is merged)."""

from __future__ import annotations

import asyncio

import pytest

from services._gen.afe.credentials.v1 import credentials_pb2 as cpb
from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services.common.errors import FailedPrecondition, Unavailable
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
    """FakeCredentials with the verification checkout's two calls, recorded; `base` is the
    base branch's tip and `harness` the harness changes the next checkouts report."""

    def __init__(self) -> None:
        super().__init__()
        self.verifications: list[tuple[str, str, list[str]]] = []
        self.released: list[str] = []
        self.base = "b" * 40
        self.harness: list[str] = []
        self.conflicts: list[str] = []
        self.checked_out = ""

    async def prepare_verification(self, ticket_id: str, workspace: str, sha: str, base_paths: list[str],
                                   commands: list[str]) -> cpb.PrepareVerificationResponse:
        self._call("prepare_verification")
        self.verifications.append((ticket_id, sha, list(base_paths)))
        self.checked_out = sha
        return cpb.PrepareVerificationResponse(sha=sha, base_sha=self.base, tree="e" * 40, commit="f" * 40,
                                               workspace_ticket=ticket_id + "-verify",
                                               harness_changes=[] if sha == self.base else self.harness,
                                               conflicts=self.conflicts)

    async def release_verification(self, ticket_id: str, workspace: str) -> None:
        self._call("release_verification")
        self.released.append(ticket_id)


class Specs(FakeSandbox):
    """FakeSandbox whose verification commands print `summaries[checked-out sha]` (a test
    runner's summary line) and whose creates can be made to fail."""

    def __init__(self, checkouts: Checkouts) -> None:
        super().__init__()
        self.specs: dict[str, spb.SandboxSpec] = {}
        self.checkouts = checkouts
        self.summaries: dict[str, str] = {}
        self.fail_create: Exception | None = None

    async def create(self, ticket_id: str, spec: spb.SandboxSpec) -> spb.Sandbox:
        if self.fail_create is not None and ticket_id.endswith("-verify"):
            raise self.fail_create
        self.specs[ticket_id] = spec
        return await super().create(ticket_id, spec)

    async def exec(self, ticket_id, argv, timeout_ms=0, output_cap_bytes=0, cwd=""):  # type: ignore[no-untyped-def]
        summary = self.summaries.get(self.checkouts.checked_out) if ticket_id.endswith("-verify") else None
        async for ev in super().exec(ticket_id, argv, timeout_ms, output_cap_bytes, cwd):
            if summary is not None and ev.WhichOneof("event") == "exit" and argv[:1] != ["true"]:
                yield spb.ExecEvent(stdout=(summary + "\n").encode())
            yield ev


def _harness(harness, wf: str):
    h = harness(wf)
    h.credentials = Checkouts()
    h.sandbox = Specs(h.credentials)
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
    assert finished[0][1]["base_sha"] == "b" * 40 and finished[0][1]["merge_sha"] == "f" * 40
    started = h.events(tid, "verification.started")[0][1]
    assert started["sha"] == HEAD and started["base_paths"] == ["tests/"]
    assert any(p["stream"] == "stdout" for _, p in h.events(tid, "verification.output"))
    asked = h.events(tid, "approval.requested")[0][1]
    assert asked["verification"]["passed"] is True and asked["verification"]["base_paths"] == ["tests/"]
    rec = h.store.verifications.verification(tid, HEAD)
    assert rec is not None and rec.passed and rec.result == finished[0][1]

    engine = await h.restart()                 # a resumed ticket asks again: the stored result, no new run
    await h.until(tid, (WAITING_APPROVAL,))
    await asyncio.sleep(0.05)
    assert len(h.events(tid, "verification.started")) == 1 and h.sandbox.created.count(vid) == 1
    await engine.approve(tid, "bob", t.awaiting_sha)
    t = await h.until(tid)
    assert t.state == SUCCEEDED, t.error
    assert h.credentials.merged == [(tid, HEAD)]                                  # positive control
    assert h.events(tid, "merge.done")[0][1]["verified_base_sha"] == "b" * 40


async def test_r41_a_failed_verification_is_shown_and_cannot_be_approved(harness):
    h = _harness(harness, workflow('["echo unit; exit 1", "echo never"]'))
    engine = await h.start()
    tid = h.create("review")
    t = await h.until(tid, (WAITING_APPROVAL,))
    asked = h.events(tid, "approval.requested")[0][1]["verification"]
    assert asked["passed"] is False
    assert [(c["command"], c["exit_code"]) for c in asked["commands"]] == [("echo unit; exit 1", 1)]  # stopped there
    assert all(c != "echo never" for _, c in h.sandbox.started)
    assert h.sandbox.destroyed.count(tid + "-verify") == 2 and h.credentials.released == [tid]
    with pytest.raises(FailedPrecondition) as refused:
        await engine.approve(tid, "bob", t.awaiting_sha)
    assert "verification failed: `echo unit; exit 1` exited 1 (tests/ from main)" in refused.value.message
    assert "cannot be approved" in refused.value.message and "send a follow-up" in refused.value.message
    await engine.reject(tid, "bob", "the tests fail")
    t = await h.until(tid)
    assert t.state == FAILED and h.credentials.merged == []


async def test_r41_a_harness_change_is_approved_only_with_the_acknowledgement(harness):
    h = _harness(harness, workflow('["echo ok"]'))
    h.credentials.harness = ["conftest.py", "pytest.ini"]
    engine = await h.start()
    tid = h.create("review")
    t = await h.until(tid, (WAITING_APPROVAL,))
    asked = h.events(tid, "approval.requested")[0][1]["verification"]
    assert asked["passed"] is True and asked["harness_changes"] == ["conftest.py", "pytest.ini"]
    with pytest.raises(FailedPrecondition) as refused:
        await engine.approve(tid, "bob", t.awaiting_sha)
    assert "changes how its tests run: conftest.py, pytest.ini" in refused.value.message
    assert "--accept-harness-change" in refused.value.message
    assert h.credentials.merged == []
    await engine.approve(tid, "bob", t.awaiting_sha, accept_harness_change=True)
    t = await h.until(tid)
    assert t.state == SUCCEEDED, t.error
    granted = h.events(tid, "approval.granted")[0][1]
    assert granted["accepted_harness_change"] == ["conftest.py", "pytest.ini"]
    appr = h.store.approvals.latest_approval(tid)
    assert appr is not None and appr.accepted_harness_change == ["conftest.py", "pytest.ini"]
    assert h.credentials.merged == [(tid, HEAD)]


@pytest.mark.parametrize(("summary", "reason"), [
    ("no tests ran in 0.01s", "ran no test"),
    ("Ran 0 tests in 0.000s\n\nOK", "ran no test"),
    ("", "runs pytest but printed no summary"),
    ("3 passed, 2 deselected in 0.1s", "ran 3 tests, fewer than the base's own run of the same commands (5"),
])
async def test_r41_counts_fail_a_verification_whose_commands_all_exit_0(harness, summary, reason):
    h = _harness(harness, workflow('["python3 -m pytest -q"]'))
    h.sandbox.summaries = {HEAD: summary, "b" * 40: "4 passed, 1 failed in 0.2s"}
    engine = await h.start()
    tid = h.create("review")
    t = await h.until(tid, (WAITING_APPROVAL,))
    v = h.events(tid, "approval.requested")[0][1]["verification"]
    assert v["passed"] is False and [c["exit_code"] for c in v["commands"]] == [0]
    assert any(reason in r for r in v["reasons"]), v["reasons"]
    with pytest.raises(FailedPrecondition):
        await engine.approve(tid, "bob", t.awaiting_sha)


async def test_r41_counts_at_least_the_base_pass_and_the_base_runs_once(harness):
    h = _harness(harness, workflow('["python3 -m pytest -q"]'))
    h.sandbox.summaries = {HEAD: "5 passed in 0.1s", "b" * 40: "4 passed, 1 failed in 0.2s"}   # control
    engine = await h.start()
    tid = h.create("review")
    t = await h.until(tid, (WAITING_APPROVAL,))
    v = h.events(tid, "approval.requested")[0][1]["verification"]
    assert v["passed"] is True, v["reasons"]
    assert v["tests"]["ran"] == 5 and v["base_tests"]["ran"] == 5
    assert [p["base_sha"] for _, p in h.events(tid, "verification.base")] == ["b" * 40]
    await engine.approve(tid, "bob", t.awaiting_sha)
    t = await h.until(tid)
    assert t.state == SUCCEEDED, t.error
    assert len(h.events(tid, "verification.base")) == 1       # once per base tip


async def test_r41_a_base_that_moved_after_the_approval_is_verified_again_before_the_merge(harness):
    h = _harness(harness, workflow('["python3 -m pytest -q"]'))
    new_base = "a" * 40
    h.sandbox.summaries = {HEAD: "3 passed in 0.1s", "b" * 40: "3 passed in 0.1s", new_base: "4 passed in 0.1s"}
    engine = await h.start()
    tid = h.create("review")
    t = await h.until(tid, (WAITING_APPROVAL,))
    assert h.events(tid, "approval.requested")[0][1]["verification"]["passed"] is True
    h.credentials.base = new_base     # the base gained a test the head does not run
    await engine.approve(tid, "bob", t.awaiting_sha)
    t = await h.until(tid)
    assert t.state == FAILED and h.credentials.merged == []
    assert "builtin:merge refused" in t.error and "fewer than the base's own run" in t.error, t.error
    assert "the base moved to aaaaaaaaaaaa" in t.error
    moved = h.events(tid, "verification.base_moved")[0][1]
    assert moved["verified_base_sha"] == "b" * 40 and moved["base_sha"] == new_base and moved["passed"] is False


async def test_r41_a_base_that_did_not_move_merges_without_a_new_run(harness):
    """The positive control of the test above: the same head and base, no move, merged."""
    h = _harness(harness, workflow('["python3 -m pytest -q"]'))
    h.sandbox.summaries = {HEAD: "3 passed in 0.1s", "b" * 40: "3 passed in 0.1s"}
    engine = await h.start()
    tid = h.create("review")
    t = await h.until(tid, (WAITING_APPROVAL,))
    await engine.approve(tid, "bob", t.awaiting_sha)
    t = await h.until(tid)
    assert t.state == SUCCEEDED and h.credentials.merged == [(tid, HEAD)]
    assert len(h.events(tid, "verification.started")) == 1 and not h.events(tid, "verification.base_moved")


async def test_r41_a_head_that_does_not_merge_onto_the_base_fails_naming_the_conflicts(harness):
    h = _harness(harness, workflow('["echo ok"]'))
    h.credentials.conflicts = ["calc.py"]
    await h.start()
    tid = h.create("review")
    await h.until(tid, (WAITING_APPROVAL,))
    v = h.events(tid, "approval.requested")[0][1]["verification"]
    assert v["passed"] is False and "conflicts in calc.py" in v["reasons"][0] and v["commands"] == []
    assert h.sandbox.created.count(tid + "-verify") == 0


@pytest.mark.slow
async def test_r41_a_verification_that_could_not_run_is_no_verdict_and_a_retry_runs_it(harness):
    h = _harness(harness, workflow('["echo ok"]'))
    h.sandbox.fail_create = Unavailable("the sandbox broker is not reachable")
    engine = await h.start()
    tid = h.create("review")
    t = await h.until(tid)
    assert t.state == FAILED
    assert "verification could not run" in t.error and f"afe ticket retry {tid}" in t.error, t.error
    assert h.store.verifications.verification(tid, HEAD) is None                    # nothing stored for the head
    assert h.events(tid, "verification.error") and not h.events(tid, "verification.finished")
    h.sandbox.fail_create = None
    await engine.retry(tid, "", "bob")
    t = await h.until(tid, (WAITING_APPROVAL,))
    rec = h.store.verifications.verification(tid, HEAD)
    assert rec is not None and rec.passed


async def test_r41_a_changed_verify_declaration_verifies_again(harness):
    h = _harness(harness, workflow('["echo ok"]'))
    await h.start()
    tid = h.create("review")
    await h.until(tid, (WAITING_APPROVAL,))
    from services.scheduler.executor.nodes.verification import config_digest
    ws = h.config.workspaces["ws"]
    first = config_digest(h.config.workflows["review"].verify, ws)
    changed = h.config.workflows["review"].verify.__class__(run=("echo other",), base_paths=("tests/",),
                                                             timeout_s=30)
    assert config_digest(changed, ws) != first
    assert h.store.verifications.verification_with(tid, HEAD, "b" * 40, first) is not None
    assert h.store.verifications.verification_with(tid, HEAD, "b" * 40, config_digest(changed, ws)) is None


async def test_r41_a_command_that_reaches_the_clean_rooms_time_out_is_no_verdict(harness):
    h = _harness(harness, workflow('["echo ok"]'))
    real_exec = h.sandbox.exec

    async def timing_out(ticket_id, argv, timeout_ms=0, output_cap_bytes=0, cwd=""):  # type: ignore[no-untyped-def]
        async for ev in real_exec(ticket_id, argv, timeout_ms, output_cap_bytes, cwd):
            if ticket_id.endswith("-verify") and ev.WhichOneof("event") == "exit":
                ev = spb.ExecEvent(exit=spb.ExecExit(code=-1, timed_out=True))
            yield ev

    h.sandbox.exec = timing_out
    await h.start()
    tid = h.create("review")
    t = await h.until(tid)
    assert t.state == FAILED and "did not finish within 30 s (verify.timeout)" in t.error, t.error
    assert "verification could not run" in t.error and h.store.verifications.verification(tid, HEAD) is None


async def test_r41_the_merge_is_pinned_to_the_verified_base_and_a_move_in_between_verifies_again(harness):
    h = _harness(harness, workflow('["python3 -m pytest -q"]'))
    h.sandbox.summaries = {HEAD: "3 passed in 0.1s", "b" * 40: "3 passed in 0.1s", "a" * 40: "3 passed in 0.1s"}
    engine = await h.start()
    tid = h.create("review")
    t = await h.until(tid, (WAITING_APPROVAL,))
    # the base moves after ensure_mergeable verified it and before the broker merges: the broker refuses
    h.credentials.base_moves_at_merge = True
    real_merge = h.credentials.merge

    async def moving(*args, **kw):  # type: ignore[no-untyped-def]
        if h.credentials.base_moves_at_merge:
            h.credentials.base = "a" * 40          # what the next verification sees
        return await real_merge(*args, **kw)

    h.credentials.merge = moving
    await engine.approve(tid, "bob", t.awaiting_sha)
    t = await h.until(tid)
    assert t.state == SUCCEEDED, t.error
    assert h.credentials.merge_bases == ["b" * 40, "a" * 40]      # each merge names the base it was verified on
    assert h.credentials.merged == [(tid, HEAD)]
    assert h.events(tid, "merge.base_moved")[0][1]["verified_base_sha"] == "b" * 40
    assert h.store.verifications.verification_with(tid, HEAD, "a" * 40, h.store.verifications.verification(tid, HEAD).config) is not None
