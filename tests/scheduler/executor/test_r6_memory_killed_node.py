"""R6 at the scheduler, under gVisor: a `run` node whose sandbox is killed at
its memory limit fails at once, long before its timeout, and the ticket's
error names the limit (not runsc's "urpc ... WaitPID failed: EOF").
tests/sandbox/containers/test_r6_killed_at_a_limit.py has the positive control (without
the broker's death watch the command waits for its deadline)."""

from __future__ import annotations

import json

import docker
import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.layout import Layout
from tests.sandbox.conftest import gvisor_missing
from tests.scheduler.conftest import all_events, state_name, wait_for_state, write_config
from tests.support.system import afe_system

pytestmark = [pytest.mark.docker, pytest.mark.timeout(240)]

NODE_TIMEOUT_S = 600
WORKFLOW = f"""\
kind: Workflow
name: hog
workspace: ws
nodes:
  - id: hog
    timeout: {NODE_TIMEOUT_S}
    run: "python3 -c \\"b = bytearray(512 * 1024 * 1024); print('allocated', len(b))\\""
"""


async def test_r6_gvisor_a_node_killed_at_the_memory_limit_fails_at_once_naming_it(short_tmp):
    client = docker.from_env()
    try:
        if why := gvisor_missing(client):
            pytest.skip(why)
    finally:
        client.close()
    cfg = write_config(short_tmp, WORKFLOW, sandbox_extra="  runtime: gvisor\n")
    text = (cfg / "afe.yaml").read_text()
    (cfg / "afe.yaml").write_text(text.replace("limits: {cpus: 1, memory: 256m, pids: 128}",
                                               "limits: {cpus: 1, memory: 64m, pids: 128}", 1))
    async with afe_system(cfg, Layout(short_tmp / "data", short_tmp / "run")) as sys_:
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="hog", title="hog"))
        done = await wait_for_state(sys_.stub, t.id, {"failed", "succeeded", "cancelled"}, deadline_s=180)
        assert state_name(done) == "failed"
        assert ("the sandbox was killed: it reached its memory limit of 64 MiB (sandbox.limits.memory)"
                in done.error), done.error
        assert "urpc" not in done.error and "timed out" not in done.error
        events = await all_events(sys_.stub, t.id)
        started = next(e.at_ms for e in events if e.type == "node.started" and json.loads(e.payload_json)["node"] == "hog")
        ended = next(e.at_ms for e in events if e.type == "node.finished" and json.loads(e.payload_json)["node"] == "hog")
        took = (ended - started) / 1000
        print(f"the memory-killed node failed {took:.2f} s after it started (its timeout: {NODE_TIMEOUT_S} s)")
        assert took < 30
