"""R43, the MCP relay's key-holding half on the host: the real RelayHub on a
real Unix socket in front of a real MCP server (the official `mcp` SDK,
tests/support/mcptracker.py) that requires a bearer token (or a named
header). The agent's side speaks MCP Streamable HTTP with the ticket's
capability; the server sees the token and never the capability; granted
tools work, others never reach the server; tool lists are cut; an echoed
token is masked; another ticket's capability, an ended ticket, a redirect,
oversized bodies and answers and a slow server are refused or cut, each
with its positive control (the same thing done directly, or allowed).
What the sandbox adds (the forwarder, no token in the container) and the
real agent are in tests/agents/test_r43_real_agent_mcp.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from services.common.config.model import Config, McpServer
from services.common.layout import Layout
from services.common.relayenv import RELAY_SOCKET
from services.common.secrecy.env_secrets import SecretValue
from services.common.secrecy.redact import Redactor
from services.credentials.mcptools.filter import canonical_digest
from services.credentials.relay.server import RelayHub
from tests.support.mcptracker import tracker

TOKEN = "canary-mcp-" + secrets.token_hex(16)
TOKEN_ENV = "R43_TRACKER_TOKEN"
GRANT = {"tracker": ["get_issue", "whoami", "big", "slow"]}
INIT = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {"sampling": {}}, "clientInfo": {"name": "t", "version": "1"}}}
ACCEPT = "application/json, text/event-stream"


def _hub(tmp: Path, servers: dict[str, McpServer]) -> RelayHub:
    layout = Layout(tmp / "data", tmp / "run")
    layout.ensure()
    return RelayHub(Config(directory=tmp, mcp_servers=servers), layout, {TOKEN_ENV: SecretValue(TOKEN_ENV, TOKEN)},
                    Redactor([TOKEN]), state_dir=tmp / "state")


@pytest.fixture
def srv():
    with tracker(TOKEN) as s:
        yield s


@pytest.fixture
async def hub(tmp_path, srv):
    h = _hub(tmp_path, {"tracker": McpServer("tracker", "http", url=srv.url, token_env=TOKEN_ENV, timeout_s=5)})
    yield h
    await h.aclose()


class Session:
    """An MCP client of the tests' own over the ticket's socket (what the forwarder carries)."""

    def __init__(self, http: aiohttp.ClientSession, base: str, cap: str) -> None:
        self.http, self.base, self.cap, self.sid = http, base, cap, ""

    def headers(self) -> dict[str, str]:
        h = {"Authorization": f"Bearer {self.cap}", "Accept": ACCEPT}
        if self.sid:
            h["Mcp-Session-Id"] = self.sid
        return h

    async def post(self, doc, *, raw: bytes | None = None) -> tuple[int, object]:
        async with self.http.post(self.base, data=raw if raw is not None else json.dumps(doc).encode(),
                                  headers={**self.headers(), "Content-Type": "application/json"}) as r:
            self.sid = r.headers.get("Mcp-Session-Id", self.sid)
            text = await r.text()
            if r.content_type == "text/event-stream":
                msgs = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
                return r.status, msgs[0] if len(msgs) == 1 else msgs
            return r.status, json.loads(text) if text else None

    async def start(self) -> None:
        status, init = await self.post(INIT)
        assert status == 200, init
        assert (await self.post({"jsonrpc": "2.0", "method": "notifications/initialized"}))[0] == 202

    async def call(self, name: str, args: dict, id_: int = 1) -> tuple[int, dict]:
        status, doc = await self.post({"jsonrpc": "2.0", "id": id_, "method": "tools/call",
                                       "params": {"name": name, "arguments": args}})
        assert isinstance(doc, dict)
        return status, doc


def _relay(hub: RelayHub, ticket: str, cap: str, server: str = "tracker") -> tuple[aiohttp.ClientSession, Session]:
    http = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(hub.layout.relay_dir(ticket) / RELAY_SOCKET)))
    return http, Session(http, f"http://relay/mcp/{server}", cap)


def _direct(url: str) -> tuple[aiohttp.ClientSession, Session]:
    """Positive controls: straight to the server, with its token (what the relay keeps out of the sandbox)."""
    http = aiohttp.ClientSession()
    return http, Session(http, url, TOKEN)


def _text(answer: dict) -> str:
    return " ".join(c.get("text", "") for c in answer["result"]["content"])


@pytest.mark.slow
async def test_r43_a_granted_tool_call_reaches_the_server_and_the_token_stays_in_the_broker(hub, srv):
    cap = await hub.open("t1", [], 0, GRANT)
    http, s = _relay(hub, "t1", cap)
    async with http:
        await s.start()
        status, listed = await s.post({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
        assert status == 200
        assert sorted(t["name"] for t in listed["result"]["tools"]) == ["big", "get_issue", "slow", "whoami"]
        status, answer = await s.call("get_issue", {"number": 7})
        assert status == 200 and "login page returns 500" in _text(answer), answer
        # the server's own stream (GET) and the end of the session (DELETE) pass too
        async with http.get(s.base, headers=s.headers()) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
        async with http.delete(s.base, headers=s.headers()) as r:
            assert r.status in (200, 204)
    assert srv.calls == [("get_issue", {"number": 7})]
    # the server saw the token on every request and never the capability (nor the client's own headers)
    assert srv.requests and all(h.get("authorization") == f"Bearer {TOKEN}" for _, h in srv.requests)
    assert not [h for _, h in srv.requests if cap in json.dumps(h)]
    # the call is on the record: names, the arguments' digest, outcome and sizes, not the arguments
    calls, total = hub.mcp_calls("t1")
    assert total == 1 and len(calls) == 1
    c = calls[0]
    assert (c["seq"], c["server"], c["tool"], c["outcome"]) == (1, "tracker", "get_issue", "ok")
    assert c["arguments_sha256"] == canonical_digest({"number": 7}) and c["response_bytes"] > 0
    assert "login page" not in json.dumps(calls)
    # positive control: the server lists more tools to a client holding its token
    http2, d = _direct(srv.url)
    async with http2:
        await d.start()
        _, direct = await d.post({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
    assert {"delete_issue", "search_issues"} <= {t["name"] for t in direct["result"]["tools"]}


async def test_r43_a_tool_outside_the_allowlist_never_reaches_the_server(hub, srv):
    cap = await hub.open("t2", [], 0, GRANT)
    http, s = _relay(hub, "t2", cap)
    async with http:
        await s.start()
        for i, name in enumerate(["delete_issue", "Delete_Issue", "tracker/delete_issue",
                                  "mcp__tracker__delete_issue", "delete_issue\u0000"]):
            status, answer = await s.call(name, {"number": 7}, id_=10 + i)
            assert status == 200 and answer["id"] == 10 + i
            assert answer["error"]["code"] == -32602 and "not granted" in answer["error"]["message"]
        status, batch = await s.post([{"jsonrpc": "2.0", "id": 20, "method": "tools/call",
                                       "params": {"name": "get_issue", "arguments": {"number": 1}}},
                                      {"jsonrpc": "2.0", "id": 21, "method": "tools/call",
                                       "params": {"name": "delete_issue", "arguments": {"number": 1}}}])
        assert isinstance(batch, list) and {a["id"] for a in batch} == {20, 21}
        assert all("error" in a for a in batch)
        status, dup = await s.post(None, raw=b'{"jsonrpc":"2.0","id":30,"method":"tools/call","params":'
                                             b'{"name":"delete_issue","name":"get_issue","arguments":{"number":1}}}')
        assert status == 400 and "twice" in dup["error"]["message"]
        status, res = await s.post({"jsonrpc": "2.0", "id": 31, "method": "resources/list"})
        assert res["error"]["code"] == -32601
    assert [c for c in srv.calls if c[0] == "delete_issue"] == []
    assert srv.calls == []      # not even the batch's granted call
    calls, _ = hub.mcp_calls("t2")
    assert [c["outcome"] for c in calls] == ["refused"] * 8
    assert [c["tool"] for c in calls[:5]] == ["delete_issue", "Delete_Issue", "", "mcp__tracker__delete_issue", ""]
    # positive control: with the token, straight to the server, the same call deletes
    http2, d = _direct(srv.url)
    async with http2:
        await d.start()
        _, answer = await d.call("delete_issue", {"number": 7})
    assert "deleted issue 7" in _text(answer) and srv.calls == [("delete_issue", {"number": 7})]


async def test_r43_a_token_the_server_echoes_is_masked(hub, srv):
    cap = await hub.open("t3", [], 0, GRANT)
    http, s = _relay(hub, "t3", cap)
    async with http:
        await s.start()
        _, answer = await s.call("whoami", {})
    assert TOKEN not in json.dumps(answer) and "[redacted]" in _text(answer)
    http2, d = _direct(srv.url)                 # positive control: the server does echo it
    async with http2:
        await d.start()
        _, direct = await d.call("whoami", {})
    assert TOKEN in _text(direct)


@pytest.mark.slow
async def test_r43_another_tickets_capability_and_an_ended_ticket_are_refused(hub, srv):
    cap_a = await hub.open("ta", [], 0, GRANT)
    cap_b = await hub.open("tb", [], 0, GRANT)
    http, s = _relay(hub, "ta", cap_b)             # B's capability on A's relay
    async with http:
        status, answer = await s.post(INIT)
        assert status == 401 and "capability" in answer["error"]["message"]
        s.cap = cap_a                                # positive control: A's own works
        await s.start()
        assert (await s.call("get_issue", {"number": 1}))[0] == 200
    sock = hub.layout.relay_dir("ta") / RELAY_SOCKET
    reader, writer = await asyncio.open_unix_connection(str(sock))   # kept open across the ticket's end
    await hub.close("ta")
    assert not sock.exists()
    body = json.dumps(INIT).encode()
    req = (f"POST /mcp/tracker HTTP/1.1\r\nHost: r\r\nAuthorization: Bearer {cap_a}\r\nAccept: {ACCEPT}\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    before = len(srv.requests)
    with pytest.raises((ConnectionError, OSError, asyncio.IncompleteReadError)):
        writer.write(req)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 401"), head
        raise ConnectionError("refused")
    writer.close()
    assert len(srv.requests) == before
    cap_a2 = await hub.open("ta", [], 0, GRANT)      # the ticket again: a new capability, the old one refused
    http, s = _relay(hub, "ta", cap_a)
    async with http:
        assert (await s.post(INIT))[0] == 401
        s.cap = cap_a2
        assert (await s.post(INIT))[0] == 200


async def test_r43_a_server_not_granted_to_the_ticket_is_refused(hub, srv):
    cap = await hub.open("t4", [], 0, GRANT)
    http, s = _relay(hub, "t4", cap, server="other")
    async with http:
        status, answer = await s.post(INIT)
    assert status == 404 and "not granted" in answer["error"]["message"]
    assert srv.requests == []


async def test_r43_a_redirect_is_not_followed(tmp_path):
    stolen: list[dict] = []

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(f"http://127.0.0.1:{elsewhere.port}/steal")

    async def steal(request: web.Request) -> web.Response:
        stolen.append(dict(request.headers))
        return web.json_response({"jsonrpc": "2.0", "id": 0, "result": {}})

    from tests.support.fakes.base import FakeServer

    class Redirecting(FakeServer):
        def routes(self, app: web.Application) -> None:
            app.router.add_route("*", "/mcp", redirect)

    class Elsewhere(FakeServer):
        def routes(self, app: web.Application) -> None:
            app.router.add_route("*", "/steal", steal)

    async with Elsewhere() as elsewhere, Redirecting() as redir:
        h = _hub(tmp_path, {"tracker": McpServer("tracker", "http", url=f"{redir.url}/mcp", token_env=TOKEN_ENV)})
        try:
            cap = await h.open("t5", [], 0, GRANT)
            http, s = _relay(h, "t5", cap)
            async with http:
                status, answer = await s.post(INIT)
            assert status == 502 and "redirect" in answer["error"]["message"]
            assert stolen == []
            # positive control: a client that follows redirects lands on the other URL
            async with aiohttp.ClientSession() as direct, direct.post(f"{redir.url}/mcp", json=INIT) as r:
                assert r.status == 200
            assert len(stolen) == 1
        finally:
            await h.aclose()


async def test_r43_the_credential_goes_in_the_named_header(tmp_path):
    with tracker(TOKEN, header="X-Api-Key") as srv:
        h = _hub(tmp_path, {"tracker": McpServer("tracker", "http", url=srv.url, token_env=TOKEN_ENV,
                                                  header="X-Api-Key")})
        try:
            cap = await h.open("t6", [], 0, GRANT)
            http, s = _relay(h, "t6", cap)
            async with http:
                await s.start()
                assert "login page" in _text((await s.call("get_issue", {"number": 2}))[1])
            assert all(hd.get("x-api-key") == TOKEN and "authorization" not in hd for _, hd in srv.requests)
        finally:
            await h.aclose()


@pytest.mark.slow
async def test_r43_bodies_answers_and_time_are_bounded(hub, srv):
    cap = await hub.open("t7", [], 0, GRANT)
    hub.mcp.servers["tracker"] = dataclasses.replace(hub.mcp.servers["tracker"], timeout_s=1.0)
    hub.mcp.max_body = 4096
    hub.mcp.max_response = 64 * 1024
    http, s = _relay(hub, "t7", cap)
    async with http:
        await s.start()
        status, answer = await s.call("get_issue", {"number": 1, "pad": "x" * 8192})
        assert status == 413 and srv.calls == []
        assert (await s.call("big", {"size": 1000}))[0] == 200          # positive control: a small answer passes
        status, answer = await s.call("big", {"size": 200_000})
        assert "limit" in answer["error"]["message"], answer
        status, answer = await s.call("slow", {"seconds": 3})           # the server's timeout is 1 s
        assert status == 504 and "within its timeout" in answer["error"]["message"]
        assert (await s.call("slow", {"seconds": 0.1}))[0] == 200       # positive control
    calls, _ = hub.mcp_calls("t7")
    assert [(c["tool"], c["outcome"]) for c in calls] == [("big", "ok"), ("big", "error"), ("slow", "timeout"),
                                                          ("slow", "ok")]


async def test_r43_grants_and_calls_survive_a_broker_restart(tmp_path, hub, srv):
    cap = await hub.open("t8", [], 0, GRANT)
    http, s = _relay(hub, "t8", cap)
    async with http:
        await s.start()
        await s.call("get_issue", {"number": 3})
    await hub.aclose()
    again = RelayHub(hub.config, hub.layout, hub.keys, hub.redactor, state_dir=hub.state_dir)
    try:
        assert await again.resume() == 1
        calls, total = again.mcp_calls("t8", 1)
        assert total == 1 and calls[0]["tool"] == "get_issue"
        http, s = _relay(again, "t8", cap)
        async with http:
            await s.start()
            _, answer = await s.call("delete_issue", {"number": 3})
            assert "not granted" in answer["error"]["message"]      # the grant came back with it
        assert [c["seq"] for c in again.mcp_calls("t8", 2)[0]] == [2]
    finally:
        await again.aclose()


class LingeringStream:
    """A Streamable HTTP server (aiohttp, raw SSE) whose POST stream sends the answer, then waits
    `linger_s` and sends `tail` (events that answer nothing) before it closes, as a server that
    takes its time to end the stream does. Counts the connections it was asked on and the tails
    it could not finish (the client closed the connection)."""

    def __init__(self, linger_s: float, tail: bytes) -> None:
        self.linger_s, self.tail, self.pieces = linger_s, tail, 1
        self.peers: set[object] = set()
        self.cut = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        doc = await request.json()
        if "id" not in doc:
            return web.Response(status=202)
        result = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
                  "serverInfo": {"name": "s", "version": "1"}} if doc["method"] == "initialize" else \
            {"content": [{"type": "text", "text": f"answer {doc['id']}"}], "isError": False}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Mcp-Session-Id": "s1"})
        await resp.prepare(request)
        await resp.write(b"event: message\ndata: " + json.dumps({"jsonrpc": "2.0", "id": doc["id"],
                                                                  "result": result}).encode() + b"\n\n")
        await asyncio.sleep(self.linger_s)
        try:
            for i in range(self.pieces):
                await resp.write(self.tail)
                if i + 1 < self.pieces:
                    await asyncio.sleep(0.01)
            await resp.write_eof()
        except ConnectionResetError:
            self.cut += 1
        return resp


@pytest.mark.slow
async def test_r43_the_answer_is_sent_once_complete_and_what_the_stream_carries_after_it_is_dropped(tmp_path):
    """The relay ends the agent's answer when every request of the POST has its answer, not when the
    server gets round to closing its stream; what comes after (answering nothing) never reaches the
    sandbox; the server's connection is kept for the next call, or closed when its tail is over the
    answer limit. Positive control: a client straight to the server waits for the close and gets the tail."""
    from tests.support.fakes.base import FakeServer

    tail = b"event: message\ndata: " + json.dumps({"jsonrpc": "2.0", "method": "notifications/message", "params": {
        "level": "info", "data": "after the answer"}}).encode() + b"\n\n"
    upstream = LingeringStream(0.5, tail)

    class Server(FakeServer):
        def routes(self, app: web.Application) -> None:
            app.router.add_route("POST", "/mcp", upstream.handle)

    async with Server() as fake:
        h = _hub(tmp_path, {"tracker": McpServer("tracker", "http", url=f"{fake.url}/mcp", token_env=TOKEN_ENV,
                                                  timeout_s=5)})
        try:
            cap = await h.open("t9", [], 0, GRANT)
            http, s = _relay(h, "t9", cap)
            async with http:
                await s.start()
                took = []
                for n in (1, 2):
                    t0 = asyncio.get_running_loop().time()
                    status, answer = await s.call("get_issue", {"number": n}, id_=n)
                    took.append(asyncio.get_running_loop().time() - t0)
                    assert status == 200 and _text(answer) == f"answer {n}", answer   # one message: no tail
                assert max(took) < 0.4, took
                opened = len(upstream.peers)
                await asyncio.sleep(0.7)                         # the tails are read: the connections are free
                assert (await s.call("get_issue", {"number": 3}, id_=3))[0] == 200
                assert len(upstream.peers) == opened and upstream.cut == 0     # a drained connection, used again
                # A tail over the answer limit: the answer still arrives whole; that connection is closed.
                await asyncio.sleep(0.7)
                upstream.tail, upstream.pieces = b": " + b"x" * 1024 + b"\n\n", 100
                h.mcp.max_response = 4096
                status, answer = await s.call("get_issue", {"number": 4}, id_=4)
                assert status == 200 and _text(answer) == "answer 4"
                for _ in range(40):
                    if upstream.cut:
                        break
                    await asyncio.sleep(0.05)
                assert upstream.cut == 1
                upstream.tail, upstream.pieces = tail, 1
            assert [(c["tool"], c["outcome"]) for c in h.mcp_calls("t9")[0]] == [("get_issue", "ok")] * 4
            # positive control: straight to the server, the answer ends when the stream does, tail included
            async with aiohttp.ClientSession() as direct:
                t0 = asyncio.get_running_loop().time()
                async with direct.post(f"{fake.url}/mcp", json={"jsonrpc": "2.0", "id": 5, "method": "tools/call",
                                                                "params": {"name": "get_issue", "arguments": {}}}) as r:
                    text = await r.text()
                assert asyncio.get_running_loop().time() - t0 >= 0.45 and "after the answer" in text
        finally:
            await h.aclose()


SSE_CONFIG = """\
kind: McpServer
name: monitor
url: http://127.0.0.1:9/sse
transport: sse
---
kind: Agent
name: coder
type: acp
command: [coder-acp]
---
kind: Workflow
name: w
mcp: {monitor: [get_issue]}
nodes:
  - {id: code, agent: coder, prompt: "x"}
"""


async def test_r43_an_sse_server_is_not_served_to_agents_and_afe_check_says_so(tmp_path):
    from services.common.config.manifests import load_config
    from services.common.errors import ConfigError

    (tmp_path / "afe.yaml").write_text(SSE_CONFIG)
    with pytest.raises(ConfigError, match="Streamable HTTP"):
        load_config(tmp_path)
    (tmp_path / "afe.yaml").write_text(SSE_CONFIG.replace("transport: sse", "transport: http"))
    load_config(tmp_path)                                     # positive control: the same, over Streamable HTTP
    h = _hub(tmp_path, {"monitor": McpServer("monitor", "sse", url="http://127.0.0.1:9/sse")})
    try:
        with pytest.raises(Exception, match="Streamable HTTP"):
            await h.open("t9", [], 0, {"monitor": ["get_issue"]})
    finally:
        await h.aclose()
