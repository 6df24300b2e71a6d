"""What real agents (Claude Code, Codex through their ACP adapters) send that
the `good` agent does not: a shell line as a terminal command, permission
requests that name only the tool call id, and a death explained on stderr.
The `claudelike` agent speaks that way, in a real sandbox through the real
broker (and, for stderr, through the real scheduler's event pipeline)."""

from __future__ import annotations

import json
import secrets

import pytest

from services.common.errors import Unavailable
from services.common.layout import Layout
from services.scheduler.acp.client import MAX_TOOL_CALLS, ToolCalls
from services.scheduler.acp.stderr import MAX_STDERR, StderrLog
from tests.acp.conftest import AcpEnv, Events
from tests.acp.image import IMAGE, agent_command

pytestmark = pytest.mark.timeout(180)

KEY = "sk-ant-api03-" + secrets.token_urlsafe(30)       # secret-looking: the redactor's patterns know it


def report_of(output: str) -> dict:
    assert "REPORT " in output, output
    return json.loads(output.split("REPORT ", 1)[1])


@pytest.mark.docker
async def test_r4_terminal_command_without_args_runs_as_a_shell_line_in_the_sandbox(acp_env):
    rep = report_of(await acp_env.run("claudelike"))
    # The pipe and the `&&` ran: a shell (the sandbox's /bin/sh, as the sandbox user) ran the line.
    assert rep["shell_line"] == {"ok": True, "exit_code": 0, "output": "a\nb\nshell=/bin/sh uid=10001\n"}
    assert (acp_env.workspace / "shell.txt").read_text() == "ran\n"        # its cwd: the workspace
    assert rep["shell_line_empty_args"] == {"ok": True, "exit_code": 0, "output": "a\nb\n"}
    # Control: with args, the argv runs as given; the same characters are just text.
    assert rep["argv"] == {"ok": True, "exit_code": 0, "output": "a | sort && echo b\n"}
    creates = [(e["command"], e["shell"]) for e in acp_env.events.of("agent.terminal") if e["op"] == "create"]
    assert creates == [(
        "printf 'b\\na\\n' | sort && echo \"shell=$0 uid=$(id -u)\" && echo ran > shell.txt", True),
        ("echo a && echo b", True), ("printf %s\\n a | sort && echo b", False)]


@pytest.mark.docker
async def test_deny_applies_to_a_permission_request_whose_kind_came_in_the_tool_call(acp_env):
    rep = report_of(await acp_env.run("claudelike", deny=("fetch",)))
    perms = {e["tool_call_id"]: e for e in acp_env.events.of("agent.permission")}
    # The request named only "f1"; the tool_call "f1" said kind fetch: refused.
    assert rep["fetch_announced"] == "reject"
    assert perms["f1"] == {"tool_call_id": "f1", "kind": "fetch", "title": "Fetch https://example.com",
                           "decision": "deny", "option_id": "reject"}
    # Control: the same request for an id never announced has no kind to go by: allowed, as `other`.
    assert rep["never_announced"] == "allow"
    assert perms["u1"] == {"tool_call_id": "u1", "kind": "other", "title": "", "decision": "allow",
                           "option_id": "allow"}
    # A tool_call_update that changes the kind counts; a kind in the request itself wins.
    assert (rep["kind_from_update"], perms["c1"]["kind"]) == ("reject", "fetch")
    assert (rep["kind_in_request_wins"], perms["k1"]["kind"]) == ("allow", "edit")


@pytest.mark.docker
async def test_without_deny_the_announced_kind_is_recorded_and_allowed(acp_env):
    rep = report_of(await acp_env.run("claudelike"))
    assert rep["fetch_announced"] == "allow"
    assert [(e["tool_call_id"], e["kind"], e["decision"]) for e in acp_env.events.of("agent.permission")] == [
        ("f1", "fetch", "allow"), ("u1", "other", "allow"), ("c1", "fetch", "allow"), ("k1", "edit", "allow")]


def test_remembered_tool_calls_are_bounded_per_session():
    calls = ToolCalls()
    calls.note("first", "fetch", "t" * 5000)
    assert calls.get("first") == ("fetch", "t" * 199 + "…")       # titles are clipped
    calls.note("first", None, None)                                 # an update without kind keeps it
    assert calls.get("first")[0] == "fetch"
    calls.note("x" * 300, "fetch", "too long an id")                 # not remembered
    assert calls.get("x" * 300) == (None, None)
    for i in range(MAX_TOOL_CALLS):
        calls.note(f"id{i}", "edit", None)
    assert len(calls) == MAX_TOOL_CALLS
    assert calls.get("first") == (None, None)                        # the oldest went first
    assert calls.get(f"id{MAX_TOOL_CALLS - 1}") == ("edit", None)


# -- stderr --------------------------------------------------------------------------


def test_stderr_log_keeps_whole_lines_the_head_and_the_tail_within_the_cap():
    recorded: list[tuple[str, dict]] = []
    log = StderrLog(lambda t, p: recorded.append((t, p)))
    lines = [f"line {i:06d} of the agent's log\n".encode() for i in range(5000)]      # 160 KB
    data = b"".join(lines)
    for i in range(0, len(data), 7):                    # chunks that split lines
        log.feed(data[i:i + 7])
    log.flush(final=True)
    assert {t for t, _ in recorded} == {"agent.stderr"}
    texts = [p["text"] for _, p in recorded]
    assert all(t.endswith("\n") for t in texts)         # no line split across two events
    shown = sum(len(t.encode()) for t in texts)
    assert shown <= MAX_STDERR
    assert recorded[-1][1]["omitted_bytes"] == len(data) - shown
    assert texts[0].startswith("line 000000 ") and texts[-1].endswith("line 004999 of the agent's log\n")
    assert texts[-1].startswith("line ")                 # the tail starts at a line, not inside one
    assert log.last_line() == "line 004999 of the agent's log"
    log.feed(b"\x1b[31mred\x1b[0m error\n")             # after the end: ignored
    assert log.last_line() == "line 004999 of the agent's log"
    fresh = StderrLog(lambda t, p: None)
    fresh.feed(b"\x1b[31mred\x1b[0m error\n\n  \n")
    assert fresh.last_line() == "?[31mred?[0m error"      # no terminal escapes in an error message
    # Control: under the cap nothing is left out and nothing is cut.
    small: list[tuple[str, dict]] = []
    log = StderrLog(lambda t, p: small.append((t, p)))
    log.feed(data[:1000])
    log.flush(final=True)
    assert "".join(p["text"] for _, p in small) == data[:1000].decode()
    assert all("omitted_bytes" not in p for _, p in small)


@pytest.fixture
async def env_with_key(short_tmp, acp_image):
    """The ACP sandbox with ACP_TEST_KEY=KEY held by the broker (declared by the agent)."""
    from services._gen.afe.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
    from services.common.rpc.grpcutil import open_channel
    from tests.support.sandbox_broker import sandbox_broker
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with sandbox_broker(layout, env_values={"ACP_TEST_KEY": KEY}) as (sock, secret, instance):
        channel = open_channel(sock, secret)
        stub = sandbox_pb2_grpc.SandboxBrokerStub(channel)
        ticket = f"acp-{secrets.token_hex(4)}"
        layout.workspace(ticket).mkdir(parents=True)
        await stub.CreateSandbox(sandbox_pb2.CreateSandboxRequest(ticket_id=ticket, spec=sandbox_pb2.SandboxSpec(
            image=acp_image, env_names=["ACP_TEST_KEY"])))
        try:
            yield AcpEnv(stub, ticket, layout.workspace(ticket), instance, Events())
        finally:
            await stub.DestroySandbox(sandbox_pb2.DestroySandboxRequest(ticket_id=ticket))
            await channel.close()


@pytest.mark.docker
async def test_dying_agent_stderr_becomes_events_and_its_last_line_the_error(env_with_key):
    """Without the scheduler's pipeline (raw emit): the stderr arrives whole,
    key included — the control for the redaction test below."""
    from services.scheduler.acp import run_agent_node
    env = env_with_key
    with pytest.raises(Unavailable, match=r"exited with code 1 during session/prompt; "
                                          r"its last stderr line: claude-like: giving up"):
        await run_agent_node(ticket_id=env.ticket_id, node=env.node(), prompt="die", sandbox=env.stub,
                             agent=env.agent("claudelike", env=("ACP_TEST_KEY",)), emit=env.events)
    text = "".join(e["text"] for e in env.events.of("agent.stderr"))
    assert text == f"claude-like: starting\nError: 401 invalid x-api-key: {KEY}\nclaude-like: giving up\n"


CONFIG = """\
kind: Agent
name: dier
type: acp
command: %(command)s
env: [ACP_TEST_KEY]
image: %(image)s
---
kind: Workflow
name: agent-die
workspace: ws
nodes:
  - {id: code, agent: dier, prompt: "die"}
---
kind: Workspace
name: ws
repo: repos/calc.git
baseBranch: main
forge: {type: local}
"""


@pytest.mark.docker
async def test_r27_agent_stderr_in_ticket_events_is_redacted(short_tmp, acp_image):
    from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
    from services.common.demo import make_repo
    from tests.acp.test_workflow_end_to_end import events_of, wait_done
    from tests.support.system import afe_system
    cfg = short_tmp / "cfg"
    cfg.mkdir()
    make_repo(cfg / "repos" / "calc.git")
    (cfg / "afe.yaml").write_text(CONFIG % {"command": json.dumps(list(agent_command("claudelike"))),
                                            "image": IMAGE})
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout, agent_env={"ACP_TEST_KEY": KEY}) as sys_:
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="agent-die", title="x",
                                                                principal="tester"))
        t = await wait_done(sys_.stub, t.id)
        events = await events_of(sys_.stub, t.id)
    assert t.state == pb.TICKET_STATE_FAILED
    assert "exited with code 1 during session/prompt; its last stderr line: claude-like: giving up" in t.error
    stderr = "".join(p["text"] for ty, p in events if ty == "agent.stderr")
    # The user sees why the agent died; the key it printed is masked.
    assert stderr == "claude-like: starting\nError: 401 invalid x-api-key: [redacted]\nclaude-like: giving up\n"
    assert all(p["node"] == "code" for ty, p in events if ty == "agent.stderr")
    assert KEY not in json.dumps(events) and KEY not in t.error
