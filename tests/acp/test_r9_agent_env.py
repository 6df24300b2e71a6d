"""R9: the agent process receives exactly the env NAMES its Agent declares,
with values the sandbox broker holds; nothing else it runs (terminals) gets
them, and the value never reaches an event or the node output."""

from __future__ import annotations

import hashlib
import json
import secrets

import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from services.common.layout import Layout
from services.common.rpc.grpcutil import open_channel
from tests.acp.conftest import AcpEnv, Events
from tests.support.sandbox_broker import sandbox_broker

pytestmark = pytest.mark.timeout(120)

KEY_VALUE = "acp-test-" + secrets.token_hex(16)


@pytest.fixture
async def env_with_key(short_tmp, acp_image):
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with sandbox_broker(layout, env_values={"ACP_TEST_KEY": KEY_VALUE, "OTHER_KEY": "other-" + KEY_VALUE}) \
            as (sock, secret, instance):
        channel = open_channel(sock, secret)
        stub = sandbox_pb2_grpc.SandboxBrokerStub(channel)
        ticket = f"acp-{secrets.token_hex(4)}"
        layout.workspace(ticket).mkdir(parents=True)
        await stub.CreateSandbox(sandbox_pb2.CreateSandboxRequest(ticket_id=ticket, spec=sandbox_pb2.SandboxSpec(
            image=acp_image, env_names=["ACP_TEST_KEY", "OTHER_KEY"])))
        try:
            yield AcpEnv(stub, ticket, layout.workspace(ticket), instance, Events())
        finally:
            await stub.DestroySandbox(sandbox_pb2.DestroySandboxRequest(ticket_id=ticket))
            await channel.close()


async def run_good(env: AcpEnv, declared: tuple[str, ...]) -> dict:
    from services.scheduler.acp import run_agent_node
    out = await run_agent_node(ticket_id=env.ticket_id, node=env.node(), prompt="env",
                               agent=env.agent("good", env=declared), sandbox=env.stub, emit=env.events)
    assert KEY_VALUE not in out
    assert KEY_VALUE not in json.dumps(env.events.items)
    return json.loads(out.split("REPORT ", 1)[1])


async def test_r9_declared_name_reaches_the_agent_and_only_the_agent(env_with_key):
    rep = await run_good(env_with_key, ("ACP_TEST_KEY",))
    assert rep["key_sha256"] == hashlib.sha256(KEY_VALUE.encode()).hexdigest()
    assert "OTHER_KEY" not in rep["env_names"]          # declared for the sandbox, not by this agent
    # Terminals the agent starts run without it.
    assert "key=\n" in rep["terminal"]["output"]


async def test_r9_undeclared_name_does_not_reach_the_agent(env_with_key):
    rep = await run_good(env_with_key, ())
    assert rep["key_sha256"] is None
    assert "ACP_TEST_KEY" not in rep["env_names"] and "OTHER_KEY" not in rep["env_names"]
