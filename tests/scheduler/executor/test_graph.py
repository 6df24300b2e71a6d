"""Workflow execution: independent branches run in parallel, `needs` orders
the rest, per-node timeout, retries, and a failure skips what depends on it."""

from __future__ import annotations

import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.layout import Layout
from tests.scheduler.conftest import all_events, payload, state_name, wait_for_state, write_config
from tests.support.system import afe_system

pytestmark = [pytest.mark.docker, pytest.mark.timeout(240)]

CONFIG = """\
kind: Workflow
name: diamond
workspace: ws
nodes:
  - {id: left, run: "touch .left-started; for i in $(seq 100); do test -f .right-started && break; sleep 0.1; done; test -f .right-started"}
  - {id: right, run: "touch .right-started; for i in $(seq 100); do test -f .left-started && break; sleep 0.1; done; test -f .left-started"}
  - {id: join, run: "echo joined", needs: [left, right]}
---
kind: Workflow
name: flaky
workspace: ws
nodes:
  - {id: flaky, run: "if [ -f .tried ]; then echo second; else touch .tried; echo first; exit 3; fi", retries: 1}
---
kind: Workflow
name: slow
workspace: ws
nodes:
  - {id: slow, run: "sleep 60", timeout: 1}
  - {id: after, run: "true", needs: [slow]}
---
kind: Workflow
name: broken
workspace: ws
nodes:
  - {id: bad, run: "echo oops >&2; exit 7"}
  - {id: dependent, run: "true", needs: [bad]}
  - {id: independent, run: "sleep 60"}
"""


async def test_graph_semantics(short_tmp):
    cfg = write_config(short_tmp, CONFIG)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout) as sys_:
        ids = {}
        for wf in ("diamond", "flaky", "slow", "broken"):
            ids[wf] = (await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow=wf, title=wf))).id
        t = {wf: await wait_for_state(sys_.stub, tid, {"succeeded", "failed", "cancelled"})
             for wf, tid in ids.items()}

        # Each branch waits for the other to have started: both succeed only when run in parallel.
        assert state_name(t["diamond"]) == "succeeded", t["diamond"].error
        nodes = {n.id: n for n in t["diamond"].nodes}
        assert nodes["join"].started_at_ms >= max(nodes["left"].finished_at_ms, nodes["right"].finished_at_ms)

        assert state_name(t["flaky"]) == "succeeded"
        flaky = t["flaky"].nodes[0]
        assert flaky.attempt == 2 and flaky.output.strip() == "second"
        events = await all_events(sys_.stub, ids["flaky"])
        retry = [payload(e) for e in events if e.type == "node.retry"]
        assert len(retry) == 1 and "code 3" in retry[0]["error"]

        assert state_name(t["slow"]) == "failed"
        slow = {n.id: n for n in t["slow"].nodes}
        assert "timed out after 1s" in slow["slow"].error and slow["after"].state == pb.NODE_STATE_SKIPPED

        assert state_name(t["broken"]) == "failed"
        broken = {n.id: n for n in t["broken"].nodes}
        assert broken["bad"].state == pb.NODE_STATE_FAILED and "code 7" in broken["bad"].error
        assert "oops" in broken["bad"].error
        assert broken["dependent"].state == pb.NODE_STATE_SKIPPED
        assert broken["independent"].state == pb.NODE_STATE_CANCELLED      # stopped when the ticket failed
        assert "node bad failed" in t["broken"].error
