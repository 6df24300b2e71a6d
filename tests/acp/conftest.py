"""Fixtures for ACP agent node tests: a real sandbox broker (in-process), a
real sandbox container from the ACP test image, and an event recorder."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

import docker
import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from services.common.config.model import Agent, Node
from services.common.layout import Layout
from services.common.rpc.grpcutil import open_channel
from tests.acp.image import agent_command, ensure_acp_test_image
from tests.support.sandbox_broker import sandbox_broker


@pytest.fixture(scope="session")
def acp_image() -> str:
    return ensure_acp_test_image()


@dataclass
class Events:
    items: list[tuple[str, dict]] = field(default_factory=list)

    async def __call__(self, event_type: str, payload: dict) -> None:
        self.items.append((event_type, payload))

    def of(self, event_type: str) -> list[dict]:
        return [p for t, p in self.items if t == event_type]


@dataclass
class AcpEnv:
    stub: sandbox_pb2_grpc.SandboxBrokerStub
    ticket_id: str
    workspace: Path
    instance: str
    events: Events

    def agent(self, name: str, **kw) -> Agent:
        return Agent(name=name, type="acp", command=agent_command(name), **kw)

    def node(self, **kw) -> Node:
        kw.setdefault("timeout_s", 60.0)
        return Node(id="code", kind="agent", agent="x", **kw)

    async def run(self, name: str, prompt: str = "say hello", **node_kw) -> str:
        from services.scheduler.acp import run_agent_node
        return await run_agent_node(ticket_id=self.ticket_id, node=self.node(**node_kw), agent=self.agent(name),
                                    prompt=prompt, sandbox=self.stub, emit=self.events)

    async def processes(self) -> list[str]:
        """Command lines of the processes running in the sandbox (except ps itself)."""
        out = b""
        async for ev in self.stub.Exec(sandbox_pb2.ExecRequest(ticket_id=self.ticket_id,
                                                              argv=["ps", "-eo", "args="])):
            if ev.WhichOneof("event") == "stdout":
                out += ev.stdout
        return [ln for ln in out.decode().splitlines() if ln and not ln.startswith("ps ")]

    def containers(self) -> list:
        client = docker.from_env()
        try:
            return client.containers.list(all=True, filters={"label": f"afe.instance={self.instance}"})
        finally:
            client.close()


@pytest.fixture
async def acp_env(short_tmp, acp_image):
    """A real broker and a running sandbox (image: the ACP test image) for one ticket."""
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with sandbox_broker(layout) as (sock, secret, instance):
        channel = open_channel(sock, secret)
        stub = sandbox_pb2_grpc.SandboxBrokerStub(channel)
        ticket = f"acp-{secrets.token_hex(4)}"
        layout.workspace(ticket).mkdir(parents=True)
        await stub.CreateSandbox(sandbox_pb2.CreateSandboxRequest(
            ticket_id=ticket, spec=sandbox_pb2.SandboxSpec(image=acp_image)))
        env = AcpEnv(stub, ticket, layout.workspace(ticket), instance, Events())
        try:
            yield env
        finally:
            await stub.DestroySandbox(sandbox_pb2.DestroySandboxRequest(ticket_id=ticket))
            await channel.close()
