"""R43 in the credential broker, for afe's own model nodes (docs/MCP.md):
the broker lists a model node's granted MCP tools and calls them with the
token only it holds (mcpnodes.py, mcpclient.py), against a REAL MCP server on
the official `mcp` SDK on loopback that requires a bearer token
(tests/support/mcpserver.py). The grant comes from the broker's own
manifests; a tool outside it is refused before any request; answers are
bounded in size and time; a redirect off the server's origin is not
followed; each call is fenced (R37). The last test goes through the real
servicer over gRPC with the scheduler's client."""

from __future__ import annotations

import json
import logging
import secrets
import textwrap
import time
from pathlib import Path

import pytest

from services.common.config.manifests import load_config
from services.common.config.model import Config
from services.common.demo import make_repo
from services.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
)
from services.common.layout import Layout
from services.common.mcpclient import MAX_ARGUMENTS_BYTES, McpClient
from services.credentials.fencing.resource import Fences, StaleFence
from services.credentials.mcptools.nodes import ModelNodeMcp
from services.scheduler.sandboxes.brokers import CredentialsClient
from tests.support.credential_broker import credential_broker
from tests.support.mcpserver import INJECTION, mcp_server, redirecting_server

pytestmark = pytest.mark.timeout(120)


def _config(root: Path, url: str, transport: str = "http") -> Config:
    conf = root / "conf"
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
        transport: {transport}
        tokenEnv: TRACKER_TOKEN
        timeout: 3
        ---
        kind: Workflow
        name: triage
        workspace: ws
        nodes:
          - {{id: plan, model: scripted, prompt: "Plan",
              tools: [read_file, "mcp:tracker/get_issue", "mcp:tracker/big", "mcp:tracker/slow",
                      "mcp:tracker/inject", "mcp:tracker/gone"]}}
          - {{id: test, run: "true", needs: [plan]}}
        ---
        kind: Workflow
        name: cleanup
        workspace: ws
        nodes:
          - {{id: plan, model: scripted, prompt: "Clean", tools: ["mcp:tracker/delete_issue"]}}
        """))
    return load_config(conf)


def _broker(config: Config, token: str | None, **kw) -> ModelNodeMcp:
    return ModelNodeMcp(config, McpClient({"TRACKER_TOKEN": token}.get if token else (lambda _: None), **kw),
                        Fences(None))


@pytest.fixture
def token() -> str:
    return "canary-mcp-" + secrets.token_hex(16)


async def test_r43_broker_lists_the_granted_tools_only_and_names_the_missing(tmp_path, token):
    with mcp_server(token) as srv:
        listed = await _broker(_config(tmp_path, srv.url), token).list_tools("t1", "triage", "plan")
    assert [(s, t.name) for s, t in listed.tools] == [("tracker", "get_issue"), ("tracker", "big"),
                                                     ("tracker", "slow"), ("tracker", "inject")]
    assert listed.missing == [("tracker", "gone")]          # granted, not offered: named, not hidden
    schema = json.loads(listed.tools[0][1].input_schema_json)
    assert schema["type"] == "object" and "number" in schema["properties"]
    assert srv.bearers and set(srv.bearers) == {token}      # the broker added the token


async def test_r43_tool_outside_the_grant_is_refused_before_any_request(tmp_path, token):
    with mcp_server(token) as srv:
        config = _config(tmp_path, srv.url)
        broker = _broker(config, token)
        for workflow, node, tool in [("triage", "plan", "delete_issue"), ("triage", "plan", "get_issue "),
                                     ("triage", "plan", "GET_ISSUE"), ("triage", "plan", "tracker/get_issue")]:
            with pytest.raises(PermissionDenied, match="is not granted to node"):
                await broker.call_tool("t1", workflow, node, "tracker", tool, '{"number": 7}')
        with pytest.raises(FailedPrecondition, match="is a run node"):
            await broker.call_tool("t1", "triage", "test", "tracker", "get_issue", '{"number": 7}')
        assert srv.calls == [] and srv.bearers == []         # the server never heard of them
        # positive control: the node whose grant names delete_issue gets it called
        r = await broker.call_tool("t1", "cleanup", "plan", "tracker", "delete_issue", '{"number": 7}')
        assert r.text == "deleted issue 7" and not r.is_error and r.bytes > len(r.text)
        assert srv.calls == [("delete_issue", {"number": 7})]


async def test_r43_the_server_requires_the_token_and_only_the_broker_sends_it(tmp_path, token, caplog):
    caplog.set_level(logging.DEBUG)
    with mcp_server(token) as srv:
        config = _config(tmp_path, srv.url)
        r = await _broker(config, token).call_tool("t1", "triage", "plan", "tracker", "get_issue", '{"number": 7}')
        assert "Issue 7" in r.text and srv.bearers[-1] == token
        # positive control: without the broker's token the server refuses (it really requires one)
        with pytest.raises(FailedPrecondition, match=r"refused the request \(HTTP 401\) with the token in "
                                                     "TRACKER_TOKEN"):
            await _broker(config, "wrong").call_tool("t1", "triage", "plan", "tracker", "get_issue", "{}")
        with pytest.raises(FailedPrecondition, match="TRACKER_TOKEN is not set"):
            await _broker(config, None).call_tool("t1", "triage", "plan", "tracker", "get_issue", "{}")
    assert srv.calls == [("get_issue", {"number": 7})]
    assert token not in caplog.text and "Issue 7" not in caplog.text   # neither the token nor a result logged


async def test_r43_answers_are_bounded_in_size_and_time(tmp_path, token):
    with mcp_server(token) as srv:
        broker = _broker(_config(tmp_path, srv.url), token, max_response_bytes=100_000)
        small = await broker.call_tool("t1", "triage", "plan", "tracker", "big", '{"size": 1000}')
        assert small.text == "x" * 1000                       # positive control: a small answer passes
        with pytest.raises(ResourceExhausted, match="over 100000 bytes"):
            await broker.call_tool("t1", "triage", "plan", "tracker", "big", '{"size": 500000}')
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="did not answer tools/call within 3 s"):
            await broker.call_tool("t1", "triage", "plan", "tracker", "slow", '{"seconds": 30}')
        assert time.monotonic() - started < 6
        with pytest.raises(InvalidArgument, match="over 65536 bytes"):
            await broker.call_tool("t1", "triage", "plan", "tracker", "get_issue",
                                   json.dumps({"number": 1, "pad": "p" * MAX_ARGUMENTS_BYTES}))
        assert [c[0] for c in srv.calls] == ["big", "big", "slow"]     # the oversized arguments never left
        # a result that tries to close a quoted block is returned as it is: quoting is the scheduler's (R36)
        r = await broker.call_tool("t1", "triage", "plan", "tracker", "inject", "{}")
        assert r.text == INJECTION


async def test_r43_a_redirect_off_the_servers_origin_is_not_followed(tmp_path, token):
    with mcp_server(token) as elsewhere, redirecting_server(elsewhere.url) as url:
        with pytest.raises(FailedPrecondition, match=r"with a redirect \(HTTP 307\) off http://127\.0\.0\.1:\d+/mcp; "
                                                     "afe follows none that leaves the server's origin"):
            await _broker(_config(tmp_path, url), token).list_tools("t1", "triage", "plan")
        assert elsewhere.bearers == []                        # the token never went to the other origin
        # positive control: the same server named directly answers
        listed = await _broker(_config(tmp_path / "direct", elsewhere.url), token).list_tools("t1", "triage", "plan")
        assert listed.tools and elsewhere.bearers == [token] * len(elsewhere.bearers)


async def test_r43_mcp_calls_are_fenced(tmp_path, token):
    with mcp_server(token) as srv:
        broker = _broker(_config(tmp_path, srv.url), token)
        await broker.call_tool("t1", "cleanup", "plan", "tracker", "delete_issue", '{"number": 1}', fence=5)
        with pytest.raises(StaleFence):
            await broker.call_tool("t1", "cleanup", "plan", "tracker", "delete_issue", '{"number": 2}', fence=4)
        assert srv.calls == [("delete_issue", {"number": 1})]


async def test_r43_sse_transport_lists_and_calls(tmp_path, token):
    with mcp_server(token, transport="sse") as srv:
        broker = _broker(_config(tmp_path, srv.sse_url, transport="sse"), token)
        listed = await broker.list_tools("t1", "triage", "plan")
        r = await broker.call_tool("t1", "triage", "plan", "tracker", "get_issue", '{"number": 3}')
    assert [t.name for _, t in listed.tools] == ["get_issue", "big", "slow", "inject"]
    assert "Issue 3" in r.text and set(srv.bearers) == {token}


async def test_r43_list_and_call_over_grpc_through_the_real_servicer(tmp_path, token):
    layout = Layout(tmp_path / "data", tmp_path / "run")
    with mcp_server(token) as srv:
        config = _config(tmp_path, srv.url)
        async with credential_broker(config, layout, secrets={"TRACKER_TOKEN": token}) as (sock, key):
            client = CredentialsClient(sock, key)
            try:
                listed = await client.list_mcp_tools("t1", "triage", "plan")
                assert [t.name for t in listed.tools] == ["get_issue", "big", "slow", "inject"]
                assert [(m.server, m.tool) for m in listed.missing] == [("tracker", "gone")]
                r = await client.call_mcp_tool("t1", "triage", "plan", "tracker", "get_issue", '{"number": 7}',
                                               0, 10)
                assert "Issue 7" in r.text and not r.is_error
                with pytest.raises(PermissionDenied, match="not granted"):
                    await client.call_mcp_tool("t1", "triage", "plan", "tracker", "delete_issue", "{}", 0, 10)
            finally:
                await client.close()
    assert srv.calls == [("get_issue", {"number": 7})]
