"""The MCP relay (R43): an agent inside a sandbox reaches the remote MCP
servers its Workflow grants (`mcp: {SERVER: [TOOL, ...]}`) through the
ticket's relay, `/mcp/<server>` on the same socket and with the same
per-ticket capability as the model relay (relay.py); the server's
credential never leaves the credential broker.

For each request (the capability and the ticket's state already checked
by relay.py) the relay

1. takes the server from the path and refuses one the ticket's grant does
   not name; nothing else of the path or query is used: the upstream URL is
   the manifest's `url`, as written;
2. speaks MCP Streamable HTTP: a POST carries JSON-RPC (checked by
   filter.py: only granted `tools/call`s, whatever their spelling or
   batching; the relay's own serialization is sent), a GET opens the
   server's stream, a DELETE ends the session; `Mcp-Session-Id`,
   `Mcp-Protocol-Version` and `Last-Event-ID` pass, no other client header;
3. adds the credential (`Authorization: Bearer <token>`, or the manifest's
   `header:`) and sends the request from this host, following no redirect
   (a 3xx is refused: the server is the manifest's URL and nothing else);
4. reads the answer, JSON or an event stream, within the server's
   `timeout` and the relay's size limits, keeps only the granted tools in
   any tool list, masks every secret the broker holds (relay/secrets.py),
   and sends its own serialization back;
5. notes every `tools/call` (server, tool, a digest of the arguments,
   outcome, sizes, time: `record`), never the arguments or the result: the
   scheduler turns them into `mcp.call` events and the signed run record.

Refusals are JSON-RPC errors ("afe relay: ..."), answering each request of
the refused message, so the agent shows the reason. A server's answer is
untrusted text (R36): never logged, only counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from services.common.config.model import McpServer
from services.common.host.proxies import proxy_for
from services.credentials.mcptools.filter import (
    INVALID_REQUEST,
    RELAY_ERROR,
    Call,
    Checked,
    Event,
    Malformed,
    SseReader,
    TooLarge,
    check_request,
    encode,
    error,
    filter_message,
    id_key,
    outcome,
    parse,
    responses,
)
from services.credentials.relay.limits import Throttle
from services.credentials.relay.secrets import SecretForms
from services.credentials.relay.state import TicketRelay

log = logging.getLogger(__name__)

MAX_BODY = 4 * 1024 * 1024           # a request body from the sandbox
MAX_RESPONSE = 16 * 1024 * 1024      # an answer (a JSON body, or all events of a POST's stream)
MAX_ERROR_BODY = 64 * 1024           # an upstream error body passed back
STREAM_IDLE_S = 300.0                # a GET stream with nothing arriving is closed (the client opens another)
READ_CHUNK = 64 * 1024
# What of the client's headers reaches the server, and the shape each must have.
_TOKEN = re.compile(r"[\x21-\x7e]{1,256}")
PASSED = {"mcp-session-id": _TOKEN, "mcp-protocol-version": re.compile(r"\d{4}-\d{2}-\d{2}"),
          "last-event-id": _TOKEN}
USER_AGENT = "afe-mcp-relay"

# (ticket, server, call, outcome, response bytes, reason, started at (monotonic))
Record = Callable[[TicketRelay, str, Call, str, int, str, float], None]
ReadBody = Callable[[int], Awaitable[bytes]]       # the request body, within a limit
Release = Callable[[], Awaitable[None]]            # the body's bytes no longer count for the ticket


@dataclass(frozen=True)
class _Target:
    """Where a server's requests go, and their time limits."""

    server: McpServer
    url: URL
    proxy: str | None
    post_timeout: aiohttp.ClientTimeout       # a POST: its whole answer within the server's timeout
    stream_timeout: aiohttp.ClientTimeout     # a GET stream: open within it, then idle at most this long


class _Held:
    """`async with` the server's response to a request: released at the end (the connection back to the
    pool, or closed if its body was not all read) unless handed to a drain (`kept`)."""

    def __init__(self, request: Awaitable[aiohttp.ClientResponse]) -> None:
        self._request = request
        self.up: aiohttp.ClientResponse | None = None
        self.kept = False

    async def __aenter__(self) -> aiohttp.ClientResponse:
        self.up = await self._request
        return self.up

    async def __aexit__(self, *exc: object) -> None:
        if self.up is not None and not self.kept:
            self.up.release()
            await self.up.wait_for_close()


@dataclass
class _Pending:
    """The requests of one POST still waiting for their answer."""

    calls: dict[str, Call]
    requests: list[str]
    started: float


class McpRelay:
    def __init__(self, servers: dict[str, McpServer], keys: Any, forms: SecretForms, throttle: Throttle,
                 session: Callable[[], aiohttp.ClientSession], proxies: dict[str, str], record: Record,
                 masked: Callable[[int], None]) -> None:
        self.servers = servers
        self.keys = keys
        self.forms = forms
        self.throttle = throttle
        self.session = session
        self.proxies = proxies
        self.record = record
        self.masked = masked
        self.max_body = MAX_BODY
        self.max_response = MAX_RESPONSE
        self._targets: dict[str, _Target] = {}
        self._drains: set[asyncio.Task[None]] = set()

    def _target(self, server: McpServer) -> _Target:
        """The server's URL, proxy and timeouts, worked out once (the manifests do not change)."""
        got = self._targets.get(server.name)
        if got is None or got.server is not server:
            url = URL(server.url)
            got = self._targets[server.name] = _Target(
                server, url, proxy_for(str(url), self.proxies),
                aiohttp.ClientTimeout(total=server.timeout_s, sock_connect=min(30.0, server.timeout_s)),
                aiohttp.ClientTimeout(total=None, sock_connect=min(30.0, server.timeout_s),
                                      sock_read=max(server.timeout_s, STREAM_IDLE_S)))
        return got

    # -- helpers -------------------------------------------------------------------
    def _redact(self, t: TicketRelay, server: str, data: bytes) -> bytes:
        out, n = self.forms.redact(data)
        if n:
            self.masked(n)
            self.throttle.note(f"{t.ticket_id}:mcp:{server}:secret", f"MCP relay of ticket {t.ticket_id}: an "
                               f"answer of MCP server {server!r} carried a secret of the broker; it was masked")
        return out

    def _json(self, t: TicketRelay, server: str, doc: Any, status: int = 200,
              headers: dict[str, str] | None = None) -> web.Response:
        return web.Response(body=self._redact(t, server, encode(doc)), status=status,
                            content_type="application/json", headers=headers)

    def _finish(self, t: TicketRelay, server: str, pending: _Pending, result: str, reason: str) -> None:
        for c in pending.calls.values():
            self.record(t, server, c, result, 0, reason, pending.started)
        pending.calls.clear()

    def _failed(self, t: TicketRelay, server: str, pending: _Pending, status: int, result: str,
                message: str) -> web.Response:
        """Every request still waiting answered with the relay's error."""
        self._finish(t, server, pending, result, message)
        answers = [error(_unkey(k), RELAY_ERROR, message) for k in pending.requests]
        pending.requests = []
        if not answers:
            return self._json(t, server, error(None, RELAY_ERROR, message), status)
        return self._json(t, server, answers if len(answers) > 1 else answers[0], status)

    def _headers(self, request: web.Request, server: McpServer, *, post: bool) -> dict[str, str] | str:
        """The upstream request's headers, or why they cannot be made."""
        out = {"Accept": "application/json, text/event-stream" if post else "text/event-stream",
               "User-Agent": USER_AGENT}
        if post:
            out["Content-Type"] = "application/json"
        for name, shape in PASSED.items():
            v = request.headers.get(name)
            if v is not None and shape.fullmatch(v):
                out[name.title()] = v
        if server.token_env:
            secret = self.keys.get(server.token_env)
            if secret is None:
                return (f"MCP server {server.name!r}: {server.token_env} (its tokenEnv) is not set in the "
                        "credential broker's environment")
            k, v = server.auth_header(secret.reveal())
            out[k] = v
        return out

    def _back_headers(self, t: TicketRelay, server: str, up: aiohttp.ClientResponse) -> dict[str, str]:
        out = {}
        sid = up.headers.get("Mcp-Session-Id")
        if sid is not None:
            sid = self._redact(t, server, sid.encode("utf-8", "replace")).decode()
            if _TOKEN.fullmatch(sid):
                out["Mcp-Session-Id"] = sid
        return out

    # -- requests ----------------------------------------------------------------
    async def handle(self, request: web.Request, t: TicketRelay, name: str, read_body: ReadBody,
                     release: Release) -> web.StreamResponse:
        tools = t.mcp.get(name)
        server = self.servers.get(name)
        if tools is None or server is None:
            granted = ", ".join(sorted(t.mcp)) or "none"
            return self._json(t, name, error(None, INVALID_REQUEST, f"MCP server {name[:64]!r} is not granted to "
                                                                    f"this ticket's agents; granted: {granted}"),
                              404)
        if request.method == "POST":
            return await self._post(request, t, server, frozenset(tools), read_body, release)
        if request.method in ("GET", "DELETE"):
            return await self._other(request, t, server, frozenset(tools))
        return self._json(t, name, error(None, INVALID_REQUEST, f"{request.method[:16]} is not an MCP Streamable "
                                                                "HTTP method (POST, GET or DELETE)"), 405,
                          headers={"Allow": "POST, GET, DELETE"})

    async def _post(self, request: web.Request, t: TicketRelay, server: McpServer, tools: frozenset[str],
                    read_body: ReadBody, release: Release) -> web.StreamResponse:
        started = time.monotonic()
        body = await read_body(self.max_body)
        try:
            checked: Checked = check_request(body, tools, server.name)
        except Malformed as exc:
            if b"tools/call" in body:       # an attempt all the same: it is on the record
                self.record(t, server.name, Call(id_key="", tool="", tool_sha256="", arguments_sha256="",
                                                 request_bytes=len(body)), "refused", 0,
                            f"malformed message: {exc.message}", started)
            return self._json(t, server.name, error(None, exc.code, exc.message), 400)
        if checked.refusal is not None:
            for c in checked.calls:
                self.record(t, server.name, c, "refused", 0, c.reason, started)
            self.throttle.note(f"{t.ticket_id}:mcp:{server.name}:refused", f"MCP relay of ticket {t.ticket_id}: "
                               f"refused a request to MCP server {server.name!r} (a tool or method not granted)")
            return self._json(t, server.name, checked.refusal, checked.status)
        pending = _Pending({c.id_key: c for c in checked.calls}, list(checked.requests), started)
        headers = self._headers(request, server, post=True)
        if isinstance(headers, str):
            return self._failed(t, server.name, pending, 502, "error", headers)
        target = self._target(server)
        resp: web.StreamResponse | None = None
        try:
            held = _Held(self.session().post(target.url, data=checked.forward, headers=headers,
                                             timeout=target.post_timeout, allow_redirects=False,
                                             proxy=target.proxy))
            async with held as up:
                del body
                await release()          # the body is sent: its bytes no longer count for the ticket
                refused = self._status_problem(server, up)
                if refused is not None:
                    return self._failed(t, server.name, pending, 502, "error", refused)
                if up.status == 202 or (up.status < 300 and not pending.requests and up.content_length == 0):
                    self._finish(t, server.name, pending, "no_answer", "the server accepted it without an answer")
                    return web.Response(status=202, headers=self._back_headers(t, server.name, up))
                if up.status >= 400:
                    return await self._upstream_error(t, server, up, pending)
                ctype = (up.content_type or "").lower()
                if ctype == "application/json":
                    return await self._json_answer(t, server.name, up, pending, tools)
                if ctype == "text/event-stream":
                    resp = web.StreamResponse(status=up.status, headers={
                        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                        **self._back_headers(t, server.name, up)})
                    whole = await self._stream(t, server.name, up, request, resp, pending, tools,
                                               self.max_response, held)
                    if isinstance(whole, web.StreamResponse):     # every request answered, the answer sent
                        return whole
                    self._finish(t, server.name, pending, "no_answer", "the stream ended without the answer")
                    if whole is not None:     # it ended with nothing sent: what it carried, in one write
                        return web.Response(body=whole, status=up.status, headers=resp.headers)
                    await resp.write_eof()
                    return resp
                return self._failed(t, server.name, pending, 502, "error",
                                    f"MCP server {server.name!r} answered with content type {ctype[:60]!r}; an MCP "
                                    "Streamable HTTP server answers application/json or text/event-stream")
        except (TimeoutError, aiohttp.ClientError, OSError, TooLarge) as exc:
            result, why = self._why(server, exc)
            if resp is not None and resp.prepared:   # the stream had started: cut it (the client sees that)
                self._finish(t, server.name, pending, result, why)
                if request.transport is not None:
                    request.transport.abort()
                return resp
            return self._failed(t, server.name, pending, 504 if result == "timeout" else 502, result, why)
        except asyncio.CancelledError:
            self._finish(t, server.name, pending, "no_answer", "the client went away")
            raise

    def _why(self, server: McpServer, exc: BaseException) -> tuple[str, str]:
        if isinstance(exc, TimeoutError):
            return "timeout", f"MCP server {server.name!r} did not answer within its timeout of {server.timeout_s:g}s"
        if isinstance(exc, TooLarge):
            return "error", f"MCP server {server.name!r} answered more than the relay's limit of {self.max_response} bytes"
        url = URL(server.url)
        return "unreachable", (f"could not reach MCP server {server.name!r} at {url.host}:{url.port} "
                               f"({type(exc).__name__}); check its url and that the host can reach it")

    def _status_problem(self, server: McpServer, up: aiohttp.ClientResponse) -> str | None:
        if 300 <= up.status < 400:
            return (f"MCP server {server.name!r} answered with a redirect (HTTP {up.status}); the relay follows "
                    "none: set its url: to the endpoint itself")
        if up.status in (401, 403):
            where = f"check {server.token_env} (its tokenEnv)" if server.token_env else \
                "it needs a credential: add tokenEnv: to its manifest"
            return (f"MCP server {server.name!r} refused the relay's credential (HTTP {up.status}); {where} in the "
                    "environment of afe up")
        return None

    async def _read_capped(self, up: aiohttp.ClientResponse, cap: int) -> bytes:
        data = bytearray()
        async for chunk in up.content.iter_chunked(READ_CHUNK):
            data += chunk
            if len(data) > cap:
                raise TooLarge
        return bytes(data)

    async def _upstream_error(self, t: TicketRelay, server: McpServer, up: aiohttp.ClientResponse,
                              pending: _Pending) -> web.Response:
        """An HTTP error of the server (a session it no longer knows is 404: the client starts another),
        passed on with its JSON-RPC body when it has one, else the relay's error."""
        self._finish(t, server.name, pending, "error", f"HTTP {up.status}")
        raw = await up.content.read(MAX_ERROR_BODY)
        try:
            doc = filter_message(parse(raw), frozenset())
        except Malformed:
            doc = None
        headers = self._back_headers(t, server.name, up)
        if isinstance(doc, (dict, list)):
            return self._json(t, server.name, doc, up.status, headers)
        answers = [error(_unkey(k), RELAY_ERROR, f"MCP server {server.name!r} answered HTTP {up.status}")
                   for k in pending.requests] or [error(None, RELAY_ERROR,
                                                        f"MCP server {server.name!r} answered HTTP {up.status}")]
        return self._json(t, server.name, answers if len(answers) > 1 else answers[0], up.status, headers)

    def _answered(self, t: TicketRelay, server: str, doc: Any, pending: _Pending, encoded: bytes) -> None:
        """Note the requests `doc` (`encoded`: its serialization) answers."""
        for r in responses(doc):
            k = id_key(r.get("id"))
            if k in pending.requests:
                pending.requests.remove(k)
            c = pending.calls.pop(k, None)
            if c is not None:
                self.record(t, server, c, outcome(r), len(encoded) if r is doc else len(encode(r)), "",
                            pending.started)

    async def _json_answer(self, t: TicketRelay, server: str, up: aiohttp.ClientResponse, pending: _Pending,
                           tools: frozenset[str]) -> web.Response:
        raw = await self._read_capped(up, self.max_response)
        try:
            doc = filter_message(parse(raw), tools)
        except Malformed as exc:
            return self._failed(t, server, pending, 502, "error", f"MCP server {server!r} answered with a body "
                                                                  f"that is not JSON-RPC ({exc.message[:100]})")
        body = encode(doc)
        self._answered(t, server, doc, pending, body)
        self._finish(t, server, pending, "no_answer", "the server's answer did not answer it")
        return web.Response(body=self._redact(t, server, body), status=up.status, content_type="application/json",
                            headers=self._back_headers(t, server, up))

    async def _stream(self, t: TicketRelay, server: str, up: aiohttp.ClientResponse, request: web.Request,
                      resp: web.StreamResponse, pending: _Pending | None, tools: frozenset[str],
                      cap: int, held: _Held | None) -> web.StreamResponse | bytes | None:
        """Copy an event stream: each JSON-RPC event filtered, re-serialized and masked; any other event
        dropped. `cap`: the bytes the whole stream may carry (0: no cap, only the size of one event).
        A POST's stream (`pending`) is sent as it comes until every request has its answer; the
        client's answer ends there: sent at once (in one write when nothing was sent before: a tool's
        answer, the usual case), not after the server gets round to closing its stream, which then
        carries nothing for these requests and is read and dropped meanwhile (`_drain`, which `held`
        is handed to); the finished response is returned. A POST's stream that ends first, with
        nothing sent, is returned as bytes (a failure before anything is sent is still a JSON-RPC
        error); a GET's stream returns None."""
        reader = SseReader(self.max_response)
        total = 0
        dropped = 0
        out: list[bytes] = []          # events not yet written
        done = False                   # every request of the POST has its answer

        def take(events: list[Event]) -> None:
            nonlocal dropped, done
            for ev in events:
                if done or ev.event not in ("", "message"):
                    dropped += 1
                    continue
                try:
                    doc = filter_message(parse(ev.data.encode("utf-8", "surrogatepass")), tools)
                except Malformed:
                    dropped += 1
                    continue
                body = encode(doc)
                if pending is not None:
                    self._answered(t, server, doc, pending, body)
                    done = not pending.requests
                head = ""
                if ev.id is not None:
                    eid = self._redact(t, server, ev.id.encode("utf-8", "replace")).decode("utf-8", "replace")
                    head += f"id: {eid}\n" if "\n" not in eid and "\r" not in eid else ""
                if ev.retry:
                    head += f"retry: {ev.retry}\n"
                out.append(head.encode() + b"event: message\ndata: " + self._redact(t, server, body) + b"\n\n")

        async def flush() -> None:
            if out:
                if not resp.prepared:
                    await resp.prepare(request)
                data = b"".join(out)
                out.clear()
                await resp.write(data)

        async for chunk in up.content.iter_any():
            total += len(chunk)
            if cap and total > cap:
                raise TooLarge
            take(reader.feed(chunk))
            if done:
                break
            await flush()
        else:
            take(reader.finish())
        if dropped:
            self.throttle.note(f"{t.ticket_id}:mcp:{server}:dropped", f"MCP relay of ticket {t.ticket_id}: "
                               f"dropped {dropped} event(s) of MCP server {server!r} that were not JSON-RPC or "
                               "came after the last answer of their POST")
        if done:
            final = resp
            if resp.prepared:
                await flush()
            else:
                final = web.Response(body=b"".join(out), status=resp.status, headers=resp.headers)
                await final.prepare(request)
            await final.write_eof()
            if held is not None:
                held.kept = True
                task = asyncio.get_running_loop().create_task(self._drain(t, server, up, total, cap))
                self._drains.add(task)
                task.add_done_callback(self._drains.discard)
            return final
        if pending is not None and not resp.prepared:
            return b"".join(out)
        await flush()
        return None

    async def _drain(self, t: TicketRelay, server: str, up: aiohttp.ClientResponse, total: int, cap: int) -> None:
        """The rest of a POST's stream once the client has every answer: read and dropped within the
        same size cap and time (the server's timeout covers the whole request), so the connection is
        kept for the next call (the answer is already on its way: the client's next request does not
        wait for this); a stream that goes on past them is cut (its connection closed)."""
        try:
            async for chunk in up.content.iter_any():
                total += len(chunk)
                if cap and total > cap:
                    raise TooLarge
        except asyncio.CancelledError:       # the broker stops
            up.close()
            raise
        except (TimeoutError, aiohttp.ClientError, OSError, TooLarge) as exc:
            up.close()
            self.throttle.note(f"{t.ticket_id}:mcp:{server}:tail", f"MCP relay of ticket {t.ticket_id}: MCP "
                               f"server {server!r} went on after its last answer ({type(exc).__name__}); its "
                               "connection was closed")
        finally:
            up.release()

    async def aclose(self) -> None:
        """Stop the drains still reading (the broker stops)."""
        for task in list(self._drains):
            task.cancel()
        if self._drains:
            await asyncio.gather(*self._drains, return_exceptions=True)

    async def _other(self, request: web.Request, t: TicketRelay, server: McpServer,
                     tools: frozenset[str]) -> web.StreamResponse:
        """GET (the server's own stream) and DELETE (the end of the session)."""
        headers = self._headers(request, server, post=False)
        if isinstance(headers, str):
            return self._json(t, server.name, error(None, RELAY_ERROR, headers), 502)
        if request.method == "DELETE":
            headers.pop("Accept", None)
        target = self._target(server)
        resp: web.StreamResponse | None = None
        try:
            async with self.session().request(request.method, target.url, headers=headers,
                                              timeout=target.stream_timeout, allow_redirects=False,
                                              proxy=target.proxy) as up:
                refused = self._status_problem(server, up)
                if refused is not None:
                    return self._json(t, server.name, error(None, RELAY_ERROR, refused), 502)
                back = self._back_headers(t, server.name, up)
                if request.method == "DELETE" or up.status >= 300 or \
                        (up.content_type or "").lower() != "text/event-stream":
                    if up.status < 300 and request.method == "GET":
                        return self._json(t, server.name, error(None, RELAY_ERROR, f"MCP server {server.name!r} "
                                                                "answered the stream request without a stream"),
                                          502)
                    return web.Response(status=up.status, headers=back)
                resp = web.StreamResponse(status=up.status, headers={
                    "Content-Type": "text/event-stream", "Cache-Control": "no-cache", **back})
                await resp.prepare(request)        # the client waits for the stream to open, not for an event
                await self._stream(t, server.name, up, request, resp, None, tools, 0, None)
                await resp.write_eof()
                return resp
        except (TimeoutError, aiohttp.ClientError, OSError, TooLarge) as exc:
            result, why = self._why(server, exc)
            if resp is not None:
                if request.transport is not None:
                    request.transport.abort()
                return resp
            return self._json(t, server.name, error(None, RELAY_ERROR, why), 504 if result == "timeout" else 502)


def _unkey(key: str) -> Any:
    """The request id of an `id_key` again."""
    with contextlib.suppress(ValueError):
        return json.loads(key)
    return None
