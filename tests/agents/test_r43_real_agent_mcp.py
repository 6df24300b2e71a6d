"""R43 end to end: the real Claude Code agent (preset `claude-code`, the
pinned @zed-industries/claude-code-acp) in a sandbox of `afe up` (the four
real processes) uses a tool of a real MCP server (the official `mcp` SDK,
tests/support/mcptracker.py, on the host) that requires a bearer token.
The token (a canary) is in `afe up`'s environment, passed to the
credential broker only. The agent gets the server over ACP `session/new`
at the ticket's relay with the relay's capability; a scripted model
(tests/agents/scripted_models.py) drives it:

    mcp__tracker__get_issue   a granted tool: the call succeeds
    mcp__tracker__whoami      a granted tool whose answer echoes the token: masked
    mcp__acp__Bash            a hostile step: a script reads the capability from the
                              agent's environment and calls delete_issue (not granted)
                              through the relay in every spelling and in a batch: refused
    mcp__acp__Edit            the fix, so the ticket opens a pull request (a run record)

The canary is then looked for in the sandbox (every process's environment
and argv, the writable folders, `docker inspect`) while the agent runs,
in the ticket's events, in the signed run records, in every file of afe's
data and runtime folders and in afe's output: it is nowhere. The positive
control, a second ticket whose agent declares `env: [TRACKER_TOKEN_COPY]`
holding the same canary (no relay), shows it in the agent's environment,
where the same look finds it. The same ticket runs again in a gVisor
sandbox (`runtime: gvisor`). A capability of another ticket, or after a
ticket's end, is tested on the relay itself (tests/credentials/mcptools/test_r43_mcp_relay.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
from pathlib import Path
from typing import ClassVar

import docker
import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services._gen.afe.scheduler.v1 import scheduler_pb2_grpc as rpc
from services.common.demo import make_repo
from services.common.host.images import build_agent_image
from services.common.layout import Layout
from services.common.rpc.grpcutil import open_channel
from services.common.states import TicketState
from tests.agents.scripted_models import BUGGY_SOURCE, FINAL_TEXT, FIXED_SOURCE, ScriptedAnthropic
from tests.agents.test_real_agents import (
    GVISOR_SANDBOX,
    _environs,
    _inspect_sandbox,
    _remove_containers_of,
    events_of,
    git,
    wait_settled,
)
from tests.foundation.launcher_support import base_env, start_afe, wait_gone
from tests.support.mcptracker import tracker

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(900)]

CANARY = "canary-mcp-" + secrets.token_hex(20)

CONFIG = """\
kind: Workspace
name: calc
repo: repos/calc.git
baseBranch: main
forge: {type: local}
sandbox:
  limits: {cpus: 1, memory: 1g, pids: 256}
%(sandbox_extra)s---
kind: Model
name: my-claude
provider: anthropic
model: claude-sonnet-4-5
baseUrl: %(model_url)s
apiKeyEnv: REAL_AGENT_MODEL_KEY
---
kind: McpServer
name: tracker
url: %(mcp_url)s
tokenEnv: R43_TRACKER_TOKEN
---
kind: Agent
name: coder
type: acp
preset: claude-code
model: my-claude
---
kind: Agent
name: leaky
type: acp
preset: claude-code
model: my-claude
env: [TRACKER_TOKEN_COPY]
---
kind: Workflow
name: triage
workspace: calc
mcp:
  tracker: [get_issue, whoami]
nodes:
  - {id: fix, agent: coder, prompt: "Fix issue 7 of the tracker.", timeout: 300}
  - {id: pr, uses: "builtin:open_pr", needs: [fix]}
  - {id: merge, uses: "builtin:merge", needs: [pr]}
---
kind: Workflow
name: control
workspace: calc
nodes:
  - {id: fix, agent: leaky, prompt: "Fix issue 7.", timeout: 300}
"""

# The hostile step: the capability is the agent's (its ANTHROPIC_API_KEY, the same relay's); with it a
# script speaks MCP to the relay itself and asks for delete_issue in every spelling and in a batch.
HOSTILE = r"""python3 - <<'EOF'
import glob, json, urllib.request, urllib.error
cap = ""
for p in glob.glob("/proc/[0-9]*/environ"):
    try:
        for kv in open(p, "rb").read().split(b"\0"):
            if kv.startswith(b"ANTHROPIC_API_KEY="):
                cap = kv.split(b"=", 1)[1].decode()
    except OSError:
        pass
sid = ""
def post(raw):
    global sid
    h = {"Authorization": "Bearer " + cap, "Content-Type": "application/json",
         "Accept": "application/json, text/event-stream"}
    if sid:
        h["Mcp-Session-Id"] = sid
    req = urllib.request.Request("http://127.0.0.1:7480/mcp/tracker", data=raw, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            sid = r.headers.get("Mcp-Session-Id") or sid
            return r.status, r.read().decode().replace("\n", " ")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode().replace("\n", " ")
def call(name, i):
    return json.dumps({"jsonrpc": "2.0", "id": i, "method": "tools/call",
                       "params": {"name": name, "arguments": {"number": 7}}}).encode()
print("HAVE-CAP", cap.startswith("afe-relay-"))
print("ATTEMPT init", *post(json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "x", "version": "1"}}}).encode()))
post(b'{"jsonrpc":"2.0","method":"notifications/initialized"}')
for i, name in enumerate(["delete_issue", "Delete_Issue", "tracker/delete_issue", "mcp__tracker__delete_issue"]):
    print("ATTEMPT", name, *post(call(name, i + 1)))
print("ATTEMPT batch", *post(b"[" + call("get_issue", 10) + b"," + call("delete_issue", 11) + b"]"))
print("ATTEMPT duplicate", *post(b'{"jsonrpc":"2.0","id":12,"method":"tools/call","params":'
                                 b'{"name":"delete_issue","name":"get_issue","arguments":{"number":7}}}'))
EOF"""

EDIT = ("mcp__acp__Edit", {"file_path": "/workspace/calc.py", "old_string": BUGGY_SOURCE,
                           "new_string": FIXED_SOURCE})


class ScriptedMcp(ScriptedAnthropic):
    """The MCP ticket's script (its requests offer the tracker's tools), and the control's (they do not)."""

    SCRIPTS: ClassVar[dict[str, tuple]] = {
        "mcp__tracker__get_issue": (
            ("mcp__tracker__get_issue", {"number": 7}),
            ("mcp__tracker__whoami", {}),
            ("mcp__acp__Bash", {"command": HOSTILE, "timeout": 60000, "description": "Probe the tracker"}),
            EDIT,
        ),
        "mcp__acp__Edit": (EDIT,),
    }

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.offered: list[set[str]] = []       # the tools of each scripted request

    async def messages(self, request):
        if self.authorized(request):
            body = await request.json()
            names = {t.get("name") for t in body.get("tools") or []}
            if any(n.startswith("mcp__acp__") for n in names):
                self.offered.append(names)
        return await super().messages(request)


def _decoded(records: pb.RunRecords) -> list[dict]:
    return [json.loads(base64.b64decode(json.loads(r.envelope)["payload"])) for r in records.records]


def _files_holding(roots: list[Path], needle: bytes) -> list[str]:
    out = []
    for root in roots:
        for dirpath, _dirs, files in os.walk(root):
            for f in files:
                p = Path(dirpath) / f
                try:
                    if p.is_file() and not p.is_symlink() and needle in p.read_bytes():
                        out.append(str(p))
                except OSError:
                    continue
    return out


@pytest.mark.parametrize("runtime", ["runc", "gvisor"])
async def test_r43_real_agent_calls_an_mcp_tool_through_the_relay_and_the_token_never_enters_the_sandbox(
        short_tmp, runtime):
    if runtime == "gvisor" and "runsc" not in (docker.from_env().info().get("Runtimes") or {}):
        pytest.skip("the Docker engine has no `runsc` runtime (gVisor); .ci/run registers it (see the README)")
    await asyncio.to_thread(build_agent_image, "claude-code", lambda _m: None)
    key = "sk-ant-api03-" + secrets.token_urlsafe(36)
    model = ScriptedMcp(key)
    cfg = short_tmp / "cfg"
    cfg.mkdir()
    bare = make_repo(cfg / "repos" / "calc.git")
    looked: dict = {}
    control: dict = {}
    ids: dict = {}

    with tracker(CANARY) as srv:
        async with model:
            (cfg / "afe.yaml").write_text(CONFIG % {
                "model_url": model.url, "mcp_url": srv.url,
                "sandbox_extra": GVISOR_SANDBOX if runtime == "gvisor" else ""})
            afe = start_afe(short_tmp, base_env(REAL_AGENT_MODEL_KEY=key, R43_TRACKER_TOKEN=CANARY,
                                                TRACKER_TOKEN_COPY=CANARY))
            try:
                await asyncio.to_thread(afe.wait_up)

                async def look(step: int) -> None:
                    # after the hostile step and the edit, while the agent waits for its last answer
                    if step == 4 and not looked:
                        looked.update(await asyncio.to_thread(_inspect_sandbox, ids["mcp"], CANARY))

                model.on_step = look
                secret = bytes.fromhex((afe.run_dir / "automation.key").read_text().strip())
                async with open_channel(str(afe.run_dir / "scheduler.sock"), secret) as channel:
                    stub = rpc.SchedulerStub(channel)
                    t = await stub.CreateTicket(pb.CreateTicketRequest(workflow="triage", title="Issue 7",
                                                                       body="see the tracker", principal="tester"))
                    ids["mcp"] = t.id
                    t, state = await wait_settled(stub, t.id)
                    events = await events_of(stub, t.id)
                    assert state is TicketState.WAITING_APPROVAL, (t.error, events[-30:])
                    request_records = _decoded(await stub.GetRunRecords(pb.GetTicketRequest(id=t.id)))
                    await stub.ApproveTicket(pb.ApproveTicketRequest(id=t.id, principal="tester"))
                    t, state = await wait_settled(stub, t.id)
                    assert state is TicketState.SUCCEEDED, t.error
                    events = await events_of(stub, t.id)
                    records = _decoded(await stub.GetRunRecords(pb.GetTicketRequest(id=t.id)))
                    # the ticket has ended: its relay (model and MCP) is gone
                    assert not Layout(afe.data, afe.run_dir).relay_dir(t.id).exists()
                    files = _files_holding([afe.data, afe.run_dir], CANARY.encode())
                    steps, results, offered = list(model.steps), list(model.tool_results), model.offered[0]

                    if runtime == "runc":     # the positive control: the same canary through env:
                        async def look_control(step: int) -> None:
                            if step == 1 and not control:
                                control.update(await asyncio.to_thread(_inspect_sandbox, ids["control"], CANARY))

                        model.on_step = look_control
                        c = await stub.CreateTicket(pb.CreateTicketRequest(workflow="control", title="control",
                                                                           principal="tester"))
                        ids["control"] = c.id
                        c, cstate = await wait_settled(stub, c.id)
                        assert cstate is TicketState.SUCCEEDED, c.error
            finally:
                pids = list(afe.pids().values())
                code = afe.stop()
                assert wait_gone(pids, 20) == []
                for tid in ids.values():
                    await asyncio.to_thread(_remove_containers_of, tid)
            assert code == 0, afe.text()[-3000:]

    # The agent was given the tracker at the relay, and its model saw only the granted tools.
    given = [p for ty, p in events if ty == "agent.mcp_servers"]
    assert given == [{"node": "fix", "attempt": 1, "servers": ["tracker"], "given": True}], given
    assert {"mcp__tracker__get_issue", "mcp__tracker__whoami"} <= offered, offered
    assert not {n for n in offered if n.startswith("mcp__tracker__")} - {"mcp__tracker__get_issue",
                                                                           "mcp__tracker__whoami"}, offered
    # The granted call succeeded: the tracker ran it and its answer reached the model.
    assert steps[:5] == [0, 1, 2, 3, 4], steps
    assert "login page returns 500" in results[0], results
    # The echoed token was masked on its way back.
    assert "[redacted]" in results[1] and CANARY not in results[1]
    # The hostile script had the capability and was refused every spelling and the batch;
    # delete_issue never ran, not even the batch's granted half.
    hostile = results[2]
    assert "HAVE-CAP True" in hostile and "ATTEMPT init 200" in hostile, hostile
    for name in ("delete_issue", "Delete_Issue", "tracker/delete_issue", "mcp__tracker__delete_issue"):
        line = hostile.split(f"ATTEMPT {name} ", 1)[1].split("ATTEMPT", 1)[0]
        assert "not granted" in line, (name, line)
    assert "not granted" in hostile.split("ATTEMPT batch", 1)[1]
    assert "twice" in hostile.split("ATTEMPT duplicate", 1)[1]
    assert [c for c, _ in srv.calls] == ["get_issue", "whoami"], srv.calls
    # The tracker saw its token on every request and never the relay's capability.
    assert srv.requests and all(h.get("authorization") == f"Bearer {CANARY}" for _, h in srv.requests)
    assert not [h for _, h in srv.requests if "afe-relay-" in json.dumps(h)]
    # Each call is an mcp.call event and is in the signed records: names, digests and outcome only.
    calls = [p for ty, p in events if ty == "mcp.call"]
    assert [(c["tool"], c["outcome"]) for c in calls[:2]] == [("get_issue", "ok"), ("whoami", "ok")], calls
    refused = [c for c in calls if c["outcome"] == "refused"]
    assert len(refused) == 7 and {c["tool"] for c in refused} >= {"delete_issue", "Delete_Issue"}, refused
    for rec in (request_records[-1], records[-1]):
        in_record = rec["predicate"]["mcp_calls"]
        assert [(c["server"], c["tool"], c["outcome"]) for c in in_record[:2]] == [
            ("tracker", "get_issue", "ok"), ("tracker", "whoami", "ok")]
        assert in_record[0]["arguments_sha256"] == calls[0]["arguments_sha256"]
    # The canary is nowhere: the sandbox while the agent ran, the events, the records, afe's files and output.
    sandbox = [seen for seen in looked.values() if seen["labels"].get("afe.role") == "sandbox"]
    assert sandbox and "DONE" in sandbox[0]["inside"], looked
    agent_envs = {p: env for seen in looked.values() for p, env in _environs(seen["inside"]).items()
                  if "ANTHROPIC_API_KEY" in env}
    assert agent_envs, "the agent's processes were not read"     # the look reached the agent's environment
    for name, seen in looked.items():
        assert CANARY not in seen["inspect"], f"the canary is in `docker inspect {name}`"
        assert CANARY not in seen["inside"], f"the canary is inside {name}:\n{seen['inside']}"
    assert CANARY not in json.dumps(events)
    assert CANARY not in json.dumps(records) and CANARY not in json.dumps(request_records)
    assert files == [], files
    assert CANARY not in afe.text()
    assert FINAL_TEXT in " ".join(p.get("text", "") for ty, p in events if ty == "agent.message")
    assert FIXED_SOURCE in git(bare, "show", "main:calc.py")          # the ticket's fix merged
    if runtime == "runc":
        # Positive control: with env: the same canary is in the agent's environment, found by the same look.
        inside = [seen["inside"] for seen in control.values() if seen["labels"].get("afe.role") == "sandbox"]
        assert inside and CANARY in inside[0], control
        holders = [p for seen in control.values() for p, env in _environs(seen["inside"]).items()
                   if env.get("TRACKER_TOKEN_COPY") == CANARY]
        assert holders, "the control's agent does not hold the canary"
