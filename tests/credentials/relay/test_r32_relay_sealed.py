"""The model relay sealed (R32), as a hostile `run:` node or agent of a ticket
would attack it, each with its positive control:

- path traversal: no path from the sandbox but an endpoint's and a model id
  reaches the upstream (control: the path as the relay used to build it
  reaches `/v1/files` on the same upstream);
- secret echo: an upstream that echoes the key (or any other secret of the
  broker) in a header or a streamed body gets it masked, even cut across
  chunks (control: the same upstream, called directly, echoes them);
- one ticket cannot starve the broker: connections over the ticket's limit,
  idle or slow connections and request bodies over its byte limit fail that
  ticket only, counted and logged once per interval (control: with the
  limits off, the same flood makes another ticket's OpenRelay fail with
  "Too many open files"; a plain aiohttp server logs every malformed request).
The budget across nodes is tests/scheduler/executor/test_r32_relay_budget.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import sys
import urllib.parse
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from services.common.layout import Layout
from services.common.observability.metrics import relay_metrics
from services.common.relayenv import RELAY_SOCKET
from services.common.secrecy.env_secrets import SecretValue
from services.common.secrecy.redact import Redactor
from services.credentials.relay.providers import Refused, check_raw_path, upstream_path
from services.credentials.relay.secrets import MASK, SecretForms, StreamRedactor
from services.credentials.relay.server import RelayHub, RelayLimits
from tests.credentials.relay.test_relay import KEY, KEY_ENV, _client, _config
from tests.support.fakes.base import FakeServer
from tests.support.fakes.streaming import IN_TOKENS, OUT_TOKENS, FakeModelAPI
from tests.support.system import REPO_ROOT

FORGE_ENV = "RELAY_TEST_FORGE_TOKEN"
FORGE = "ghp_" + "F0rge" * 8                   # another secret the broker holds: a forge token
SECRETS = {KEY_ENV: SecretValue(KEY_ENV, KEY), FORGE_ENV: SecretValue(FORGE_ENV, FORGE)}


def _hub(tmp: Path, url: str, limits: RelayLimits | None = None, max_body: int = 64 * 1024) -> RelayHub:
    layout = Layout(tmp / "data", tmp / "run")
    layout.ensure()
    h = RelayHub(_config(tmp, url), layout, SECRETS, Redactor([KEY, FORGE]),
                 state_dir=tmp / "data" / "relay", max_body=max_body, limits=limits)
    h.metrics = relay_metrics(CollectorRegistry(), h.config.models)
    return h


async def _raw(hub: RelayHub, ticket: str, head: str, body: bytes = b"") -> tuple[int, bytes]:
    """A request written as is on the ticket's socket (no client library normalises the path)."""
    reader, writer = await asyncio.open_unix_connection(str(hub.layout.relay_dir(ticket) / RELAY_SOCKET))
    writer.write(head.encode() + body)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return int(data.split(b" ", 2)[1]), data.split(b"\r\n\r\n", 1)[1]


# -- 1. path traversal -------------------------------------------------------------------

class AnyPath(FakeServer):
    """A model API's host: records every path it is sent and answers each."""

    def routes(self, app: web.Application) -> None:
        app.router.add_route("*", "/{path:.*}", self.any)

    async def any(self, request: web.Request) -> web.Response:
        return web.json_response({"path": request.path, "data": []})


TRAVERSALS = [  # (Model, method, path after /m/<Model>/ as the client writes it)
    ("gpt", "GET", "v1/models/../../v1/files"),
    ("gpt", "GET", "v1/models/%2e%2e/%2e%2e/v1/files"),
    ("gpt", "GET", "v1/models/%2E%2E%2F%2E%2E%2Fv1%2Ffiles"),
    ("gpt", "GET", "v1/models/..%2f..%2fv1%2ffiles"),
    ("gpt", "GET", "v1/models/%252e%252e/%252e%252e/v1/files"),
    ("gpt", "GET", "v1/models/x/..%5c..%5cv1%5cfiles"),
    ("gpt", "GET", "v1/models/x/../../../organization/usage"),
    ("gpt", "POST", "v1/chat/completions/../../files"),
    ("gpt", "GET", "./v1/files"),
    ("claude", "GET", "v1/models/../../admin/keys"),
    ("claude", "POST", "v1/messages/..%2f..%2fv1%2ffiles"),
    ("gem", "POST", "v1beta/models/%2e%2e%2f%2e%2e%2fv1%2ffiles:generateContent"),
    ("gem", "GET", "v1beta/models/.."),
]


async def test_r32_relay_path_traversal_never_reaches_another_upstream_path(tmp_path):
    async with AnyPath() as up:
        hub = _hub(tmp_path, up.url)
        try:
            cap = await hub.open("trav", ["gpt", "claude", "gem"], 0)
            for name, method, path in TRAVERSALS:
                status, body = await _raw(hub, "trav", f"{method} /m/{name}/{path} HTTP/1.1\r\nHost: r\r\n"
                                          f"Authorization: Bearer {cap}\r\nContent-Length: 2\r\n"
                                          "Connection: close\r\n\r\n", b"{}")
                assert status in (400, 404), (path, status, body)
                assert b"afe relay: " in body, path
            assert up.seen == []
            # The endpoints still work, their model id pinned to the Model's (the client's is not used).
            status, body = await _raw(hub, "trav", f"GET /m/gpt/v1/models/my-model HTTP/1.1\r\nHost: r\r\n"
                                      f"Authorization: Bearer {cap}\r\nConnection: close\r\n\r\n")
            assert status == 200 and [s.path for s in up.seen] == ["/v1/models/gpt-pinned"]
            # Positive control: the upstream URL as the relay used to build it (baseUrl + "/" + the
            # decoded path) reaches the account's files on the same upstream, with the key.
            async with aiohttp.ClientSession() as s:
                for _name, method, path in TRAVERSALS[:4]:
                    async with s.request(method, f"{up.url}/{urllib.parse.unquote(path)}",
                                         headers={"Authorization": f"Bearer {KEY}"}) as r:
                        assert r.status == 200
            assert [s.path for s in up.seen[1:]] == ["/v1/files"] * 4
        finally:
            await hub.aclose()


def test_r32_upstream_path_is_an_endpoint_and_a_model_id_only():
    gpt, gem, claude = (_config(Path("/x"), "http://u").models[n] for n in ("gpt", "gem", "claude"))
    assert upstream_path("openai", "POST", "v1/chat/completions", gpt) == "v1/chat/completions"
    assert upstream_path("gemini", "POST", "v1beta/models/other:streamGenerateContent", gem) == \
        "v1beta/models/gemini-pinned:streamGenerateContent"
    assert upstream_path("anthropic", "GET", "v1/models/claude-x", claude) == "v1/models/claude-pinned"
    free = _config(Path("/x"), "http://u").models["gpt"].__class__("free", "openai", base_url="http://u")
    assert upstream_path("openai", "GET", "v1/models/org/model-1.5", free) == "v1/models/org/model-1.5"
    # Decoded traversals (what the raw-path check already refuses) match no endpoint either.
    for provider, model, path in [("openai", free, "v1/models/../../v1/files"), ("openai", free, "v1/models/a/.."),
                                  ("anthropic", claude, "v1/models/.."), ("openai", free, "v1/models/x\\..\\y"),
                                  ("gemini", gem, "v1beta/models/..:generateContent"),
                                  ("openai", free, "v1/files"), ("anthropic", claude, "v1/messages/batches")]:
        with pytest.raises(Refused) as e:
            upstream_path(provider, "GET" if "models" in path and "generate" not in path else "POST", path, model)
        assert e.value.status in (404, 502), path
    for raw in ("/m/gpt/v1/models/%2e%2e", "/m/gpt/v1/models/%2F", "/m/gpt/./v1", "/m/gpt/v1/%255c",
                "/m/gpt/v1/models/..", "/m/gpt/v1\\models"):
        with pytest.raises(Refused):
            check_raw_path(raw)
    check_raw_path("/m/gpt/v1/chat/completions?x=%2e")        # the query is not the path


# -- 2. secret echo ----------------------------------------------------------------------

class Echoing(FakeServer):
    """An Anthropic Messages API that echoes the broker's secrets: in response headers,
    in a streamed answer (the key cut in two between writes), JSON-escaped and base64."""

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self.messages)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        doc = await request.json()
        headers = {"x-request-id": f"req_{KEY}", "request-id": base64.b64encode(FORGE.encode()).decode(),
                   "anthropic-organization-id": urllib.parse.quote(KEY, safe="")}
        if doc.get("fail"):
            return web.json_response({"type": "error", "error": {"type": "invalid_request_error",
                                                                 "message": f"bad key {KEY} / {FORGE}"}},
                                     status=400, headers=headers)
        if not doc.get("stream"):
            return web.json_response({"type": "message", "content": [{"type": "text", "text": f"{KEY}/{FORGE}"}],
                                      "usage": {"input_tokens": IN_TOKENS, "output_tokens": OUT_TOKENS}},
                                     headers=headers)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
        await resp.prepare(request)
        start = {"type": "message_start", "message": {"usage": {"input_tokens": IN_TOKENS, "output_tokens": 1}}}
        await resp.write(f"event: message_start\ndata: {json.dumps(start)}\n\n".encode())
        delta = {"type": "content_block_delta", "index": 0,
                 "delta": {"type": "text_delta", "text": f"the key is {KEY}, the token {FORGE}"}}
        event = f"event: content_block_delta\ndata: {json.dumps(delta)}\n\n".encode()
        cut = event.index(KEY.encode()) + len(KEY) // 2
        for part in (event[:cut], event[cut:]):
            await resp.write(part)
            await asyncio.sleep(0.05)              # two chunks at the relay: the key cut between them
        end = {"type": "message_delta", "usage": {"output_tokens": OUT_TOKENS}}
        await resp.write(f"event: message_delta\ndata: {json.dumps(end)}\n\nevent: message_stop\n"
                         f"data: {{\"type\":\"message_stop\"}}\n\n".encode())
        await resp.write_eof()
        return resp


def _leaks(headers: object, body: bytes) -> list[str]:
    forms = [f.decode() for f in SecretForms([KEY, FORGE]).forms]
    text = repr(headers) + body.decode("utf-8", "replace")
    return [f for f in forms if f in text or f.lower() in text.lower()]


@pytest.mark.parametrize("doc", [{"stream": True}, {}, {"fail": True}], ids=["streamed", "json", "error"])
async def test_r32_relay_masks_every_broker_secret_an_upstream_echoes(tmp_path, doc):
    body = {"model": "x", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **doc}
    async with Echoing() as up:
        # Positive control: called directly, the upstream echoes the key and the forge token.
        async with aiohttp.ClientSession() as s, s.post(f"{up.url}/v1/messages", json=body) as r:
            direct_headers, direct = r.headers.copy(), await r.read()
        assert KEY in direct_headers["x-request-id"] and KEY.encode() in direct
        assert _leaks(direct_headers, direct)
        hub = _hub(tmp_path, up.url)
        try:
            cap = await hub.open("echo", ["claude"], 0)
            async with _client(hub, "echo") as s, s.post("http://relay/m/claude/v1/messages", json=body,
                                                          headers={"x-api-key": cap}) as r:
                status, headers, got = r.status, r.headers.copy(), await r.read()
            assert status == (400 if doc.get("fail") else 200)
            assert _leaks(headers, got) == []
            assert headers["x-request-id"] == "req_" + MASK.decode()
            assert MASK in got
            if doc.get("stream"):
                assert got.count(b"event: ") == 4 and b"the key is [redacted], the token [redacted]" in got
            if not doc.get("fail"):
                usage, _, _ = hub.usage("echo")
                assert usage["claude"].total == IN_TOKENS + OUT_TOKENS
            masked = hub.metrics.masked.metric._value.get()
            assert masked >= 4
        finally:
            await hub.aclose()


def test_r32_stream_redactor_masks_a_secret_cut_anywhere_and_holds_back_only_its_start():
    forms = SecretForms([KEY, FORGE, "short"])           # "short": under the minimum, never masked
    stream = (f'data: {{"text": "{KEY} and {json.dumps(KEY)} '
              f'and {base64.b64encode(FORGE.encode()).decode()}"}}\n\ndata: short\n\n').encode()
    whole = StreamRedactor(forms)
    expected = whole.feed(stream) + whole.finish()
    assert KEY.encode() not in expected and b"short" in expected and expected.count(MASK) == 3
    for cut in range(1, len(stream)):
        for second in (cut, min(len(stream), cut + 7)):
            r = StreamRedactor(forms)
            out = r.feed(stream[:cut]) + r.feed(stream[cut:second]) + r.feed(stream[second:]) + r.finish()
            assert out == expected, cut
    # An SSE event's end holds nothing back (no delay), a secret's first bytes are held.
    r = StreamRedactor(forms)
    assert r.feed(b'data: {"a": 1}\n\n') == b'data: {"a": 1}\n\n'
    assert r.feed(b"text " + KEY[:10].encode()) == b"text "
    assert r.finish() == KEY[:10].encode()                 # never completed: not a secret


# -- 3. one ticket cannot starve the broker ----------------------------------------------

SMALL = RelayLimits(connections=4, idle_s=0.4, head_s=0.4, body_s=0.5, buffered=100 * 1024)
POST = "POST /m/claude/v1/messages HTTP/1.1\r\nHost: r\r\nx-api-key: {cap}\r\nContent-Length: {n}\r\n" \
       "anthropic-version: 2023-06-01\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
REQUEST = json.dumps({"model": "x", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}).encode()


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), seconds) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


async def _post(hub: RelayHub, ticket: str, cap: str) -> int:
    return (await _raw(hub, ticket, POST.format(cap=cap, n=len(REQUEST)), REQUEST))[0]


@pytest.mark.slow
@pytest.mark.parametrize("limits", [SMALL, RelayLimits.off()], ids=["limits", "control-off"])
async def test_r32_relay_limits_fail_only_the_ticket_that_hits_them(tmp_path, limits):
    on = limits.connections > 0
    async with FakeModelAPI(KEY) as up:
        hub = _hub(tmp_path, up.url, limits)
        try:
            cap_a = await hub.open("ta", ["claude"], 0)
            cap_b = await hub.open("tb", ["claude"], 0)
            sock_a = str(hub.layout.relay_dir("ta") / RELAY_SOCKET)
            # Connections: 6 idle ones from ticket A, its limit is 4.
            conns = [await asyncio.open_unix_connection(sock_a) for _ in range(6)]
            over = [await _closed_within(r, 0.2) for r, _ in conns[4:]]
            assert over == ([True, True] if on else [False, False])
            assert await _post(hub, "tb", cap_b) == 200             # ticket B is served meanwhile
            # Idle connections are closed after idle_s; a head that trickles in after head_s.
            slow_r, slow_w = await asyncio.open_unix_connection(sock_a) if not on else conns[0]
            slow_w.write(b"POST /m/claude/v1/messages HTTP/1.1\r\n")
            for _ in range(3):
                await asyncio.sleep(0.15)
                slow_w.write(b"x-slow: 1\r\n")
            assert await _closed_within(slow_r, 0.5) == on
            assert all([await _closed_within(r, 0.3) for r, _ in conns[1:4]]) == on
            for _, w in conns:
                w.close()
            # Body bytes held at once: a 60 KiB body that stalls holds the ticket's 100 KiB; the next
            # 60 KiB body waits body_s for room and is refused (429); the stalled one times out (408).
            stalled_r, stalled_w = await asyncio.open_unix_connection(sock_a)
            stalled_w.write(POST.format(cap=cap_a, n=60 * 1024).encode() + b"{" * 1024)
            await stalled_w.drain()
            await asyncio.sleep(0.1)
            big = json.dumps({"model": "x", "max_tokens": 8, "messages": [
                {"role": "user", "content": "x" * (60 * 1024 - 100)}]}).encode()
            status, _ = await _raw(hub, "ta", POST.format(cap=cap_a, n=len(big)), big)
            assert status == (429 if on else 200)
            if on:
                head = await asyncio.wait_for(stalled_r.read(), 5)
                assert head.startswith(b"HTTP/1.1 408"), head[:100]
                assert await _post(hub, "ta", cap_a) == 200        # room again once it is refused
            stalled_w.close()
            limited = {s.labels["reason"]: s.value for m in hub.metrics.limited.metric.collect()
                       for s in m.samples if s.name.endswith("_total")}
            if on:
                assert {k for k, v in limited.items() if v} >= {"connections", "idle_timeout", "head_timeout",
                                                                "body_timeout", "buffered"}
            else:
                assert not any(limited.values())
        finally:
            await hub.aclose()


async def _relay_process(tmp: Path, url: str, mode: str) -> tuple[asyncio.subprocess.Process, Path]:
    log = tmp / f"relay-{mode}.log"
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.support.relayprocess", str(tmp / mode), url, KEY, "160", mode,
            cwd=str(REPO_ROOT), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=err,
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)})
    assert proc.stdout is not None
    assert json.loads(await asyncio.wait_for(proc.stdout.readline(), 30)) == {"ready": True}
    return proc, log


async def _ask(proc: asyncio.subprocess.Process, line: str) -> dict:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line.encode() + b"\n")
    await proc.stdin.drain()
    return json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))


async def _flood(sock: str, n: int) -> list[asyncio.StreamWriter]:
    """`n` half-open connections: a request head begun and never finished."""
    held = []
    for _ in range(n):
        try:
            _r, w = await asyncio.wait_for(asyncio.open_unix_connection(sock), 1)
        except (TimeoutError, OSError):
            break                       # the backlog is full: the relay stopped accepting
        w.write(b"POST /m/claude/v1/messages HTTP/1.1\r\nHost: r\r\n")
        held.append(w)
    await asyncio.sleep(0.5)
    return held


@pytest.mark.parametrize("mode", ["on", "off"], ids=["limits", "control-off"])
async def test_r32_connection_flood_from_one_ticket_does_not_fail_another_tickets_relay(short_tmp, mode):
    async with FakeModelAPI(KEY) as up:
        proc, log = await _relay_process(short_tmp, up.url, mode)
        held: list[asyncio.StreamWriter] = []
        try:
            assert "capability" in await _ask(proc, "open ta")
            sock_a = str(short_tmp / mode / "run" / "relay" / "ta" / RELAY_SOCKET)
            held = await _flood(sock_a, 300)           # 16 allowed (on); 160 descriptors in all
            opened = await _ask(proc, "open tb")
            if mode == "off":
                # Positive control: ticket A's connections hold the broker's descriptors; B cannot open.
                assert "Too many open files" in opened.get("error", ""), opened
                return
            assert "capability" in opened, opened
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(
                    path=str(short_tmp / mode / "run" / "relay" / "tb" / RELAY_SOCKET))) as s, s.post(
                    "http://r/m/claude/v1/messages", data=REQUEST,
                    headers={"x-api-key": opened["capability"], "content-type": "application/json"}) as r:
                assert r.status == 200 and b"piece3" in await r.read()
            assert (await _ask(proc, "fds"))["fds"] < 80
            lines = [x for x in log.read_text().splitlines() if "model relay of ticket ta" in x]
            assert 1 <= len(lines) <= 2, lines          # counted, logged once per interval
            assert "connections over its limit of 16" in lines[0]
        finally:
            for w in held:
                with contextlib.suppress(Exception):
                    w.close()
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def test_r32_malformed_requests_are_logged_once_per_interval_not_once_each(tmp_path, caplog):
    bad = b"POST /m/claude/v1/messages HTTP/1.1\r\nBad Header Line\r\n\r\n"

    async def hammer(sock: str) -> int:
        caplog.clear()
        for _ in range(30):
            reader, writer = await asyncio.open_unix_connection(sock)
            writer.write(bad)
            await writer.drain()
            assert b" 400 " in (await asyncio.wait_for(reader.read(), 5)).split(b"\r\n", 1)[0]
            writer.close()
        return len([r for r in caplog.records if r.levelno >= logging.WARNING])

    caplog.set_level(logging.DEBUG)
    hub = _hub(tmp_path, "http://127.0.0.1:9")
    try:
        await hub.open("tm", ["claude"], 0)
        assert await hammer(str(hub.layout.relay_dir("tm") / RELAY_SOCKET)) == 1
    finally:
        await hub.aclose()
    # Positive control: an aiohttp server with its own logger logs each one, with a traceback.
    app = web.Application()
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.UnixSite(runner, str(tmp_path / "plain.sock"))
    await site.start()
    try:
        assert await hammer(str(tmp_path / "plain.sock")) == 30
    finally:
        await runner.cleanup()
