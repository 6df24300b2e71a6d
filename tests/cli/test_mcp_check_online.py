"""`afe check --online` and `afe doctor` list each remote MCP server's
reachable tools (docs/MCP.md), asked from this host with the token from the
shell, against a REAL MCP server on the official `mcp` SDK that requires a
bearer token (tests/support/mcpserver.py). An unset token, a refused token,
an unreachable server and a grant naming a tool the server lacks each give
one clear line; without --online the server is not contacted."""

from __future__ import annotations

import asyncio
import secrets
import textwrap
from pathlib import Path

import pytest

from services.cli.doctor import _mcp_servers
from services.cli.doctor_report import Report
from services.cli.main import main
from services.common.config.manifests import load_config
from services.common.demo import make_repo
from tests.support.mcpserver import mcp_server

pytestmark = pytest.mark.timeout(120)
TOOLS = "get_issue, search_issues, delete_issue, big, slow, inject"


def _config(tmp: Path, url: str, tool: str = "get_issue") -> Path:
    conf = tmp / "conf"
    conf.mkdir(parents=True, exist_ok=True)
    make_repo(conf / "repos" / "calc.git")
    (conf / "script.yaml").write_text("responses: []\n")
    (conf / "afe.yaml").write_text(textwrap.dedent(f"""\
        kind: Workspace
        name: ws
        repo: repos/calc.git
        baseBranch: main
        forge: {{type: local}}
        ---
        kind: Model
        name: scripted
        provider: replay
        script: script.yaml
        ---
        kind: McpServer
        name: tracker
        url: {url}
        tokenEnv: TRACKER_TOKEN
        timeout: 10
        ---
        kind: Workflow
        name: triage
        workspace: ws
        nodes:
          - {{id: plan, model: scripted, prompt: "Plan", tools: [read_file, "mcp:tracker/{tool}"]}}
        """))
    return conf


def _check(capsys, conf: Path, *extra: str) -> tuple[int, str, str]:
    code = main(["check", "--config", str(conf), *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def token() -> str:
    return "canary-mcp-" + secrets.token_hex(16)


def test_check_online_lists_the_tools_of_each_mcp_server(tmp_path, capsys, monkeypatch, token):
    with mcp_server(token) as srv:
        monkeypatch.setenv("TRACKER_TOKEN", token)
        code, out, err = _check(capsys, _config(tmp_path, srv.url), "--online")
        assert code == 0, err
        assert f"MCP server tracker ({srv.url}): 6 tool(s) reachable: {TOOLS}" in out
        assert srv.bearers == [token] * len(srv.bearers) and srv.bearers   # asked, with the token
        assert token not in out + err


def test_check_without_online_does_not_contact_the_server(tmp_path, capsys, monkeypatch, token):
    with mcp_server(token) as srv:
        monkeypatch.setenv("TRACKER_TOKEN", token)
        code, out, err = _check(capsys, _config(tmp_path, srv.url))
        assert code == 0, err
        assert "MCP server tracker: " + srv.url + " not contacted; `afe check --online` lists its tools" in out
        assert srv.bearers == []


def test_check_online_names_a_refused_token_without_showing_it(tmp_path, capsys, monkeypatch, token):
    with mcp_server(token) as srv:
        monkeypatch.setenv("TRACKER_TOKEN", "wrong-" + token[::-1])
        code, out, err = _check(capsys, _config(tmp_path, srv.url), "--online")
        assert code == 1
        assert ("McpServer tracker: MCP server tracker refused the request (HTTP 401) with the token in "
                "TRACKER_TOKEN; check the token's value") in err
        assert token[::-1] not in out + err


def test_check_online_names_an_unset_token_and_an_unreachable_server(tmp_path, capsys, monkeypatch, token):
    with mcp_server(token) as srv:
        monkeypatch.delenv("TRACKER_TOKEN", raising=False)
        code, _, err = _check(capsys, _config(tmp_path, srv.url), "--online")
        assert code == 1 and "McpServer tracker: TRACKER_TOKEN is not set in this shell; export it" in err, err
        assert srv.bearers == []
    monkeypatch.setenv("TRACKER_TOKEN", token)
    down = "http://127.0.0.1:1/mcp"
    code, _, err = _check(capsys, _config(tmp_path / "down", down), "--online")
    assert code == 1
    assert f"cannot reach MCP server tracker at {down} (ConnectError); check the url:, the network" in err, err


def test_check_online_refuses_a_grant_of_a_tool_the_server_lacks(tmp_path, capsys, monkeypatch, token):
    with mcp_server(token) as srv:
        monkeypatch.setenv("TRACKER_TOKEN", token)
        code, out, err = _check(capsys, _config(tmp_path, srv.url, tool="get_isue"), "--online")
        assert code == 1
        assert "node plan tools: mcp:tracker/get_isue is not a tool of McpServer tracker" in err, err
        assert f"6 tool(s) reachable: {TOOLS}" in out            # what it offers, to fix the name against


def test_doctor_lists_each_mcp_servers_tools_from_the_host(tmp_path, capsys, monkeypatch, token):
    with mcp_server(token) as srv:
        config = load_config(_config(tmp_path, srv.url))
        monkeypatch.setenv("TRACKER_TOKEN", token)
        report = Report()
        asyncio.run(_mcp_servers(report, config))
        assert report.lines == [("MCP server tracker", True,
                                 f"MCP server tracker ({srv.url}): 6 tool(s) reachable: {TOOLS}")]
        monkeypatch.setenv("TRACKER_TOKEN", "wrong")
        report = Report()
        asyncio.run(_mcp_servers(report, config))
        assert report.failed and "refused the request (HTTP 401)" in report.lines[0][2]
        monkeypatch.delenv("TRACKER_TOKEN")
        report = Report()
        asyncio.run(_mcp_servers(report, config))
        assert report.lines == [] and "info MCP server tracker: not contacted: TRACKER_TOKEN is not set" in \
            capsys.readouterr().out
