"""R43 in the scheduler: an agent node of a Workflow with `mcp:` opens the
ticket's relay with the grant (also for an agent without a Model), gets
each granted server at the relay with the ticket's capability, never a
token, and every call the relay made, whichever node made it (an agent, a
`run:` command with a capability an agent left behind), becomes one
`mcp.call` event and a run-record entry: names, the arguments' digest,
outcome, sizes, never the arguments or the result. The relay is the real
RelayHub in front of the real MCP server (tests/support/mcptracker.py); the
agent is the test's, speaking MCP to the relay's socket. The ACP runner
gives the servers only to an agent that advertises `mcpCapabilities.http`."""

from __future__ import annotations

import json
import types

import aiohttp
import pytest
from acp.schema import AgentCapabilities, InitializeResponse, McpCapabilities

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services.common.layout import Layout
from services.common.relayenv import RELAY_SOCKET
from services.common.secrecy.env_secrets import SecretValue
from services.common.secrecy.redact import Redactor
from services.credentials.relay.server import RelayHub
from services.scheduler.acp.runner import _Run
from services.scheduler.executor import context as context_mod
from services.scheduler.executor.nodes import agent as agent_mod
from services.scheduler.executor.nodes import run_statement
from services.scheduler.store.base import SUCCEEDED
from tests.credentials.mcptools.test_r43_mcp_relay import Session
from tests.support.mcptracker import tracker

from .fakes import FakeSandbox
from .test_r32_relay_budget import RelayCredentials

pytestmark = pytest.mark.timeout(60)

TOKEN = "canary-sched-mcp-" + "q" * 24

WORKFLOWS = """\
kind: McpServer
name: tracker
url: %(url)s
tokenEnv: R43_SCHED_TOKEN
---
kind: Agent
name: caller
type: acp
command: [caller]
image: afe/sandbox:latest
---
kind: Workflow
name: triage
workspace: ws
mcp:
  tracker: [get_issue]
nodes:
  - {id: first, agent: caller, prompt: "look"}
  - {id: spend, run: "mcp delete_issue", needs: [first]}
"""


async def _calls(layout: Layout, ticket_id: str, cap: str, names: list[str]) -> list[str]:
    sock = layout.relay_dir(ticket_id) / RELAY_SOCKET
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as http:
        s = Session(http, "http://127.0.0.1:7480/mcp/tracker", cap)
        await s.start()
        out = []
        for i, name in enumerate(names):
            _, answer = await s.call(name, {"number": 7}, id_=i + 1)
            out.append("ok" if "result" in answer else "refused")
        return out


class McpSandbox(FakeSandbox):
    """`mcp NAME...`: calls with the capability the agent left behind, from a `run:` command."""

    def __init__(self, layout: Layout, leaked: dict[str, str]) -> None:
        super().__init__()
        self.layout, self.leaked = layout, leaked

    async def exec(self, ticket_id, argv, timeout_ms=0, output_cap_bytes=0, cwd=""):
        command = argv[2]
        if not command.startswith("mcp "):
            async for ev in super().exec(ticket_id, argv, timeout_ms, output_cap_bytes, cwd):
                yield ev
            return
        got = await _calls(self.layout, ticket_id, self.leaked[ticket_id], command.split()[1:])
        yield spb.ExecEvent(stdout=json.dumps(got).encode())
        yield spb.ExecEvent(exit=spb.ExecExit(code=0))


@pytest.mark.slow
async def test_r43_agent_gets_its_servers_at_the_relay_and_every_call_is_an_event_and_in_the_record(
        harness, short_tmp, monkeypatch):
    tmp_path = short_tmp        # the relay's socket path stays under 107 bytes in a parallel run
    with tracker(TOKEN) as srv:
        h = harness(WORKFLOWS % {"url": srv.url})
        layout = Layout(tmp_path / "data", tmp_path / "run")
        layout.ensure()
        hub = RelayHub(h.config, layout, {"R43_SCHED_TOKEN": SecretValue("R43_SCHED_TOKEN", TOKEN)},
                       Redactor([TOKEN]), state_dir=tmp_path / "relaystate")
        leaked: dict[str, str] = {}
        given: list = []
        h.credentials = RelayCredentials(hub)
        h.sandbox = McpSandbox(layout, leaked)

        async def agent(*, ticket_id, node, agent, prompt, sandbox, emit, env, mcp_servers=()) -> str:
            given.append((list(mcp_servers), dict(env)))
            [(_name, _url, cap)] = mcp_servers
            leaked[ticket_id] = cap
            return json.dumps(await _calls(layout, ticket_id, cap, ["get_issue", "delete_issue"]))

        monkeypatch.setattr(agent_mod, "run_agent_node", agent)
        # every look is made twice: a call already recorded is never an event again
        real = context_mod.RunContext.account_relay

        async def twice(self, node_id: str, when: str) -> int:
            n = await real(self, node_id, when)
            await real(self, node_id, when)
            return n

        monkeypatch.setattr(context_mod.RunContext, "account_relay", twice)
        try:
            await h.start()
            tid = h.create("triage")
            t = await h.until(tid, deadline_s=30)
            assert t.state == SUCCEEDED, t.error
            events = h.events(tid)
        finally:
            await h.stop()
            await hub.aclose()
    # the agent (no Model) got the tracker at the relay, with the capability, and no variable for it
    [(servers, env)] = given
    assert servers == [("tracker", "http://127.0.0.1:7480/mcp/tracker", leaked[tid])]
    assert leaked[tid].startswith("afe-relay-") and env == {}
    assert srv.calls == [("get_issue", {"number": 7})]          # delete_issue never ran
    calls = [p for ty, p in events if ty == "mcp.call"]
    assert [(c["node"], c["seq"], c["tool"], c["outcome"]) for c in calls] == [
        ("first", 1, "get_issue", "ok"), ("first", 2, "delete_issue", "refused"),
        ("spend", 3, "delete_issue", "refused")]
    assert TOKEN not in json.dumps(events) and "login page" not in json.dumps(calls)
    in_record = run_statement._mcp_calls(events)
    assert [(c["node"], c["server"], c["tool"], c["outcome"]) for c in in_record] == [
        (c["node"], "tracker", c["tool"], c["outcome"]) for c in calls]
    assert all(set(c) == set(run_statement.MCP_CALL_KEYS) for c in in_record)     # no reason, no text


def test_r43_the_record_names_at_most_its_limit_of_calls_and_counts_the_rest(monkeypatch):
    monkeypatch.setattr(run_statement, "MCP_CALLS_KEPT", 3)
    events = [("mcp.call", {"node": "n", "server": "s", "tool": "t", "outcome": "ok", "seq": i})
              for i in range(5)]
    events.insert(2, ("mcp.call", {"node": "n", "seq": 9, "outcome": "not_recorded", "missed": 4}))
    out = run_statement._mcp_calls(events)
    assert out[1]["outcome"] == "ok" and out[2] == {"outcome": "omitted", "count": 4}
    assert run_statement._mcp_calls(events[:3])[2]["count"] == 4


def _init(http: bool | None) -> InitializeResponse:
    caps = AgentCapabilities(mcp_capabilities=McpCapabilities(http=http)) if http is not None else None
    return InitializeResponse(protocol_version=1, agent_capabilities=caps)


@pytest.mark.parametrize("http", [False, None])
def test_r43_an_agent_without_http_mcp_gets_no_server_and_an_event_says_so(http):
    recorded: list = []
    run = types.SimpleNamespace(mcp_servers=(("tracker", "http://127.0.0.1:7480/mcp/tracker", "afe-relay-x"),),
                                events=types.SimpleNamespace(record=lambda t, p: recorded.append((t, p))))
    assert _Run.mcp_for(run, _init(http)) == []
    assert recorded[0][0] == "agent.mcp_servers" and recorded[0][1]["given"] is False
    # positive control: the same node, to an agent that advertises mcpCapabilities.http
    recorded.clear()
    [server] = _Run.mcp_for(run, _init(True))
    assert server.model_dump(by_alias=True, exclude_none=True) == {
        "type": "http", "name": "tracker", "url": "http://127.0.0.1:7480/mcp/tracker",
        "headers": [{"name": "Authorization", "value": "Bearer afe-relay-x"}]}
    assert recorded == [("agent.mcp_servers", {"servers": ["tracker"], "given": True})]
