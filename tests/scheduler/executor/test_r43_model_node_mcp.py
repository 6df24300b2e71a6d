"""R43 for afe's own model nodes (docs/MCP.md): `tools: [read_file,
mcp:tracker/get_issue]` through the real system — the real scheduler (a
subprocess, as afe up starts it), the real credential broker, a real
sandbox — against a REAL MCP server built on the official `mcp` SDK
(tests/support/mcpserver.py) on loopback that requires a bearer token.

A replay model calls the granted tool and one outside the grant. The granted
call reaches the server with the token (added by the credential broker) and
its result comes back quoted (R36); the other is refused and never reaches
the server, while the same call under a grant that names it does (positive
control). Each call is an `mcp.call` event; the token is in no event and not
in the scheduler's environment (/proc/<pid>/environ), though the server did
receive it."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.layout import Layout
from tests.scheduler.conftest import all_events, payload, state_name, wait_for_state, write_config
from tests.support.mcpserver import mcp_server
from tests.support.system import afe_system

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

SCRIPT = """
responses:
  - content: "Reading the issue, and trying more."
    tool_calls:
      - {name: mcp__tracker__get_issue, arguments: {number: 7}}
      - {name: mcp__tracker__delete_issue, arguments: {number: 7}}
  - content: "Done."
"""

CONFIG = """\
kind: Model
name: scripted
provider: replay
script: script.yaml
---
kind: McpServer
name: tracker
url: %(url)s
tokenEnv: TRACKER_TOKEN
timeout: 20
---
kind: Workflow
name: triage
workspace: ws
nodes:
  - {id: plan, model: scripted, prompt: "Plan the fix", tools: [read_file, mcp:tracker/get_issue], max_turns: 3}
---
kind: Workflow
name: cleanup
workspace: ws
nodes:
  - {id: plan, model: scripted, prompt: "Clean up", max_turns: 3,
     tools: [read_file, mcp:tracker/get_issue, mcp:tracker/delete_issue]}
"""


def _environ(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


async def test_r43_model_node_calls_granted_mcp_tool_through_the_broker_and_is_refused_others(short_tmp):
    token = "canary-mcp-" + secrets.token_hex(16)
    with mcp_server(token) as srv:
        cfg = write_config(short_tmp, CONFIG % {"url": srv.url}, files={"script.yaml": SCRIPT})
        layout = Layout(short_tmp / "data", short_tmp / "run")
        async with afe_system(cfg, layout, subprocess=True, broker_secrets={"TRACKER_TOKEN": token}) as sys_:
            assert sys_.proc is not None
            scheduler_env = _environ(sys_.proc.pid)

            t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="triage", title="login 500"))
            done = await wait_for_state(sys_.stub, t.id, {"succeeded", "failed"})
            assert state_name(done) == "succeeded", done.error
            events = await all_events(sys_.stub, t.id)

            # the granted tool reached the server, with the token the broker added; the other did not
            assert srv.calls == [("get_issue", {"number": 7})]
            assert token in srv.bearers
            calls = [payload(e) for e in events if e.type == "mcp.call"]
            assert [(c["server"], c["tool"], c["outcome"]) for c in calls] == [
                ("tracker", "get_issue", "ok"), ("tracker", "delete_issue", "refused")]
            assert calls[0]["response_bytes"] > 0 and len(calls[0]["arguments_sha256"]) == 64
            assert calls[0]["node"] == "plan" and calls[0]["via"] == "broker"
            results = {p["name"]: p for p in (payload(e) for e in events if e.type == "node.tool_result")}
            granted = results["mcp__tracker__get_issue"]
            assert granted["ok"] is True and "Issue 7: the login page returns 500" in granted["result"]
            assert granted["result"].startswith("<<<QUOTED ")            # the server's text is quoted (R36)
            assert results["mcp__tracker__delete_issue"]["ok"] is False
            assert "not available to this node" in results["mcp__tracker__delete_issue"]["result"]

            # positive control: a grant that names delete_issue lets the same call through
            t2 = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="cleanup", title="clean"))
            done2 = await wait_for_state(sys_.stub, t2.id, {"succeeded", "failed"})
            assert state_name(done2) == "succeeded", done2.error
            assert srv.calls[-2:] == [("get_issue", {"number": 7}), ("delete_issue", {"number": 7})]
            events2 = await all_events(sys_.stub, t2.id)
            assert [p["outcome"] for p in (payload(e) for e in events2 if e.type == "mcp.call")] == ["ok", "ok"]

            # the token: never in an event, never in the scheduler's environment
            for ev in [*events, *events2]:
                assert token not in ev.payload_json, ev.type
            assert token.encode() not in scheduler_env
            assert token.encode() not in _environ(sys_.proc.pid)
            log = sys_.log_path.read_bytes() if sys_.log_path and sys_.log_path.exists() else b""
            assert token.encode() not in log
