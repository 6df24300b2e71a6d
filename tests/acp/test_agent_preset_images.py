"""The preset images (`afe images build --agent NAME`: claude-code, codex,
gemini, opencode) build from their pinned locks, and their ACP agents start inside a hardened
sandbox made by the real sandbox broker and answer `initialize`, with no key
in their environment (models are reached later through the relay, R32).

The images are rebuilt only when their inputs change (the digest label);
npm's own cache keeps the packages between builds."""

from __future__ import annotations

import asyncio
import json
import secrets

import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from services.common.config.presets import PRESETS
from services.common.host.images import agent_image_digest, agent_image_state, build_agent_image
from services.common.layout import Layout
from services.common.rpc.grpcutil import open_channel
from tests.support.sandbox_broker import sandbox_broker

pytestmark = [pytest.mark.docker, pytest.mark.timeout(900)]

INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"protocolVersion": 1, "clientCapabilities": {
                  "fs": {"readTextFile": True, "writeTextFile": True}, "terminal": True}}}


async def initialize(stub, ticket: str, argv: tuple[str, ...]) -> tuple[dict, bytes]:
    """Start `argv` as an interactive process in the sandbox, send
    `initialize`, return the agent's answer (and its stderr), then kill it."""
    inputs: asyncio.Queue = asyncio.Queue()

    async def requests():
        while (item := await inputs.get()) is not None:
            yield item

    inputs.put_nowait(sandbox_pb2.ProcessInput(start=sandbox_pb2.ProcessStart(ticket_id=ticket, argv=list(argv))))
    inputs.put_nowait(sandbox_pb2.ProcessInput(stdin=(json.dumps(INITIALIZE) + "\n").encode()))
    call = stub.Process(requests())
    out, err, answer = b"", b"", None
    try:
        async with asyncio.timeout(120):
            async for ev in call:
                kind = ev.WhichOneof("output")
                if kind == "stdout":
                    out += ev.stdout
                    for line in out.split(b"\n"):
                        if line.strip().startswith(b"{") and b'"id":1' in line.replace(b" ", b""):
                            answer = json.loads(line)
                    if answer is not None:
                        inputs.put_nowait(sandbox_pb2.ProcessInput(kill=True))
                        inputs.put_nowait(None)
                elif kind == "stderr":
                    err += ev.stderr
                elif kind == "exit":
                    break
    finally:
        inputs.put_nowait(None)
        call.cancel()
    assert answer is not None, f"no initialize answer; stdout={out[-2000:]!r} stderr={err[-2000:]!r}"
    return answer, err


@pytest.mark.parametrize("name", sorted(PRESETS))
async def test_preset_agent_starts_in_a_hardened_sandbox_and_answers_initialize(short_tmp, name):
    preset = PRESETS[name]
    await asyncio.to_thread(build_agent_image, name, lambda _m: None)
    assert await asyncio.to_thread(agent_image_state, preset) == "ready"
    # rebuilt only when an input changes: a second call does nothing
    assert await asyncio.to_thread(build_agent_image, name, lambda _m: None) is False

    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with sandbox_broker(layout) as (sock, secret, _instance):
        channel = open_channel(sock, secret)
        stub = sandbox_pb2_grpc.SandboxBrokerStub(channel)
        ticket = f"preset-{secrets.token_hex(4)}"
        layout.workspace(ticket).mkdir(parents=True)
        await stub.CreateSandbox(sandbox_pb2.CreateSandboxRequest(
            ticket_id=ticket, spec=sandbox_pb2.SandboxSpec(image=preset.image)))
        try:
            answer, _stderr = await initialize(stub, ticket, preset.command)
            result = answer["result"]
            assert result["protocolVersion"] == 1
            assert result["agentInfo"]["version"] == preset.version
            # the process ran as the sandbox user, on a read-only root, with no key
            env = b""
            async for ev in stub.Exec(sandbox_pb2.ExecRequest(ticket_id=ticket, argv=[
                    "sh", "-c", "id -u; touch /opt/afe-agent/x 2>/dev/null && echo WRITABLE; env"])):
                if ev.WhichOneof("event") == "stdout":
                    env += ev.stdout
            lines = env.decode().splitlines()
            assert lines[0] == "10001" and "WRITABLE" not in lines
            assert not [ln for ln in lines if ln.split("=")[0].endswith(("_API_KEY", "_TOKEN"))]
        finally:
            await stub.DestroySandbox(sandbox_pb2.DestroySandboxRequest(ticket_id=ticket))
            await channel.close()


def test_digest_follows_the_inputs(tmp_path, monkeypatch):
    """The label changes when a file of the build folder changes (so tests and
    `afe check` see a stale image), and only then."""
    preset = PRESETS["codex"]
    before = agent_image_digest(preset)
    assert agent_image_digest(preset) == before
    copy = tmp_path / "codex"
    copy.mkdir()
    for f in preset.context_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(type(preset), "context_dir", property(lambda _self: copy))
    assert agent_image_digest(preset) == before
    (copy / "package-lock.json").write_text((copy / "package-lock.json").read_text() + " ")
    assert agent_image_digest(preset) != before


def test_up_preflight_names_the_build_command_for_a_missing_preset_image(tmp_path, monkeypatch):
    from services.common.config.manifests import load_config
    from services.common.config.presets import Preset
    from services.common.errors import ConfigError
    from services.launcher.launch import _check_other_images

    missing = f"afe/agent-codex:missing-{secrets.token_hex(4)}"
    monkeypatch.setattr(Preset, "image", property(lambda p: missing if p.name == "codex" else
                                                   f"afe/agent-{p.name}:{p.version}"))
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "afe.yaml").write_text("kind: Workspace\nname: ws\nrepo: /tmp/nowhere.git\n---\n"
                                  "kind: Agent\nname: coder\ntype: acp\npreset: codex\n---\n"
                                  "kind: Workflow\nname: wf\nworkspace: ws\nnodes:\n"
                                  "  - {id: a, agent: coder, prompt: hi}\n")
    with pytest.raises(ConfigError) as exc:
        _check_other_images(load_config(cfg))
    assert (f"{missing} (named by afe.yaml#2 Agent coder preset codex; build it with "
            "`afe images build --agent codex`)") in str(exc.value)
