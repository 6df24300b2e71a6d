"""R32 budget: every token the ticket's model relay serves is the ticket's,
whichever node made the call. A hostile `run:` command that reuses the
capability an agent left behind spends tokens through the relay after the
agent node ended; they are counted (a `model.usage` event of that node, the
ticket's tokens) and a later agent node does not get them back as budget.

The real Engine and executor and the real RelayHub (credential broker side,
on a real Unix socket, in front of a fake Anthropic API); the sandbox and
the agent are in-process stand-ins that call the relay's socket the way the
sandbox's forwarder would. Positive control: the accounting of before
(usage read only around agent nodes) lets the second agent spend past the
Workflow's maxTokens."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import aiohttp
import pytest

from services._gen.afe.credentials.v1 import credentials_pb2 as cpb
from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services.common.layout import Layout
from services.common.relayenv import RELAY_SOCKET
from services.common.secrecy.env_secrets import SecretValue
from services.common.secrecy.redact import Redactor
from services.credentials.relay.server import RelayHub
from services.scheduler.executor import context as context_mod
from services.scheduler.executor.nodes import agent as agent_mod
from services.scheduler.store.base import FAILED, SUCCEEDED
from tests.support.fakes.streaming import IN_TOKENS, OUT_TOKENS, FakeModelAPI

from .fakes import FakeCredentials, FakeSandbox

pytestmark = pytest.mark.timeout(30)

KEY = "sk-ant-budget-" + "k" * 32
CALL = IN_TOKENS + OUT_TOKENS          # what one call through the relay costs

WORKFLOWS = """\
kind: Model
name: claude
provider: anthropic
model: claude-pinned
baseUrl: %(url)s
apiKeyEnv: R32_BUDGET_KEY
---
kind: Agent
name: caller
type: acp
command: [caller]
image: afe/sandbox:latest
model: claude
---
kind: Workflow
name: spend
workspace: ws
maxTokens: %(budget)d
nodes:
  - {id: first, agent: caller, prompt: "call"}
  - {id: spend, run: "relay 2", needs: [first]}
  - {id: second, agent: caller, prompt: "call call", needs: [spend]}
"""


async def _call(layout: Layout, ticket_id: str, capability: str) -> int:
    """One Anthropic Messages call on the ticket's relay socket, as through the sandbox's forwarder."""
    sock = layout.relay_dir(ticket_id) / RELAY_SOCKET
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as s, s.post(
            "http://127.0.0.1:7480/m/claude/v1/messages",
            headers={"x-api-key": capability, "anthropic-version": "2023-06-01"},
            json={"model": "any", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}) as r:
        await r.read()
        return r.status


class RelayCredentials(FakeCredentials):
    """The fake forge, with the relay calls served by a real RelayHub."""

    def __init__(self, hub: RelayHub) -> None:
        super().__init__()
        self.hub = hub

    async def open_relay(self, ticket_id: str, models: list[str], budget_tokens: int,
                         mcp: Mapping[str, Sequence[str]] | None = None) -> cpb.OpenRelayResponse:
        self._call("open_relay")
        return cpb.OpenRelayResponse(capability=await self.hub.open(ticket_id, models, budget_tokens, mcp))

    async def relay_usage(self, ticket_id: str, mcp_calls_from: int = 0) -> cpb.RelayUsageResponse:
        self._call("relay_usage")
        usage, budget, is_open = self.hub.usage(ticket_id)
        calls, total = self.hub.mcp_calls(ticket_id, mcp_calls_from)
        return cpb.RelayUsageResponse(
            models=[cpb.ModelUsage(model=k, input_tokens=u.input_tokens, output_tokens=u.output_tokens,
                                   requests=u.requests, refused=u.refused) for k, u in sorted(usage.items())],
            total_tokens=sum(u.total for u in usage.values()), budget_tokens=budget, open=is_open,
            mcp_calls=[cpb.RelayMcpCall(**c) for c in calls], mcp_calls_total=total)

    async def release(self, ticket_id: str, workspace: str) -> None:
        self._call("release")
        await self.hub.close(ticket_id)


class LeakySandbox(FakeSandbox):
    """`relay N`: N model calls with the capability the agent left in the workspace."""

    def __init__(self, layout: Layout, leaked: dict[str, str]) -> None:
        super().__init__()
        self.layout = layout
        self.leaked = leaked

    async def exec(self, ticket_id, argv, timeout_ms=0, output_cap_bytes=0, cwd=""):
        command = argv[2]
        if not command.startswith("relay "):
            async for ev in super().exec(ticket_id, argv, timeout_ms, output_cap_bytes, cwd):
                yield ev
            return
        codes = [await _call(self.layout, ticket_id, self.leaked[ticket_id]) for _ in range(int(command.split()[1]))]
        yield spb.ExecEvent(stdout=json.dumps(codes).encode())
        yield spb.ExecEvent(exit=spb.ExecExit(code=0))


async def _run(harness, tmp_path, monkeypatch, *, old_accounting: bool) -> tuple[list, dict]:
    async with FakeModelAPI(KEY) as upstream:
        h = harness(WORKFLOWS % {"url": upstream.url, "budget": 4 * CALL})
        layout = Layout(tmp_path / "data", tmp_path / "run")
        layout.ensure()
        hub = RelayHub(h.config, layout, {"R32_BUDGET_KEY": SecretValue("R32_BUDGET_KEY", KEY)}, Redactor([KEY]),
                       state_dir=tmp_path / "relaystate")
        leaked: dict[str, str] = {}
        h.credentials = RelayCredentials(hub)
        h.sandbox = LeakySandbox(layout, leaked)

        async def agent(*, ticket_id, node, agent, prompt, sandbox, emit, env, mcp_servers=()) -> str:
            leaked[ticket_id] = env["ANTHROPIC_API_KEY"]      # e.g. written into /workspace
            return json.dumps([await _call(layout, ticket_id, env["ANTHROPIC_API_KEY"])
                               for word in prompt.split() if word == "call"])

        monkeypatch.setattr(agent_mod, "run_agent_node", agent)
        if old_accounting:
            # The accounting before this fix: the relay's usage read only around agent nodes, so
            # what it served between them was skipped (never counted, given back as budget).
            real = context_mod.RunContext.account_relay

            async def around_agents_only(self, node_id: str, when: str) -> int:
                node = next((n for n in self.workflow.nodes if n.id == node_id), None)
                if when == "after" and node is not None and node.agent:
                    return await real(self, node_id, when)
                usage = await self.credentials.relay_usage(self.ticket.id)
                if self._relay_cap:
                    self._counted().update({m.model: (m.input_tokens, m.output_tokens) for m in usage.models})
                return 0

            monkeypatch.setattr(context_mod.RunContext, "account_relay", around_agents_only)
        try:
            await h.start()
            tid = h.create("spend")
            t = await h.until(tid, deadline_s=20)
            nodes = h.nodes(tid)
            usage = [(p["node"], p["input_tokens"] + p["output_tokens"], p.get("counted"))
                     for _, p in h.events(tid, "model.usage")]
            served = sum(1 for s in upstream.seen if s.path == "/v1/messages")
            return usage, {"state": t.state, "tokens": t.tokens_used, "served": served * CALL,
                           "first": nodes["first"].output, "spend": nodes["spend"].output,
                           "second": nodes["second"].output}
        finally:
            await h.stop()
            await hub.aclose()


async def test_r32_relay_counts_tokens_a_run_node_spends_and_a_later_agent_does_not_get_them_back(
        harness, short_tmp, monkeypatch):
    usage, run = await _run(harness, short_tmp, monkeypatch, old_accounting=False)
    assert run["state"] == SUCCEEDED
    # The run: node's calls after the agent node ended were served (the attack reaches the model) ...
    assert json.loads(run["first"]) == [200] and json.loads(run["spend"]) == [200, 200]
    # ... and counted: a model.usage event of that node, and the ticket's tokens.
    assert usage == [("first", CALL, "after"), ("spend", 2 * CALL, "after"), ("second", CALL, "after")]
    # So the second agent has one call left of the Workflow's maxTokens (4 calls), not three.
    assert json.loads(run["second"]) == [200, 400]
    assert run["tokens"] == run["served"] == 4 * CALL


async def test_r32_relay_budget_positive_control_old_accounting_gives_the_tokens_back(
        harness, short_tmp, monkeypatch):
    usage, run = await _run(harness, short_tmp, monkeypatch, old_accounting=True)
    assert run["state"] in (SUCCEEDED, FAILED)
    assert json.loads(run["spend"]) == [200, 200]
    assert [u[0] for u in usage] == ["first", "second"]          # the run node's tokens: never counted
    assert json.loads(run["second"]) == [200, 200]               # and given back to the second agent
    assert run["served"] == 5 * CALL > 4 * CALL                   # past the Workflow's maxTokens
    assert run["tokens"] == 3 * CALL < run["served"]
