"""R32 end to end: the real scheduler runs an `agent:` node whose Agent names
a Model; the ACP agent, inside a `--network none` sandbox, calls the model
through the ticket's relay with the placeholder the scheduler put in its
environment. The fake model sees the real key; the usage becomes
`model.usage` events and counts against the workflow's budget, also what a
`run:` command spends with the capability the first agent left in the
workspace (a later agent does not get it back); the relay is closed when
the ticket ends."""

from __future__ import annotations

import json
import secrets

import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.layout import Layout
from services.common.relayenv import RELAY_SOCKET
from tests.acp.image import IMAGE, agent_command
from tests.acp.test_workflow_end_to_end import events_of, wait_done
from tests.support.fakes.streaming import IN_TOKENS, OUT_TOKENS, FakeModelAPI
from tests.support.system import afe_system

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

KEY = "sk-ant-" + secrets.token_hex(24)

CONFIG = """\
kind: Model
name: claude
provider: anthropic
model: claude-pinned
baseUrl: %(url)s
apiKeyEnv: R32_E2E_KEY
---
kind: Agent
name: caller
type: acp
command: %(command)s
image: %(image)s
model: claude
---
kind: Workflow
name: call-twice
workspace: ws
maxTokens: %(budget)d
nodes:
  - {id: first, agent: caller, prompt: "call leak"}
  - {id: spend, run: %(spend)s, needs: [first]}
  - {id: second, agent: caller, prompt: "call call", needs: [spend]}
---
kind: Workspace
name: ws
repo: repos/calc.git
baseBranch: main
forge: {type: local}
"""


async def test_r32_agent_node_reaches_its_model_only_through_the_relay(short_tmp, acp_image):
    from services.common.demo import make_repo
    async with FakeModelAPI(KEY) as upstream:
        cfg = short_tmp / "cfg"
        cfg.mkdir()
        make_repo(cfg / "repos" / "calc.git")
        # Budget: room for the first node's call, the run: node's call with the capability the first
        # agent left behind, and the second node's first call; not its second.
        budget = 3 * (IN_TOKENS + OUT_TOKENS)
        (cfg / "afe.yaml").write_text(CONFIG % {"url": upstream.url, "image": IMAGE, "budget": budget,
                                                "command": json.dumps(list(agent_command("modelcaller"))),
                                                "spend": json.dumps(" ".join([*agent_command("modelcaller"),
                                                                              "--spend"]))})
        layout = Layout(short_tmp / "data", short_tmp / "run")
        async with afe_system(cfg, layout, broker_secrets={"R32_E2E_KEY": KEY}) as sys_:
            t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="call-twice", title="x",
                                                                    principal="tester"))
            t = await wait_done(sys_.stub, t.id)
            events = await events_of(sys_.stub, t.id)
            assert t.state == pb.TICKET_STATE_SUCCEEDED, (t.error, events[-5:])
            reports = [json.loads(p["text"].split("REPORT ", 1)[1]) for ty, p in events
                       if ty == "agent.message" and "REPORT " in p.get("text", "")]
            first, second = reports
            assert [c[0] for c in first["calls"]] == [200]
            assert "piece3" in first["calls"][0][1]
            # the run: node's call was served (the capability works from any process of the sandbox) ...
            spent = [p["text"] for ty, p in events if ty == "node.output" and p.get("node") == "spend"]
            assert json.loads("".join(spent).split("SPENT ", 1)[1])[0] == 200
            # ... and counted: the second call of the second node is over the workflow's budget
            assert [c[0] for c in second["calls"]] == [200, 400]
            assert "token budget" in second["calls"][1][1]
            assert "ANTHROPIC_BASE_URL" in first["env_names"] and "ANTHROPIC_API_KEY" in first["env_names"]
            # the model saw the real key, and only the three allowed calls
            assert [s.headers.get("x-api-key") for s in upstream.seen] == [KEY, KEY, KEY]
            assert all("afe-relay-" not in repr(s.headers) for s in upstream.seen)
            # usage: one event per node that spent, and the ticket's count
            usage = [p for ty, p in events if ty == "model.usage"]
            assert [(u["node"], u["input_tokens"], u["output_tokens"]) for u in usage] == [
                ("first", IN_TOKENS, OUT_TOKENS), ("spend", IN_TOKENS, OUT_TOKENS), ("second", IN_TOKENS, OUT_TOKENS)]
            assert t.tokens_used == 3 * (IN_TOKENS + OUT_TOKENS)
            assert KEY not in json.dumps(events)
            # the ticket ended: its relay socket is gone
            assert not (layout.relay_dir(t.id) / RELAY_SOCKET).exists()
