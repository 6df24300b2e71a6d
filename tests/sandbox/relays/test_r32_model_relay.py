"""R32: a model key never enters a sandbox. An agent-like program inside a
real sandbox (`--network none`) reaches a model through the ticket's relay:
the real credential broker relay on a real Unix socket, mounted read-only
by the real sandbox broker, and its forwarder on the sandbox's loopback.
The fake model server sees the real key and never the capability; the key
is nowhere in the container (docker inspect, /proc/*/environ); each refusal
is a clear error and never reaches the model."""

from __future__ import annotations

import asyncio
import json
import secrets

import docker
import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services._gen.afe.sandbox.v1 import sandbox_pb2_grpc
from services.common.config.model import Config, Model
from services.common.layout import Layout
from services.common.relayenv import RELAY_MOUNT, relay_base_url, relay_env
from services.common.rpc.grpcutil import open_channel
from services.common.secrecy.env_secrets import SecretValue
from services.common.secrecy.redact import Redactor
from services.credentials.relay.server import RelayHub
from tests.support.fakes.streaming import IN_TOKENS, OUT_TOKENS, FakeModelAPI
from tests.support.sandbox_broker import sandbox_broker

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]

KEY = "sk-ant-" + secrets.token_hex(24)
KEY_ENV = "R32_TEST_KEY"

# The agent: calls each case's URL with its headers, prints one JSON line per case.
AGENT = r"""
import json, os, sys, urllib.request, urllib.error
out = []
for case in json.loads(sys.argv[1]):
    url = case["url"].replace("$BASE", os.environ.get("ANTHROPIC_BASE_URL", ""))
    headers = {k: v.replace("$CAP", os.environ.get("ANTHROPIC_API_KEY", "")) for k, v in case["headers"].items()}
    req = urllib.request.Request(url, data=json.dumps(case["body"]).encode(), method="POST",
                                 headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=15) as r:
            out.append([r.status, r.read().decode()])
    except urllib.error.HTTPError as e:
        out.append([e.code, e.read().decode()])
    except Exception as e:
        out.append([-1, type(e).__name__ + ": " + str(e)])
print(json.dumps(out), flush=True)
if case.get("wait"):
    sys.stdin.read()
"""

BODY = {"model": "whatever", "max_tokens": 16, "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def case(url: str = "$BASE/v1/messages", cap: str = "$CAP", wait: bool = False) -> dict:
    headers = {"anthropic-version": "2023-06-01"}
    if cap:
        headers["x-api-key"] = cap
    return {"url": url, "headers": headers, "body": BODY, "wait": wait}


class Env:
    def __init__(self, stub, ticket, hub, upstream, cap, layout, instance):
        self.stub, self.ticket, self.hub, self.upstream, self.cap = stub, ticket, hub, upstream, cap
        self.layout, self.instance = layout, instance

    def agent_env(self, cap: str | None = None) -> list[str]:
        m = self.hub.config.models["claude"]
        env = relay_env((), provider=m.provider, model_name=m.name, model_id=m.model, capability=cap or self.cap)
        return [f"{k}={v}" for k, v in env.items()]

    async def agent(self, cases: list[dict], *, release: asyncio.Event | None = None,
                    started: asyncio.Event | None = None) -> list:
        async def inputs():
            yield pb.ProcessInput(start=pb.ProcessStart(ticket_id=self.ticket, argv=["python3", "-c", AGENT,
                                                                                      json.dumps(cases)],
                                                        env=self.agent_env()))
            if release is not None:
                await release.wait()
            yield pb.ProcessInput(close_stdin=True)
        out, code = [], None
        async for o in self.stub.Process(inputs()):
            kind = o.WhichOneof("output")
            if kind == "stdout":
                out.append(o.stdout)
                if started is not None and b"\n" in o.stdout:
                    started.set()
            elif kind == "exit":
                code = o.exit.code
        assert code == 0, b"".join(out)
        return json.loads(b"".join(out).decode().strip().splitlines()[-1])

    async def sh(self, cmd: str) -> tuple[int, str]:
        out, code = [], None
        async for ev in self.stub.Exec(pb.ExecRequest(ticket_id=self.ticket, argv=["sh", "-c", cmd],
                                                      timeout_ms=30000)):
            kind = ev.WhichOneof("event")
            if kind in ("stdout", "stderr"):
                out.append(getattr(ev, kind))
            else:
                code = ev.exit.code
        return code or 0, b"".join(out).decode("utf-8", "replace")


@pytest.fixture
async def relay(short_tmp):
    layout = Layout(short_tmp / "data", short_tmp / "run")
    layout.ensure()
    async with FakeModelAPI(KEY) as upstream:
        models = {"claude": Model("claude", "anthropic", model="claude-pinned", base_url=upstream.url,
                                  api_key_env=KEY_ENV),
                  "other": Model("other", "anthropic", model="other", base_url=upstream.url, api_key_env=KEY_ENV)}
        hub = RelayHub(Config(directory=short_tmp, models=models), layout, {KEY_ENV: SecretValue(KEY_ENV, KEY)},
                       Redactor([KEY]), state_dir=short_tmp / "relay-state")
        ticket = f"r32-{secrets.token_hex(4)}"
        cap = await hub.open(ticket, ["claude"], 0)
        async with sandbox_broker(layout) as (sock, secret, instance):
            channel = open_channel(sock, secret)
            stub = sandbox_pb2_grpc.SandboxBrokerStub(channel)
            layout.workspace(ticket).mkdir(parents=True)
            await stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec(relay=True)))
            try:
                yield Env(stub, ticket, hub, upstream, cap, layout, instance)
            finally:
                await stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))
                await channel.close()
                await hub.aclose()


async def test_r32_agent_in_sandbox_streams_through_relay_and_refusals_are_clear(relay):
    other_cap = await relay.hub.open("r32-elsewhere", ["claude"], 0)
    port = relay.upstream.port
    results = await relay.agent([
        case(),                                                   # 0 positive control
        case(cap=""),                                             # 1 no capability
        case(cap=other_cap),                                      # 2 another ticket's capability
        case(url=relay_base_url("other") + "/v1/messages"),      # 3 a Model the workflow did not declare
        case(url=f"http://127.0.0.1:{port}/v1/messages", cap=KEY),       # 4 straight to the model (even with the key)
        case(url=f"http://172.17.0.1:{port}/v1/messages", cap=KEY),      # 5 the host's bridge address
    ])
    status = [r[0] for r in results]
    assert status[0] == 200 and "piece3" in results[0][1] and "message_stop" in results[0][1]
    assert status[1] == 401 and "no capability" in results[1][1]
    assert status[2] == 401 and "not this ticket's" in results[2][1]
    assert status[3] == 403 and "not declared" in results[3][1]
    assert status[4] == -1 and status[5] == -1, results[4:]     # --network none: nothing but its own loopback
    # Only the positive control reached the model, with the real key and without the capability.
    assert len(relay.upstream.seen) == 1
    seen = relay.upstream.seen[0]
    assert seen.headers["x-api-key"] == KEY
    assert relay.cap not in repr(seen.headers) and relay.cap.encode() not in seen.body
    assert json.loads(seen.body)["model"] == "claude-pinned"
    usage, _, _ = relay.hub.usage(relay.ticket)
    assert (usage["claude"].input_tokens, usage["claude"].output_tokens) == (IN_TOKENS, OUT_TOKENS)

    # Budget: spent after that answer -> refused with the budget's message.
    await relay.hub.open(relay.ticket, ["claude"], IN_TOKENS + OUT_TOKENS)
    (budget,) = await relay.agent([case()])
    assert budget[0] == 400 and "token budget" in budget[1]

    # Ended ticket: the relay is closed; the same agent gets nothing through.
    await relay.hub.close(relay.ticket)
    (ended,) = await relay.agent([case()])
    assert ended[0] != 200
    assert len(relay.upstream.seen) == 1


async def test_r32_no_key_in_the_container(relay):
    release, started = asyncio.Event(), asyncio.Event()
    agent = asyncio.ensure_future(relay.agent([case(wait=True)], release=release, started=started))
    try:
        await asyncio.wait_for(started.wait(), 60)     # the agent made its call and is still running
        # every process's environment in the sandbox, as the sandbox user sees it
        code, environs = await relay.sh("for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < $f; echo; done")
        assert code == 0
        assert f"ANTHROPIC_API_KEY={relay.cap}" in environs    # positive control: the agent's env is read
        assert KEY not in environs
        code, mounts = await relay.sh(f"touch {RELAY_MOUNT}/x 2>&1; test -S {RELAY_MOUNT}/relay.sock && echo SOCKET")
        assert "Read-only file system" in mounts and "SOCKET" in mounts
    finally:
        release.set()
        (result,) = await agent
    assert result[0] == 200
    client = docker.from_env()
    try:
        c = client.containers.list(filters={"label": [f"afe.ticket={relay.ticket}",
                                                      f"afe.instance={relay.instance}"]})[0]
        inspect = json.dumps(client.api.inspect_container(c.id))
        assert KEY not in inspect and relay.cap not in inspect
        writable = [m["Destination"] for m in c.attrs["Mounts"] if m["RW"]]
        assert writable == ["/workspace"]
        assert any(m["Destination"] == RELAY_MOUNT and not m["RW"] for m in c.attrs["Mounts"])
    finally:
        client.close()


async def test_r32_literal_env_cannot_shadow_a_name_passed_by_reference(short_tmp):
    """A literal NAME=value never replaces a declared (secret) name (R9 holds)."""
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with sandbox_broker(layout, env_values={"AGENT_KEY": "v"}) as (sock, secret, _):
        channel = open_channel(sock, secret)
        stub = sandbox_pb2_grpc.SandboxBrokerStub(channel)
        ticket = f"r32-{secrets.token_hex(4)}"
        layout.workspace(ticket).mkdir(parents=True)
        await stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec(
            env_names=["AGENT_KEY"])))
        try:
            for bad in (["AGENT_KEY=x"], ["not a name=x"], ["NOVALUE"]):
                async def inputs(bad=bad):
                    yield pb.ProcessInput(start=pb.ProcessStart(ticket_id=ticket, argv=["true"], env=bad))
                with pytest.raises(Exception) as exc:
                    async for _ in stub.Process(inputs()):
                        pass
                assert "INVALID_ARGUMENT" in str(exc.value.code()), bad
        finally:
            await stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))
            await channel.close()


async def test_r32_sandbox_without_open_relay_is_refused(short_tmp):
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with sandbox_broker(layout) as (sock, secret, _):
        channel = open_channel(sock, secret)
        stub = sandbox_pb2_grpc.SandboxBrokerStub(channel)
        ticket = f"r32-{secrets.token_hex(4)}"
        layout.workspace(ticket).mkdir(parents=True)
        try:
            with pytest.raises(Exception) as exc:
                await stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec(relay=True)))
            assert "relay" in exc.value.details() and "not open" in exc.value.details()
        finally:
            await stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))
            await channel.close()
