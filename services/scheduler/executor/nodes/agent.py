"""An `agent` node: an ACP agent inside the ticket's sandbox (acp/runner.py).

An agent with a Model reaches it through the ticket's model relay (R32):
the relay opens with the node's budget before the agent starts (what the
relay counted for the ticket so far, whichever node made the calls, is the
ticket's first), the agent's environment carries the relay's base URL and
capability, and what the relay counted is recorded as `model.usage` events
afterwards, whatever the outcome. The remote MCP servers the Workflow
grants reach the agent the same way (R43): `session/new` names each at the
relay with the ticket's capability, and the calls the relay made become
`mcp.call` events.
"""

from __future__ import annotations

import asyncio
from typing import Any

from services.common.config.model import Node
from services.common.errors import FailedPrecondition

from ...sandboxes.spec import relay_mcp
from ..context import RunContext

try:
    from ...acp.runner import run_agent_node
except ImportError:       # the `acp` package is missing: every other node kind still runs
    run_agent_node = None  # type: ignore[assignment]


async def agent_node(ctx: RunContext, node: Node) -> str:
    if run_agent_node is None:
        raise FailedPrecondition("ACP support not installed: this afe cannot run `agent` nodes")
    await ctx.ensure_sandbox()
    agent = ctx.config.agents[node.agent or ""]

    attempt = ctx.attempts.get(node.id, 0)    # the agent's events say which attempt they belong to

    async def emit(type_: str, payload: dict[str, Any]) -> None:
        ctx.emit(type_, {"node": node.id, "attempt": attempt, **payload})

    if agent.model or relay_mcp(ctx.config, ctx.workflow, node.id):
        await ctx.open_relay(node)
    try:
        return await run_agent_node(ticket_id=ctx.ticket.id, node=node, agent=agent,
                                    prompt=ctx.prompt(node), sandbox=ctx.sandbox.stub_for(ctx.ticket.id),
                                    emit=emit, env=ctx.agent_env(agent), mcp_servers=ctx.agent_mcp_servers(node))
    finally:
        await asyncio.shield(ctx.settle_relay(node))
