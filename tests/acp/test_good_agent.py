"""A well-behaved ACP agent in a real sandbox through the real broker: it
streams updates, writes a file, runs a command, asks a permission, and its
attacks on paths outside /workspace are refused (R4, R17-R19)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from services.common.errors import FailedPrecondition

pytestmark = pytest.mark.timeout(120)


def report_of(output: str) -> dict:
    assert "REPORT " in output, output
    return json.loads(output.split("REPORT ", 1)[1])


async def test_good_agent_works_and_events_show_it(acp_env):
    out = await acp_env.run("good", prompt="make hello")
    rep = report_of(out)
    ev = acp_env.events

    # initialize advertised exactly what is served; session/new used /workspace.
    assert rep["caps"] == {"read": True, "write": True, "terminal": True}
    assert rep["cwd"] == "/workspace"
    # The output is the final message, not the earlier "Working on it.".
    assert out.startswith("Done. REPORT ")
    assert ev.of("agent.message")[0]["text"] == "Working on it."
    assert ev.of("agent.thought") == [{"text": "reading the task"}]
    assert [e["entries"][0]["status"] for e in ev.of("agent.plan")] == ["in_progress", "completed"]
    assert {e["id"] for e in ev.of("agent.tool_call")} == {"t1", "t2"}
    assert {(e["id"], e["status"]) for e in ev.of("agent.tool_call_update")} == {("t1", "completed"),
                                                                                ("t2", "completed")}

    # Permission asked and allowed (default policy), recorded.
    assert rep["permission"] == "yes"
    assert ev.of("agent.permission") == [{"tool_call_id": "t1", "kind": "edit", "title": "Write hello.txt",
                                          "decision": "allow", "option_id": "yes"}]
    # The write went through the broker into the ticket's workspace, with the prompt.
    assert rep["write"] == {"ok": True} and rep["read"] == {"ok": True, "same": True}
    assert (acp_env.workspace / "hello.txt").read_text() == "hello from the agent: make hello\n"
    # The command ran inside the sandbox (uid 10001), exit code passed back.
    assert rep["terminal"]["exit_code"] == 7
    assert rep["terminal"]["output"] == "hello from the agent: make hello\n10001\nkey=\n"
    ops = [(e["op"], e.get("exit_code")) for e in ev.of("agent.terminal")]
    assert ops == [("create", None), ("exit", 7), ("release", None)]

    # Unknown method: answered "method not found", recorded as a protocol error.
    assert rep["unknown_method"]["code"] == -32601
    assert any("evil/method" in e["reason"] for e in ev.of("agent.protocol_error"))

    # No agent process is left in the sandbox.
    assert not [p for p in await acp_env.processes() if "/opt/acp/agents/" in p]


async def test_r17_r19_agent_path_attacks_are_refused_with_acp_errors(acp_env):
    out = await acp_env.run("good", prompt="attack")
    attacks = report_of(out)["attacks"]
    for name in ("etc_passwd", "dotdot", "symlink_out", "symlink_in", "relative", "write_symlink",
                 "write_dotdot"):
        assert attacks[name]["ok"] is False, (name, attacks[name])
        assert attacks[name]["code"] == -32001, (name, attacks[name])
    assert "outside /workspace" in attacks["etc_passwd"]["message"]
    assert "'..'" in attacks["dotdot"]["message"]
    assert "symbolic link" in attacks["symlink_out"]["message"]
    assert "symbolic link" in attacks["write_symlink"]["message"]
    failed = {e["path"] for e in acp_env.events.of("agent.fs") if not e["ok"]}
    assert {"/etc/passwd", "/workspace/../x", "/workspace/link", "/workspace/inlink",
            "/workspace/../escape.txt"} <= failed
    ws = acp_env.workspace
    assert (ws / "hello.txt").read_text().startswith("hello from the agent")   # not overwritten via inlink
    assert not (ws.parent / "escape.txt").exists() and not (ws.parent / "x").exists()

    # Positive controls: the attacks are real. The agent made the links inside
    # the sandbox; followed on the host, `link` reads the HOST's /etc/passwd
    # and `inlink` would let a write land on hello.txt; and `..` resolves
    # outside the workspace.
    assert os.path.islink(ws / "link") and os.readlink(ws / "link") == "/etc/passwd"
    assert (ws / "link").read_text() == Path("/etc/passwd").read_text()
    assert os.path.realpath(ws / "inlink") == str(ws / "hello.txt")
    assert not os.path.realpath(os.path.join(ws, "../x")).startswith(str(ws) + "/")


async def test_deny_policy_refuses_permission_and_the_matching_requests(acp_env):
    out = await acp_env.run("good", prompt="denied", deny=("edit", "execute"))
    rep = report_of(out)
    assert rep["permission"] == "no"
    assert acp_env.events.of("agent.permission")[0]["decision"] == "deny"
    # An agent that writes anyway is refused by the same policy.
    assert rep["write"]["ok"] is False and "denied by this node's policy" in rep["write"]["message"]
    assert rep["terminal"]["ok"] is False and "denied by this node's policy" in rep["terminal"]["message"]
    assert not (acp_env.workspace / "hello.txt").exists()
    # Control: reading is not denied, so the policy is per kind, not "refuse all".
    assert any(e["op"] == "read" and "denied" not in e.get("error", "") for e in acp_env.events.of("agent.fs"))


async def test_refusal_stop_reason_fails_the_node(acp_env):
    with pytest.raises(FailedPrecondition, match="refused the prompt"):
        await acp_env.run("good", prompt="refuse: do something bad")
    assert acp_env.events.of("agent.message") == [{"text": "I will not do that."}]
    assert not [p for p in await acp_env.processes() if "/opt/acp/agents/" in p]
