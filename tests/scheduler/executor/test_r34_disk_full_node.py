"""R34 at the scheduler: a `run` node that fills the workspace past
`sandbox.limits.disk` fails with ENOSPC and a reason naming the limit; the
engine keeps running tickets, and teardown leaves no mount or image."""

from __future__ import annotations

import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.host import mountinfo
from services.common.layout import Layout
from services.sandbox.files import diskcap
from tests.scheduler.conftest import state_name, wait_for_state, write_config
from tests.support.system import afe_system

pytestmark = [pytest.mark.docker, pytest.mark.timeout(240),
              pytest.mark.skipif(diskcap.detect_mode()[0] != diskcap.MODE_MOUNT,
                                 reason="the broker cannot loop-mount here")]

WORKFLOWS = """\
kind: Workflow
name: fill
workspace: ws
nodes:
  - id: fill
    run: "dd if=/dev/zero of=big bs=1M count=64"
---
kind: Workflow
name: small
workspace: ws
nodes:
  - id: write
    run: "dd if=/dev/zero of=small bs=1M count=4 && echo wrote"
"""


async def test_r34_a_node_that_fills_the_workspace_fails_naming_the_disk_limit(short_tmp):
    cfg = write_config(short_tmp, WORKFLOWS, sandbox_extra="  limits: {cpus: 1, memory: 256m, pids: 128, disk: 32m}\n")
    # the workspace of tests/scheduler/conftest.py has a limits line already: keep only ours
    text = (cfg / "afe.yaml").read_text().replace("  limits: {cpus: 1, memory: 256m, pids: 128}\n", "", 1)
    (cfg / "afe.yaml").write_text(text)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout) as sys_:
        full = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="fill", title="fill"))
        done = await wait_for_state(sys_.stub, full.id, {"failed", "succeeded", "cancelled"})
        assert state_name(done) == "failed"
        assert "No space left on device" in done.error, done.error
        assert "the workspace holds at most 32m (sandbox.limits.disk of workspace 'ws'" in done.error
        # Positive control and the engine keeps working: a write under the cap succeeds.
        ok = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="small", title="small"))
        ok = await wait_for_state(sys_.stub, ok.id, {"failed", "succeeded", "cancelled"})
        assert state_name(ok) == "succeeded", ok.error
        for t in (full.id, ok.id):
            ws = layout.workspace(t)
            assert not any(m.target == str(ws) for m in mountinfo.mounts())
            assert not (layout.workspaces_dir / f".{t}.img").exists()
            assert not ws.exists()          # the credential broker removed it after the unmount
