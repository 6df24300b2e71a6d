"""`kind: McpServer` manifests (docs/MCP.md): a remote server (Streamable
HTTP, or SSE) with a credential named by tokenEnv (bearer or a named header),
or a stdio server run inside the sandbox with no secret; the tools a
Workflow's agents (`mcp:`) and a model node (`tools: [mcp:SERVER/TOOL]`) may
call. They load into the runtime objects the MCP relay is built on; every
mistake is refused with what to write; the credential reaches the credential
broker and nothing else (R43)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config.manifests import load_config, missing_env
from services.common.config.model import McpGrant
from services.common.errors import ConfigError
from services.launcher.environment import SERVICES, child_env

SERVERS = """\
kind: Workspace
name: ws
repo: https://git.example.com/acme/shop.git
---
kind: Model
name: gpt
provider: openai
model: gpt-4.1
apiKeyEnv: OPENAI_KEY_FOR_AFE
---
kind: McpServer
name: tracker
url: https://mcp.tracker.example.com/mcp
tokenEnv: TRACKER_TOKEN
---
kind: McpServer
name: monitor
url: https://mcp.monitor.example.com/sse
transport: sse
tokenEnv: MONITOR_KEY
header: X-Api-Key
timeout: 30
---
kind: McpServer
name: local
url: http://127.0.0.1:8931/mcp
---
kind: McpServer
name: git
command: [mcp-server-git, --repository, /workspace]
---
kind: Agent
name: coder
type: acp
command: [coder-acp]
env: [CODER_SETTING]
---
"""
WORKFLOW = """\
kind: Workflow
name: wf
workspace: ws
mcp: {tracker: [get_issue, search_issues], git: all}
nodes:
  - {id: plan, model: gpt, prompt: p, tools: [read_file, mcp:tracker/get_issue, mcp:monitor/get_event, mcp:tracker/list_labels]}
  - {id: code, agent: coder, prompt: c, needs: [plan]}
  - {id: test, run: "true", needs: [code]}
"""


def load(tmp: Path, text: str):
    (tmp / "afe.yaml").write_text(text)
    return load_config(tmp)


def errors(tmp: Path, text: str) -> str:
    (tmp / "afe.yaml").write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(tmp)
    return str(info.value)


def test_mcp_servers_and_grants_load_into_the_runtime_config(tmp_path):
    cfg = load(tmp_path, SERVERS + WORKFLOW)
    tracker, monitor, local, git = (cfg.mcp_servers[n] for n in ("tracker", "monitor", "local", "git"))
    assert (tracker.transport, tracker.url, tracker.token_env, tracker.header, tracker.timeout_s) == (
        "http", "https://mcp.tracker.example.com/mcp", "TRACKER_TOKEN", None, 60.0)
    assert tracker.remote and tracker.auth_header("t0k") == ("Authorization", "Bearer t0k")
    assert (monitor.transport, monitor.header, monitor.timeout_s) == ("sse", "X-Api-Key", 30.0)
    assert monitor.auth_header("t0k") == ("X-Api-Key", "t0k")
    assert local.url == "http://127.0.0.1:8931/mcp" and local.token_env is None
    assert (git.transport, git.command, git.remote, git.url) == (
        "stdio", ("mcp-server-git", "--repository", "/workspace"), False, "")
    wf = cfg.workflows["wf"]
    assert wf.mcp == (McpGrant("tracker", ("get_issue", "search_issues")), McpGrant("git", ("all",)))
    plan = wf.node("plan")
    assert plan.tools == ("read_file",)                                   # afe's own tools, as before
    assert plan.mcp == (McpGrant("tracker", ("get_issue", "list_labels")), McpGrant("monitor", ("get_event",)))
    assert wf.mcp_grants("plan") == plan.mcp and wf.mcp_grants("code") == wf.mcp
    assert wf.mcp_grants("test") == () and wf.mcp_grants() == wf.mcp
    assert wf.mcp_server_names() == ("git", "monitor", "tracker")
    tracker_grant = wf.mcp[0]
    assert tracker_grant.allows("get_issue") and not tracker_grant.allows("delete_issue")
    assert wf.mcp[1].allows("anything")                                  # a stdio server's `all`


def test_r43_an_mcp_token_reaches_the_credential_broker_and_no_other_process(tmp_path):
    cfg = load(tmp_path, SERVERS + WORKFLOW)
    assert cfg.credential_env_names() == ["MONITOR_KEY", "OPENAI_KEY_FOR_AFE", "TRACKER_TOKEN"]
    environ = {"PATH": "/usr/bin:/bin", "TRACKER_TOKEN": "tracker-canary", "MONITOR_KEY": "monitor-canary",
               "OPENAI_KEY_FOR_AFE": "k", "CODER_SETTING": "plain"}
    creds = child_env("credentials", cfg, environ)
    assert creds["TRACKER_TOKEN"] == "tracker-canary" and creds["MONITOR_KEY"] == "monitor-canary"
    for service in SERVICES:
        if service != "credentials":
            env = child_env(service, cfg, environ)
            assert not {"tracker-canary", "monitor-canary"} & set(env.values()), service
    # control: the sandbox broker does receive what an agent declares, so the absence above is the rule's
    assert child_env("sandbox", cfg, environ)["CODER_SETTING"] == "plain"
    # `afe up` refuses to start while a server's tokenEnv is unset, naming the manifest
    unset = missing_env(cfg, {k: v for k, v in environ.items() if k != "TRACKER_TOKEN"})
    assert unset == [("TRACKER_TOKEN", "afe.yaml#3 McpServer tracker tokenEnv")]


def test_afe_check_counts_the_mcp_servers(tmp_path, capsys):
    from services.cli.main import main

    (tmp_path / "afe.yaml").write_text(SERVERS + WORKFLOW)
    assert main(["check", "--config", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 agent(s), 4 MCP server(s), 1 workflow(s)" in out
    assert "TRACKER_TOKEN is not set in this shell (afe.yaml#3 McpServer tracker tokenEnv)" in out


def _server(body: str) -> str:
    return "kind: McpServer\nname: bad\n" + body


# (the document, the field and what the error says)
BAD_SERVERS = [
    ("plain-http", _server("url: http://mcp.example.com/mcp\n"), "url", "must be an https:// URL"),
    ("userinfo", _server("url: https://me@mcp.example.com/mcp\n"), "url", "must not hold credentials"),
    ("fragment", _server("url: https://mcp.example.com/mcp#x\n"), "url", "must not have a #fragment"),
    ("empty-url", _server("url:\n"), "url", "is empty; write the server's MCP endpoint"),
    ("neither", _server("tokenEnv: T\n"), "url", "add url: https://… (a remote MCP server"),
    ("both", _server("url: https://m.example.com/mcp\ncommand: [x]\n"), "command", "not both"),
    ("stdio-token", _server("command: [x]\ntokenEnv: T\n"), "tokenEnv",
     "a stdio server runs inside the sandbox, where no credential may go (R43)"),
    ("stdio-env", _server("command: [x]\nenv: [T]\n"), "env", "an MCP server gets no variable from afe's"),
    ("stdio-header", _server("command: [x]\nheader: X-Api-Key\n"), "header", "only a remote server"),
    ("stdio-timeout", _server("command: [x]\ntimeout: 5\n"), "timeout", "only a remote server's requests"),
    ("stdio-sse", _server("command: [x]\ntransport: sse\n"), "transport", "sse needs url:"),
    ("url-stdio", _server("url: https://m.example.com/mcp\ntransport: stdio\n"), "transport",
     "stdio is for a server run inside the sandbox"),
    ("transport", _server("url: https://m.example.com/mcp\ntransport: websocket\n"), "transport",
     "is not one of: http, sse, stdio"),
    ("header-no-token", _server("url: https://m.example.com/mcp\nheader: X-Api-Key\n"), "header",
     "tokenEnv:, which is missing"),
    ("header-authorization", _server("url: https://m.example.com/mcp\ntokenEnv: T\nheader: Authorization\n"),
     "header", "leave header: out to send Authorization: Bearer <token>"),
    ("header-host", _server("url: https://m.example.com/mcp\ntokenEnv: T\nheader: Host\n"), "header",
     "a header the relay sets itself"),
    ("header-session", _server("url: https://m.example.com/mcp\ntokenEnv: T\nheader: mcp-session-id\n"),
     "header", "a header the relay sets itself"),
    ("header-space", _server("url: https://m.example.com/mcp\ntokenEnv: T\nheader: X Api\n"), "header",
     "is not a header name"),
    ("token-value", _server("url: https://m.example.com/mcp\ntokenEnv: lower\n"), "tokenEnv",
     "write the NAME of an environment variable"),
    ("timeout", _server("url: https://m.example.com/mcp\ntimeout: 9999\n"), "timeout", "at most 600 seconds"),
    ("unknown", _server("url: https://m.example.com/mcp\nheaders: {a: b}\n"), "headers", "unknown field"),
    ("secret-arg", _server("command: [srv, --token, ghp_A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8]\n"),
     "command[2]", "looks like a secret"),
]


@pytest.mark.parametrize(("case", "doc", "field", "expected"), BAD_SERVERS, ids=[c[0] for c in BAD_SERVERS])
def test_a_bad_mcp_server_is_refused_saying_what_to_write(tmp_path, case, doc, field, expected):
    msg = errors(tmp_path, SERVERS + WORKFLOW + "---\n" + doc)
    assert f"afe.yaml#9 {field}: " in msg and expected in msg, msg
    assert "ghp_A1b2" not in msg


def _workflow(mcp: str = "", tools: str = "[read_file]", agent: bool = True) -> str:
    return ("kind: Workflow\nname: wf\nworkspace: ws\n" + mcp + "nodes:\n"
            f"  - {{id: plan, model: gpt, prompt: p, tools: {tools}}}\n"
            + ("  - {id: code, agent: coder, prompt: c}\n" if agent else ""))


BAD_GRANTS = [
    ("unknown-server", _workflow("mcp: {nope: [x]}\n"), ("mcp.nope: no McpServer named 'nope'; defined: git, "
                                                        "local, monitor, tracker")),
    ("remote-all", _workflow("mcp: {tracker: all}\n"), "mcp.tracker: list the tools the agents may call"),
    ("stdio-list", _workflow("mcp: {git: [git_status]}\n"), ("mcp.git: McpServer 'git' runs inside the sandbox "
                                                            "(command:), where afe cannot filter its tools; "
                                                            "write git: all")),
    ("empty", _workflow("mcp: {tracker: []}\n"), "mcp.tracker: list the tools the agents may call"),
    ("not-a-list", _workflow("mcp: {tracker: get_issue}\n"), "mcp.tracker: list the tools"),
    ("tool-name", _workflow("mcp: {tracker: [get/issue]}\n"), ("mcp.tracker[0]: 'get/issue' is not valid; "
                                                              "write an MCP tool's name")),
    ("all-in-list", _workflow("mcp: {git: [all]}\n"), "mcp.git: 'all' is the whole value"),
    ("no-agents", _workflow("mcp: {tracker: [get_issue]}\n", agent=False), ("mcp: grants MCP tools to this "
                                                                           "workflow's agent nodes")),
    ("node-no-tool", _workflow(tools="[mcp:tracker]"), ("nodes[0].tools[0]: 'mcp:tracker' is not one of afe's "
                                                       "tools; write mcp:SERVER/TOOL")),
    ("node-stdio", _workflow(tools="[mcp:git/status]"), ("nodes[0].tools: mcp:git/…: McpServer 'git' runs "
                                                        "inside the sandbox (command:), for agents only")),
    ("node-unknown", _workflow(tools="[mcp:nope/x]"), "nodes[0].tools: mcp:nope/…: no McpServer named 'nope'"),
    ("node-shell", _workflow(tools="[read_file, shell]"), "nodes[0].tools[1]: 'shell' is not one of afe's tools"),
]


@pytest.mark.parametrize(("case", "workflow", "expected"), BAD_GRANTS, ids=[c[0] for c in BAD_GRANTS])
def test_a_bad_mcp_grant_is_refused_saying_what_to_write(tmp_path, case, workflow, expected):
    msg = errors(tmp_path, SERVERS + workflow)
    assert f"afe.yaml#8 {expected}" in msg, msg


def test_the_grants_control_loads(tmp_path):
    """The control of the two tables: the same folder with good grants loads."""
    cfg = load(tmp_path, SERVERS + _workflow("mcp: {tracker: [get_issue], git: all}\n",
                                             tools="[read_file, mcp:local/echo]"))
    assert cfg.workflows["wf"].mcp_server_names() == ("git", "local", "tracker")


def test_mcp_servers_are_in_the_manifest_schema():
    from jsonschema import Draft202012Validator

    from services.common.schema import manifest_json_schema

    v = Draft202012Validator(manifest_json_schema())
    good = {"kind": "McpServer", "name": "tracker", "url": "https://m.example.com/mcp", "tokenEnv": "T"}
    assert not list(v.iter_errors(good))
    assert not list(v.iter_errors({"kind": "McpServer", "name": "git", "command": ["srv"]}))
    assert list(v.iter_errors({"kind": "McpServer", "name": "x"}))                  # neither url nor command
    assert list(v.iter_errors({**good, "command": ["srv"]}))                         # both
    assert list(v.iter_errors({**good, "transport": "websocket"}))
    wf = {"kind": "Workflow", "name": "w", "mcp": {"tracker": ["get_issue"], "git": "all"},
          "nodes": [{"id": "p", "model": "m", "prompt": "p", "tools": ["read_file", "mcp:tracker/get_issue"]}]}
    assert not list(v.iter_errors(wf))
    wf["nodes"][0]["tools"] = ["mcp:tracker"]
    assert list(v.iter_errors(wf))
