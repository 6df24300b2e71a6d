"""Model budgets: a replay model that never stops calling tools is stopped
at `max_turns`; token budgets per node and per ticket stop it too. The
reason is in the events and in the node's error."""

from __future__ import annotations

import asyncio

import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.layout import Layout
from tests.scheduler.conftest import all_events, payload, state_name, wait_for_state, write_config
from tests.support.system import afe_system

pytestmark = [pytest.mark.docker, pytest.mark.timeout(240)]

LOOPING_SCRIPT = """\
loop: true
responses:
  - content: "Let me look again."
    tool_calls:
      - {name: list_dir, arguments: {path: "."}}
    usage: {input_tokens: 20, output_tokens: 10}
"""

DONE_SCRIPT = """\
responses:
  - content: "Done."
    usage: {input_tokens: 50, output_tokens: 10}
"""

CONFIG = """\
kind: Model
name: finisher
provider: replay
script: done.yaml
---
kind: Model
name: looper
provider: replay
script: looper.yaml
---
kind: Workflow
name: turns
workspace: ws
nodes:
  - {id: think, model: looper, prompt: "Fix {{ticket.title}}", tools: [list_dir], max_turns: 3}
---
kind: Workflow
name: node-tokens
workspace: ws
nodes:
  - {id: think, model: looper, prompt: "Fix it", tools: [list_dir], max_turns: 50, max_tokens: 70}
---
kind: Workflow
name: ticket-tokens
workspace: ws
maxTokens: 100
nodes:
  - {id: a, model: finisher, prompt: "Plan it", tools: []}
  - {id: b, model: looper, prompt: "Fix it", tools: [list_dir], max_turns: 50, needs: [a], retries: 2}
"""


async def test_looping_model_stops_at_limits_with_reason(short_tmp):
    cfg = write_config(short_tmp, CONFIG, files={"looper.yaml": LOOPING_SCRIPT, "done.yaml": DONE_SCRIPT})
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout) as sys_:
        ids = {}
        for wf in ("turns", "node-tokens", "ticket-tokens"):
            t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow=wf, title=wf))
            ids[wf] = t.id
        done = await asyncio.gather(*(wait_for_state(sys_.stub, tid, {"succeeded", "failed"})
                                      for tid in ids.values()))
        assert all(state_name(t) == "failed" for t in done)

        async def stops(wf: str) -> tuple[list, list]:
            events = await all_events(sys_.stub, ids[wf])
            return ([payload(e) for e in events if e.type == "node.budget_exceeded"],
                    [payload(e) for e in events if e.type == "node.message"])

        budget, messages = await stops("turns")
        assert [b["limit"] for b in budget] == ["max_turns"] and "max_turns (3)" in budget[0]["reason"]
        assert len(messages) == 3
        t = await sys_.stub.GetTicket(pb.GetTicketRequest(id=ids["turns"]))
        assert "max_turns (3)" in t.nodes[0].error and "max_turns" in t.error

        budget, messages = await stops("node-tokens")          # 30 tokens a turn: over 70 at turn 3
        assert [b["limit"] for b in budget] == ["node_tokens"] and len(messages) == 3
        assert "token budget (70)" in budget[0]["reason"]

        budget, messages = await stops("ticket-tokens")         # a: 60, b: 90 then 120 > 100
        assert [b["limit"] for b in budget] == ["ticket_tokens"] and len(messages) == 3
        assert "ticket's token budget (100)" in budget[0]["reason"]
        t = await sys_.stub.GetTicket(pb.GetTicketRequest(id=ids["ticket-tokens"]))
        assert [n.state for n in t.nodes] == [pb.NODE_STATE_SUCCEEDED, pb.NODE_STATE_FAILED]
        assert t.nodes[1].attempt == 1          # a spent budget is not retried
