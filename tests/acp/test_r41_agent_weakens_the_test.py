"""R41 with an ACP coding agent (afe's scripted test agent `cheater`, in the
sandbox over the Agent Client Protocol): it "fixes" the failing test by
editing the TEST and runs it in a terminal, where it passes; the workflow's own
`run:` node passes too. The clean-room verification with `base_paths: [tests/]`
runs the base branch's test on the head and fails, a person's approval is
refused, and nothing is merged. Positive control: without base
paths the same edit verifies and merges. (The same with a model node, and the
sandbox's properties: tests/scheduler/executor/test_r41_clean_room_verification.py.)"""

from __future__ import annotations

import json

import grpc
import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.layout import Layout
from tests.acp.image import IMAGE, agent_command
from tests.scheduler.conftest import (
    all_events,
    forge_records,
    git,
    payload,
    state_name,
    wait_for_state,
    write_config,
)
from tests.scheduler.executor.test_r41_clean_room_verification import UNITTEST, make_repo
from tests.support.system import afe_system

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

CONFIG = """\
kind: Agent
name: cheater
type: acp
command: %(command)s
image: %(image)s
---
kind: Workflow
name: cheat
workspace: ws
verify:
  run: ["%(unittest)s"]
  %(base_paths)s
nodes:
  - {id: code, agent: cheater, prompt: "Make the tests pass", timeout: 120}
  - {id: test, run: "%(unittest)s", needs: [code]}
  - {id: pr, uses: builtin:open_pr, needs: [test]}
  - {id: merge, uses: builtin:merge, needs: [pr]}
"""


@pytest.mark.parametrize("base_paths", ["base_paths: [tests/]", ""], ids=["base-tests", "control-head-tests"])
async def test_r41_an_acp_agent_that_edits_the_test_is_never_merged(short_tmp, acp_image, base_paths):
    make_repo(short_tmp / "cfg" / "repos" / "calc.git")
    cfg = write_config(short_tmp, CONFIG % {"command": json.dumps(list(agent_command("cheater"))), "image": IMAGE,
                                            "unittest": UNITTEST, "base_paths": base_paths})
    layout = Layout(short_tmp / "data", short_tmp / "run")
    bare = cfg / "repos" / "calc.git"
    base = git(bare, "rev-parse", "main").strip()
    async with afe_system(cfg, layout) as sys_:
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="cheat", title="fix add"))
        t = await wait_for_state(sys_.stub, t.id, {"waiting_approval", "failed"})
        assert state_name(t) == "waiting_approval", t.error
        events = await all_events(sys_.stub, t.id)
        # the agent edited the test and ran it in a terminal of its sandbox, where it passed
        assert any(payload(e).get("op") == "exit" and payload(e).get("exit_code") == 0
                   for e in events if e.type == "agent.terminal")
        assert {n.id: n.state for n in t.nodes}["test"] == pb.NODE_STATE_SUCCEEDED
        assert "add(2, 3), -1)" in git(bare, "show", f"{t.awaiting_sha}:tests/test_add.py")
        (finished,) = [payload(e) for e in events if e.type == "verification.finished"]
        if base_paths:
            assert finished["passed"] is False and finished["commands"][0]["exit_code"] == 1
            with pytest.raises(grpc.aio.AioRpcError) as refused:     # a failed head is not approvable
                await sys_.stub.ApproveTicket(pb.ApproveTicketRequest(id=t.id, principal="carol",
                                                                      sha=t.awaiting_sha))
            assert "verification failed" in refused.value.details() and "cannot be approved" in \
                refused.value.details()
            await sys_.stub.RejectTicket(pb.RejectTicketRequest(id=t.id, principal="carol", reason="tests fail"))
            t = await wait_for_state(sys_.stub, t.id, {"failed", "succeeded"})
            assert state_name(t) == "failed"
            assert git(bare, "rev-parse", "main").strip() == base                  # nothing merged
            assert forge_records(layout.data_dir, t.id)[0]["state"] == "open"
        else:       # positive control: the head's own (weakened) test verifies, and the merge happens
            t = await sys_.stub.ApproveTicket(pb.ApproveTicketRequest(id=t.id, principal="carol",
                                                                      sha=t.awaiting_sha))
            t = await wait_for_state(sys_.stub, t.id, {"failed", "succeeded"})
            assert finished["passed"] is True
            assert state_name(t) == "succeeded", t.error
            assert "add(2, 3), -1)" in git(bare, "show", "main:tests/test_add.py")
