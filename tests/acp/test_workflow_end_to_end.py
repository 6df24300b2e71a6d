"""End to end through the real scheduler and both real brokers: a workflow
`agent -> run tests -> builtin:open_pr` on the demo repository, where the
agent (an ACP agent in the sandbox, image from its Agent manifest) fixes
the bug; the tests pass in the sandbox and a PR is opened on the local forge."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import docker
import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.demo import make_repo
from services.common.layout import Layout
from tests.acp.image import IMAGE, agent_command
from tests.support.system import afe_system

pytestmark = pytest.mark.timeout(300)

CONFIG = """\
kind: Agent
name: crasher
type: acp
command: %(crash)s
image: %(image)s
---
kind: Agent
name: sleeper
type: acp
command: %(silent)s
image: %(image)s
---
kind: Workflow
name: agent-crash
workspace: ws
nodes:
  - {id: code, agent: crasher, prompt: "go"}
  - {id: pr, uses: "builtin:open_pr", needs: [code]}
---
kind: Workflow
name: agent-hang
workspace: ws
nodes:
  - {id: code, agent: sleeper, prompt: "go"}
---
kind: Workspace
name: ws
repo: repos/calc.git
baseBranch: main
forge: {type: local}
sandbox:
  limits: {cpus: 1, memory: 512m, pids: 128}
---
kind: Agent
name: fixer
type: acp
command: %(command)s
image: %(image)s
---
kind: Workflow
name: agent-fix
workspace: ws
nodes:
  - id: code
    agent: fixer
    prompt: "Fix the failing test. Ticket: {{ticket.title}}"
    timeout: 120
  - id: test
    run: "python3 -m unittest -v"
    needs: [code]
    timeout: 120
  - id: pr
    uses: builtin:open_pr
    needs: [test]
"""

DONE = {pb.TICKET_STATE_SUCCEEDED, pb.TICKET_STATE_FAILED, pb.TICKET_STATE_CANCELLED, pb.TICKET_STATE_WAITING_APPROVAL}


async def wait_done(stub, ticket_id: str, deadline_s: float = 240) -> pb.Ticket:
    end = time.monotonic() + deadline_s
    while True:
        t = await stub.GetTicket(pb.GetTicketRequest(id=ticket_id))
        if t.state in DONE:
            return t
        assert time.monotonic() < end, f"ticket {ticket_id} did not finish"
        await asyncio.sleep(0.2)


def git(bare, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(bare), *args], check=True, capture_output=True,
                          text=True).stdout


def write_config(root):
    cfg = root / "cfg"
    cfg.mkdir()
    bare = make_repo(cfg / "repos" / "calc.git")
    (cfg / "afe.yaml").write_text(CONFIG % {
        "command": json.dumps(list(agent_command("fixer"))), "crash": json.dumps(list(agent_command("crash"))),
        "silent": json.dumps(list(agent_command("silent"))), "image": IMAGE})
    return cfg, bare


async def events_of(stub, ticket_id: str) -> list[tuple[str, dict]]:
    return [(e.type, json.loads(e.payload_json))
            async for e in stub.WatchTicket(pb.WatchTicketRequest(id=ticket_id, from_seq=1, follow=False))]


def containers_of(ticket_id: str) -> list:
    client = docker.from_env()
    try:
        return client.containers.list(all=True, filters={"label": f"afe.ticket={ticket_id}"})
    finally:
        client.close()


async def test_agent_then_tests_then_open_pr_on_the_demo_repository(short_tmp, acp_image):
    cfg, bare = write_config(short_tmp)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout) as sys_:
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(
            workflow="agent-fix", title="Fix add()", body="add subtracts", principal="tester"))
        t = await wait_done(sys_.stub, t.id)
        events = [e async for e in sys_.stub.WatchTicket(pb.WatchTicketRequest(id=t.id, from_seq=1,
                                                                               follow=False))]
        types = [e.type for e in events]
        assert t.state == pb.TICKET_STATE_SUCCEEDED, (t.error, types)

        # The PR exists on the local forge and its head carries the agent's fix.
        assert t.pr.number and t.pr.head_branch == f"afe/{t.id}"
        assert "return a + b" in git(bare, "show", f"{t.pr.head_sha}:calc.py")
        assert "return a - b" in git(bare, "show", "main:calc.py")     # not merged

        # The agent ran in the sandbox with the Agent's image; its work is in the events.
        payloads = [(e.type, json.loads(e.payload_json)) for e in events]
        fs = [p for ty, p in payloads if ty == "agent.fs"]
        assert [(p["op"], p["path"], p["ok"]) for p in fs] == [("read", "/workspace/calc.py", True),
                                                               ("write", "/workspace/calc.py", True)]
        assert [p["decision"] for ty, p in payloads if ty == "agent.permission"] == ["allow"]
        exits = [p for ty, p in payloads if ty == "agent.terminal" and p["op"] == "exit"]
        assert [p["exit_code"] for p in exits] == [0]
        assert ("agent.message",
                {"node": "code", "attempt": 1, "text": "Fixed add() in calc.py; unittest exit code 0."}) in payloads
        order = [types.index(x) for x in ("agent.fs", "agent.terminal", "pr.opened")]
        assert order == sorted(order)

        # Terminal ticket: the sandbox is gone.
        assert containers_of(t.id) == []


async def test_crashing_agent_fails_the_ticket_with_the_reason_and_no_pr(short_tmp, acp_image):
    cfg, bare = write_config(short_tmp)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout) as sys_:
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="agent-crash", title="x",
                                                                principal="tester"))
        t = await wait_done(sys_.stub, t.id)
        assert t.state == pb.TICKET_STATE_FAILED
        assert "exited with code 3 during session/prompt" in t.error, t.error
        assert not t.pr.number
        assert git(bare, "branch", "--list", f"afe/{t.id}").strip() == ""     # nothing was pushed
        assert ("agent.message", {"node": "code", "attempt": 1, "text": "about to crash"}) \
            in await events_of(sys_.stub, t.id)
        assert containers_of(t.id) == []


async def test_ticket_cancel_reaches_the_agent_as_session_cancel(short_tmp, acp_image):
    cfg, _ = write_config(short_tmp)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout) as sys_:
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="agent-hang", title="x",
                                                                principal="tester"))
        working = ("agent.message", {"node": "code", "attempt": 1, "text": "thinking forever"})
        deadline = time.monotonic() + 60
        while working not in (seen := await events_of(sys_.stub, t.id)):
            assert time.monotonic() < deadline, f"the agent never said it works: {seen}"
            await asyncio.sleep(0.1)
        assert containers_of(t.id), "control: the sandbox runs while the agent works"
        await sys_.stub.CancelTicket(pb.CancelTicketRequest(id=t.id, principal="tester"))
        t = await wait_done(sys_.stub, t.id)
        assert t.state == pb.TICKET_STATE_CANCELLED
        assert ("agent.cancel", {"node": "code", "attempt": 1, "sent": "session/cancel"}) \
            in await events_of(sys_.stub, t.id)
        assert containers_of(t.id) == []
