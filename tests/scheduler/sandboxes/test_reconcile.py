"""On start the scheduler has the sandbox broker reconcile against its live
tickets: leftovers of unknown or finished tickets go (R12), a live ticket's
sandbox stays and its running node runs again."""

from __future__ import annotations

import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.layout import Layout
from tests.scheduler.conftest import payload, state_name, wait_for_event, wait_for_state, write_config
from tests.support.system import afe_system

pytestmark = [pytest.mark.docker, pytest.mark.timeout(240)]

WORKFLOW = """\
kind: Workflow
name: nap
workspace: ws
nodes:
  - {id: nap, run: "echo napping && sleep 2"}
"""


async def _live(sys_) -> set[str]:
    return {s.ticket_id for s in (await sys_.sandbox.ListSandboxes(spb.ListSandboxesRequest())).sandboxes}


async def test_restart_reconciles_leftovers_and_keeps_live_sandboxes(short_tmp):
    cfg = write_config(short_tmp, WORKFLOW)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout, subprocess=True) as sys_:
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="nap", title="nap"))
        await wait_for_event(sys_.stub, t.id, lambda e: e.type == "node.output" and "napping" in payload(e)["text"])
        await sys_.kill_scheduler()
        # A leftover of a ticket the scheduler does not know (e.g. from a lost store).
        await sys_.sandbox.CreateSandbox(spb.CreateSandboxRequest(ticket_id="t-orphan", spec=spb.SandboxSpec()))
        assert {t.id, "t-orphan"} <= await _live(sys_)          # positive control: both exist
        await sys_.start_scheduler()
        assert "t-orphan" not in await _live(sys_)
        t = await wait_for_state(sys_.stub, t.id, {"succeeded", "failed"})
        assert state_name(t) == "succeeded" and t.nodes[0].attempt == 2
        assert t.id not in await _live(sys_)
