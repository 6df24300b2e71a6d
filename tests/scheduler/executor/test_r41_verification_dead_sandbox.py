"""R41 on the four real processes (real Docker): a verification sandbox that
dies in the middle of a command (here killed with `docker kill` during the
first verify command, a `sleep`) is no verdict on the head. Nothing is
stored for the head, no `verification.finished` is emitted, the ticket fails
saying the verification could not run and how to run it again; `afe ticket
retry` then verifies the same head in a new sandbox, which passes (the
control: the head is an honest fix), and the approval is asked."""

from __future__ import annotations

import asyncio

import docker
import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.layout import Layout
from tests.scheduler.conftest import (
    all_events,
    payload,
    state_name,
    wait_for_event,
    wait_for_state,
    write_config,
)
from tests.support.system import afe_system

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

UNITTEST = "python3 -m unittest -q test_calc"
CONFIG = f"""\
kind: Workflow
name: honest
workspace: ws
verify:
  run: ["sleep 4", "{UNITTEST}"]
  timeout: 120
nodes:
  - {{id: fix, run: "sed -i 's/a - b/a + b/' calc.py"}}
  - {{id: pr, uses: builtin:open_pr, needs: [fix]}}
  - {{id: merge, uses: builtin:merge, needs: [pr]}}
"""


async def _kill_verify_sandbox(client: docker.DockerClient, vid: str) -> str:
    for _ in range(400):
        found = [c for c in client.containers.list(filters={"label": f"afe.ticket={vid}"})
                 if c.labels.get("afe.role") == "sandbox"]
        if found:
            await asyncio.sleep(1.0)                   # inside the `sleep 4`
            found[0].kill()
            return found[0].id
        await asyncio.sleep(0.05)
    raise AssertionError(f"no sandbox for {vid} appeared")


async def test_r41_a_verification_sandbox_killed_mid_command_is_no_verdict_and_a_retry_verifies(short_tmp):
    cfg = write_config(short_tmp, CONFIG)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    client = docker.from_env()
    async with afe_system(cfg, layout) as sys_:
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="honest", title="fix add"))
        vid = t.id + "-verify"
        await wait_for_event(sys_.stub, t.id, lambda e: e.type == "verification.started")
        killed = await _kill_verify_sandbox(client, vid)
        t = await wait_for_state(sys_.stub, t.id, {"waiting_approval", "failed"})
        assert state_name(t) == "failed", "a killed verification sandbox gave a verdict"
        assert "verification could not run" in t.error and f"afe ticket retry {t.id}" in t.error, t.error
        events = await all_events(sys_.stub, t.id)
        assert not [e for e in events if e.type == "verification.finished"]      # nothing stored or shown
        assert [payload(e) for e in events if e.type == "verification.error"]
        assert not [e for e in events if e.type == "approval.requested"]

        t = await sys_.stub.RetryTicket(pb.RetryTicketRequest(id=t.id, principal="carol"))
        t = await wait_for_state(sys_.stub, t.id, {"waiting_approval", "failed"})
        assert state_name(t) == "waiting_approval", t.error
        events = await all_events(sys_.stub, t.id)
        finished = [payload(e) for e in events if e.type == "verification.finished"]
        assert len(finished) == 1 and finished[0]["passed"] is True, finished
        assert [c["exit_code"] for c in finished[0]["commands"]] == [0, 0]
        assert finished[0]["tests"]["ran"] == 2
        assert killed not in [c.id for c in client.containers.list(all=True)]
