"""Agents that misbehave: silent, crashing, flooding, speaking garbage. The
node fails with a clear reason, never hangs, and no agent process is left
in the sandbox."""

from __future__ import annotations

import asyncio

import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2
from services.common.errors import DeadlineExceeded, FailedPrecondition, ResourceExhausted, Unavailable
from services.scheduler.acp.events import MAX_EVENTS
from services.scheduler.acp.stderr import MAX_STDERR
from services.scheduler.acp.transport import MAX_MESSAGE_BYTES

pytestmark = pytest.mark.timeout(120)


async def agent_processes(env) -> list[str]:
    return [p for p in await env.processes() if "/opt/acp/agents/" in p]


async def test_silent_agent_times_out_is_cancelled_then_killed(acp_env):
    # 10 s: the agent's start and initialize fit in it on a busy machine (parallel test workers)
    with pytest.raises(DeadlineExceeded, match=r"did not finish within the node timeout of 10s \(during session/prompt\)"):
        await acp_env.run("silent", timeout_s=10)
    # session/cancel reached the agent before the kill.
    assert (acp_env.workspace / ".cancel-received").read_text() == "sess-1"
    assert acp_env.events.of("agent.cancel") == [{"sent": "session/cancel"}]
    assert any("node timeout" in e["reason"] for e in acp_env.events.of("agent.protocol_error"))
    assert await agent_processes(acp_env) == []


async def test_engine_cancellation_sends_session_cancel_kills_and_reraises(acp_env):
    task = asyncio.create_task(acp_env.run("silent", timeout_s=300))
    while not acp_env.events.of("agent.message"):     # the agent is inside its prompt turn
        assert not task.done(), task
        await asyncio.sleep(0.05)
    assert await agent_processes(acp_env), "control: the agent runs while the turn is open"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (acp_env.workspace / ".cancel-received").exists()
    assert await agent_processes(acp_env) == []


async def test_crashing_agent_fails_the_node_as_unavailable(acp_env):
    with pytest.raises(Unavailable, match=r"exited with code 3 during session/prompt"):
        await acp_env.run("crash")
    assert acp_env.events.of("agent.message") == [{"text": "about to crash"}]
    assert await agent_processes(acp_env) == []


async def test_missing_agent_command_fails_clearly(acp_env):
    agent = acp_env.agent("good")
    from dataclasses import replace

    from services.scheduler.acp import run_agent_node
    with pytest.raises(Unavailable, match=r"exited with code 12[67] during initialize"):
        await run_agent_node(ticket_id=acp_env.ticket_id, node=acp_env.node(),
                             agent=replace(agent, command=("/no/such/agent",)), prompt="x",
                             sandbox=acp_env.stub, emit=acp_env.events)


async def test_flooding_agent_is_capped_and_stopped(acp_env):
    with pytest.raises(ResourceExhausted, match=rf"JSON-RPC message longer than {MAX_MESSAGE_BYTES} bytes"):
        await acp_env.run("flood")
    ev = acp_env.events.items
    # 1500 tool calls were sent; at most MAX_EVENTS are recorded, plus the notices.
    assert len(acp_env.events.of("agent.tool_call")) <= MAX_EVENTS
    reasons = [e["reason"] for e in acp_env.events.of("agent.protocol_error")]
    assert any("event limit" in r for r in reasons)
    assert len([t for t, _ in ev if t != "agent.stderr"]) <= MAX_EVENTS + 5
    # 4 MiB of stderr: the first bytes and the last, at most MAX_STDERR, then a note of what was left out.
    stderr = acp_env.events.of("agent.stderr")
    shown = sum(len(e["text"].encode()) for e in stderr)
    assert shown <= MAX_STDERR and len(stderr) <= 20
    assert stderr[-1]["omitted_bytes"] == 64 * 65537 - shown
    assert all("omitted_bytes" not in e for e in stderr[:-1])
    assert await agent_processes(acp_env) == []


async def test_garbage_speaking_agent_fails_with_a_protocol_error(acp_env):
    with pytest.raises(FailedPrecondition, match=r"broke the ACP protocol"):
        await acp_env.run("garbage")
    reasons = [e["reason"] for e in acp_env.events.of("agent.protocol_error")]
    assert reasons[:3] == ["line is not valid JSON", "message is not a JSON object",
                           "message id must be a number, a string or null"]
    assert await agent_processes(acp_env) == []


async def test_failed_node_leaves_a_sandbox_that_destroy_removes(acp_env):
    with pytest.raises(Unavailable):
        await acp_env.run("crash")
    assert acp_env.containers(), "control: the ticket's sandbox exists before destroy"
    await acp_env.stub.DestroySandbox(sandbox_pb2.DestroySandboxRequest(ticket_id=acp_env.ticket_id))
    assert acp_env.containers() == []


async def test_request_swarm_is_capped_and_its_terminal_killed(acp_env):
    with pytest.raises(ResourceExhausted, match=r"more than 64 requests waiting for an answer"):
        await acp_env.run("swarm")
    creates = [e for e in acp_env.events.of("agent.terminal") if e["op"] == "create"]
    assert [e["command"] for e in creates] == ["sleep 600"]        # control: the long command did start
    left = await acp_env.processes()
    assert not [p for p in left if "/opt/acp/agents/" in p or p.startswith("sleep 600")], left


async def test_reply_outside_the_acp_schema_fails_the_node(acp_env):
    with pytest.raises(FailedPrecondition, match=r"reply to session/prompt that does not follow the ACP schema"):
        await acp_env.run("badreply")
    assert await agent_processes(acp_env) == []


async def test_agent_that_stops_reading_its_stdin_is_stopped(acp_env):
    with pytest.raises(ResourceExhausted, match=r"bytes of its stdin unread"):
        await acp_env.run("deaf", timeout_s=90)
    reads = [e for e in acp_env.events.of("agent.fs") if e["op"] == "read" and e["ok"]]
    assert len(reads) > 20                                        # control: the answers were produced
    assert await agent_processes(acp_env) == []
