"""The coding agents people use, for real, with no model key in any sandbox
(R9, R32): the preset images with the pinned npm packages of the Claude
Code and Codex ACP adapters, opencode and Gemini CLI (built by
`build_agent_image`, rebuilt only when their inputs change) run a ticket of
the demo repository through `afe up` (the four real processes: gateway,
scheduler, sandbox broker, credential broker):

    fix (Agent preset: claude-code | codex | opencode | gemini, model: my-claude | my-gpt | my-gemini)
      -> test (python3 -m unittest) -> pr (builtin:open_pr) -> merge (waits; the test approves)

The Model's baseUrl is a server of the tests' own (tests/agents/
scripted_models.py) that speaks the provider's real streaming API and
scripts the tool use: the agent edits calc.py with its edit tool, runs the
tests with its shell tool, and answers. The real key is in the environment
of `afe up`, which passes it to the credential broker only (R33; no service
keeps it in its environment, R30). While the agent works, the test looks at
the sandbox from outside (`docker inspect`) and inside (every process's
/proc/<pid>/environ, cmdline and the writable folders): the real key is
nowhere, the relay's capability is in the agent's environment (the
positive control); the model server saw the real key on every request and
never the capability.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import time

import docker
import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services._gen.afe.scheduler.v1 import scheduler_pb2_grpc as rpc
from services.common.demo import make_repo
from services.common.host.images import build_agent_image
from services.common.rpc.grpcutil import open_channel
from services.common.states import NodeState, TicketState
from tests.agents.scripted_models import (
    FINAL_TEXT,
    FIXED_SOURCE,
    Scripted,
    ScriptedAnthropic,
    ScriptedGemini,
    ScriptedResponses,
)
from tests.foundation.launcher_support import base_env, environ_bytes, start_afe, wait_gone

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(900)]

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
name: %(model)s
provider: %(provider)s
model: %(model_id)s
baseUrl: %(url)s
apiKeyEnv: REAL_AGENT_MODEL_KEY
---
kind: Agent
name: coder
type: acp
preset: %(preset)s
model: %(model)s
---
kind: Workflow
name: fix
workspace: calc
nodes:
  - id: fix
    agent: coder
    prompt: "Fix the failing test. Ticket: {{ticket.title}}\\n{{ticket.body}}"
    timeout: 240
  - {id: test, run: "python3 -m unittest -v", needs: [fix], timeout: 120}
  - {id: pr, uses: "builtin:open_pr", needs: [test]}
  - {id: merge, uses: "builtin:merge", needs: [pr]}
"""

CASES = {
    # preset: (Model name, provider, model id, key, the agent's key variable, fake server)
    "claude-code": ("my-claude", "anthropic", "claude-sonnet-4-5", "sk-ant-api03-", "ANTHROPIC_API_KEY",
                    ScriptedAnthropic),
    "opencode": ("my-claude", "anthropic", "claude-sonnet-4-5", "sk-ant-api03-", "ANTHROPIC_API_KEY",
                 ScriptedAnthropic),
    "gemini": ("my-gemini", "gemini", "gemini-2.5-pro", "AIza", "GEMINI_API_KEY", ScriptedGemini),
    "codex": ("my-gpt", "openai", "gpt-5-codex", "sk-proj-", "OPENAI_API_KEY", ScriptedResponses),
}

# Read from inside the sandbox, as the sandbox user (the agent's uid: a
# process's environ is readable by its own uid; root in the container has no
# CAP_SYS_PTRACE to read another uid's): every process's environment and
# command line, one record per line, then the names of files under the
# writable folders that hold the key ($1) and, as a control that the search
# reads them, those that hold the agent's fix ($2: in /workspace/calc.py by now).
INSIDE = r"""
for d in /proc/[0-9]*; do
  p=${d#/proc/}
  [ "$p" = "$$" ] && continue
  printf 'PROC %s %s\n' "$p" "$(tr '\0' ' ' < "$d/cmdline" 2>/dev/null)"
  printf 'ENV %s %s\n' "$p" "$(tr '\0' '\n' < "$d/environ" 2>/dev/null | tr '\n' '\001')"
done
grep -rlsF -e "$1" /workspace /tmp /run /home 2>/dev/null | sed 's/^/FILE /'
grep -rlsF -e "$2" /workspace /tmp /run /home 2>/dev/null | sed 's/^/CONTROL /'
echo DONE
"""


async def wait_settled(stub, ticket_id: str, deadline_s: float = 600) -> tuple[pb.Ticket, TicketState]:
    """The ticket once it stops moving: waiting for approval, or ended."""
    end = time.monotonic() + deadline_s
    while True:
        t = await stub.GetTicket(pb.GetTicketRequest(id=ticket_id))
        state = TicketState.from_proto(t.state)
        if state is not None and (state.terminal or state is TicketState.WAITING_APPROVAL):
            return t, state
        assert time.monotonic() < end, f"ticket {ticket_id} did not settle"
        await asyncio.sleep(0.2)


async def events_of(stub, ticket_id: str) -> list[tuple[str, dict]]:
    return [(e.type, json.loads(e.payload_json))
            async for e in stub.WatchTicket(pb.WatchTicketRequest(id=ticket_id, from_seq=1, follow=False))]


def git(bare, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(bare), *args], check=True, capture_output=True,
                          text=True).stdout


def _inspect_sandbox(ticket_id: str, key: str) -> dict:
    """Every container of the ticket: `docker inspect` as JSON, and what its
    processes carry (see INSIDE)."""
    client = docker.from_env()
    try:
        found = {}
        for c in client.containers.list(all=True, filters={"label": f"afe.ticket={ticket_id}"}):
            inspect = json.dumps(client.api.inspect_container(c.id))
            inside = ""
            if c.status == "running":
                res = c.exec_run(["sh", "-c", INSIDE, "inside", key, FIXED_SOURCE], user="10001:10001")
                inside = res.output.decode(errors="replace")
            found[c.name] = {"inspect": inspect, "inside": inside, "labels": c.labels}
        return found
    finally:
        client.close()


def _containers_of(ticket_id: str) -> list[str]:
    client = docker.from_env()
    try:
        return [c.name for c in client.containers.list(all=True, filters={"label": f"afe.ticket={ticket_id}"})]
    finally:
        client.close()


def _remove_containers_of(ticket_id: str) -> None:
    client = docker.from_env()
    try:
        for c in client.containers.list(all=True, filters={"label": f"afe.ticket={ticket_id}"}):
            c.remove(force=True)
    finally:
        client.close()


def _environs(inside: str) -> dict[str, dict[str, str]]:
    """pid -> environment, from INSIDE's output."""
    procs = {}
    cmdlines = {}
    for line in inside.splitlines():
        kind, _, rest = line.partition(" ")
        pid, _, value = rest.partition(" ")
        if kind == "ENV":
            procs[pid] = dict(kv.split("=", 1) for kv in value.split("\001") if "=" in kv)
        elif kind == "PROC":
            cmdlines[pid] = value
    return {f"{pid} {cmdlines.get(pid, '')}": env for pid, env in procs.items()}


# claude-code@gvisor: the same ticket in a gVisor sandbox (sandbox.runtime: gvisor) with an egress
# allowlist, so its proxy is reached through its socket (no network interface) next to the relay's.
GVISOR_SANDBOX = "  runtime: gvisor\n  egress: [registry.npmjs.org]\n"


@pytest.mark.parametrize("preset", ["claude-code", "codex", "opencode", "gemini", "claude-code@gvisor"])
async def test_r32_real_agent_fixes_the_bug_runs_the_tests_and_opens_a_pr_with_no_key_in_the_sandbox(
        short_tmp, preset):
    preset, _, runtime = preset.partition("@")
    if runtime == "gvisor" and "runsc" not in (docker.from_env().info().get("Runtimes") or {}):
        pytest.skip("the Docker engine has no `runsc` runtime (gVisor); .ci/run registers it (see the README)")
    model_name, provider, model_id, key_prefix, key_var, server_cls = CASES[preset]
    await asyncio.to_thread(build_agent_image, preset, lambda _m: None)
    key = key_prefix + secrets.token_urlsafe(36)
    server: Scripted = server_cls(key)
    cfg = short_tmp / "cfg"
    cfg.mkdir()
    bare = make_repo(cfg / "repos" / "calc.git")
    looked: dict = {}
    services_env: dict = {}
    ticket: dict = {}

    async with server:
        (cfg / "afe.yaml").write_text(CONFIG % {"model": model_name, "provider": provider, "model_id": model_id,
                                                "url": server.url + ("/v1" if provider == "openai" else ""),
                                                "preset": preset,
                                                "sandbox_extra": GVISOR_SANDBOX if runtime else ""})
        # `afe up`: the four real processes; the key is in the launcher's environment only
        afe = start_afe(short_tmp, base_env(REAL_AGENT_MODEL_KEY=key))
        try:
            await asyncio.to_thread(afe.wait_up)

            async def look(step: int) -> None:
                # the agent has edited the file and waits for the model's next move
                if step == server.edit_step + 1 and not looked:
                    looked.update(await asyncio.to_thread(_inspect_sandbox, ticket["id"], key))
                    services_env.update({name: key.encode() in environ_bytes(pid)
                                         for name, pid in afe.pids().items()})
                    services_env["launcher"] = key.encode() in environ_bytes(afe.proc.pid)

            server.on_step = look
            secret = bytes.fromhex((afe.run_dir / "automation.key").read_text().strip())
            async with open_channel(str(afe.run_dir / "scheduler.sock"), secret) as channel:
                stub = rpc.SchedulerStub(channel)
                t = await stub.CreateTicket(pb.CreateTicketRequest(
                    workflow="fix", title="Fix add()", body="add() subtracts; make the test pass",
                    principal="tester"))
                ticket["id"] = t.id
                t, state = await wait_settled(stub, t.id)
                events = await events_of(stub, t.id)
                assert state is TicketState.WAITING_APPROVAL, (t.error, events[-30:],
                                                               [s.path for s in server.seen])
                assert "return a - b" in git(bare, "show", "main:calc.py")     # nothing merged before (R16)
                # a person approves: the PR merges and the ticket's sandbox goes away
                await stub.ApproveTicket(pb.ApproveTicketRequest(id=t.id, principal="tester"))
                merged, end_state = await wait_settled(stub, t.id)
                assert end_state is TicketState.SUCCEEDED, merged.error
            assert await asyncio.to_thread(_containers_of, t.id) == []
        finally:
            pids = list(afe.pids().values())
            code = afe.stop()
            assert wait_gone(pids, 20) == []
            if "id" in ticket:      # a ticket left waiting keeps its sandbox after `afe up` stops
                await asyncio.to_thread(_remove_containers_of, ticket["id"])
        assert code == 0, afe.text()[-3000:]

    # The key was in `afe up`'s environment (the control) and in none of the four services'
    # while the agent ran: the credential broker got it at start and scrubbed it (R30, R33);
    # the model server's record below shows that the broker, the only holder, used it.
    assert services_env == {"launcher": True, "sandbox": False, "credentials": False, "scheduler": False,
                            "gateway": False}, services_env
    # The agent did the work: it edited calc.py and ran the tests with its shell tool, then answered.
    last = server.shell_step + 1
    assert server.steps[:last + 1] == list(range(last + 1)), server.steps
    ran = server.tool_results[server.shell_step]
    assert "OK" in ran and "Ran 2 tests" in ran, server.tool_results
    kinds = [p.get("kind") for ty, p in events if ty in ("agent.tool_call", "agent.tool_call_update")]
    assert "edit" in kinds and "execute" in kinds, kinds
    if preset == "claude-code":
        # its edit and shell tools are afe's: an ACP fs write and an ACP terminal in the sandbox
        fs = [(p["op"], p["path"], p["ok"]) for ty, p in events if ty == "agent.fs"]
        assert ("write", "/workspace/calc.py", True) in fs, fs
        exits = [p["exit_code"] for ty, p in events if ty == "agent.terminal" and p["op"] == "exit"]
        assert exits == [0], exits
    texts = " ".join(p.get("text", "") for ty, p in events if ty == "agent.message")
    assert FINAL_TEXT in texts, texts[-2000:]
    # The test node passed; the PR on the local forge carries the fix; approved, it merged.
    done = {p.get("node"): p for ty, p in events if ty == "node.finished"}
    assert done["test"]["state"] == NodeState.SUCCEEDED and "OK" in done["test"]["output"], done["test"]
    assert t.pr.number and t.pr.head_branch == f"afe/{t.id}"
    diff = git(bare, "diff", f"{t.pr.head_sha}~1", t.pr.head_sha)
    assert f"-    return a - b\n+    {FIXED_SOURCE}" in diff, diff
    assert FIXED_SOURCE in git(bare, "show", "main:calc.py")       # merged after the approval

    # The sandbox, looked at while the agent ran: no real key anywhere.
    assert any(seen["labels"].get("afe.ticket") == t.id and seen["inside"] for seen in looked.values()), \
        "the ticket's sandbox was not inspected while the agent ran"
    if runtime == "gvisor":    # it ran in gVisor, its egress through the proxy's socket
        assert t.sandbox_runtime == "gvisor"     # and the ticket says so (ticket show, the UI)
        sandbox = next(json.loads(seen["inspect"]) for seen in looked.values()
                       if seen["labels"].get("afe.role") == "sandbox")
        assert sandbox["HostConfig"]["Runtime"] == "runsc" and sandbox["HostConfig"]["NetworkMode"] == "none"
        assert sandbox["Config"]["Labels"]["afe.egress"] == "socket"
    agents = {}
    for name, seen in looked.items():
        assert key not in seen["inspect"], f"the real key is in `docker inspect {name}`"
        assert key not in seen["inside"], f"the real key is inside {name}:\n{seen['inside']}"
        assert "DONE" in seen["inside"] or not seen["inside"], seen["inside"]
        if seen["inside"] and seen["labels"].get("afe.role") == "sandbox":   # (an egress proxy has no workspace)
            assert "CONTROL /workspace/calc.py" in seen["inside"].splitlines(), seen["inside"]
        agents.update({p: env for p, env in _environs(seen["inside"]).items() if key_var in env})
    # Positive control: the agent's processes do carry the relay's capability, and the
    # reading above saw their environments (so a key there would have been found).
    assert agents, f"no process with {key_var} found: {looked}"
    caps = {env[key_var] for env in agents.values()}
    assert len(caps) == 1 and next(iter(caps)).startswith("afe-relay-"), caps
    cap = caps.pop()
    assert all(cap not in seen["inspect"] for seen in looked.values())
    # The model server saw the real key on every request and never the capability.
    assert server.seen and all(server.authorized_seen(s) for s in server.seen), [s.headers for s in server.seen]
    assert not [s for s in server.seen if cap in repr(s.headers) or cap.encode() in s.body or cap in s.query]
