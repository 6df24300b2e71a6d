"""The model relay (R32): an agent inside a sandbox reaches its Model with a
per-ticket placeholder capability; the key never leaves this process.

Each ticket with a model-using agent gets its own HTTP server on its own
Unix socket, `<run>/relay/<ticket>/relay.sock`, which the sandbox broker
mounts read-only into that ticket's sandbox (nothing else can reach it: the
runtime folder is private). On every request the relay

1. refuses it if the ticket has ended (the relay was closed),
2. checks the capability the client presents (as its API key: Authorization
   Bearer, x-api-key, x-goog-api-key, api-key, or ?key=) in constant time,
3. takes the Model from the path, `/m/<model name>/<API path>`, and refuses a
   Model the ticket's workflow did not declare, a path with a dot segment or
   an encoded dot, slash, backslash or percent sign, and any path that is not
   one of the provider's inference endpoints (`ROUTES`); the upstream path
   is rebuilt from the endpoint's fixed text and a model id, nothing else,
4. refuses it once the ticket's token budget is spent,
5. reads the body within the ticket's limits (limits.py), drops every
   credential the client sent (auth headers, cookies, `key=`), pins the
   Model's model id in the request, adds the real key the way the provider
   expects, and sends it to the Model's baseUrl from this host,
6. streams the answer back chunk by chunk (SSE or not) with every secret of
   the broker masked (secrets.py), in headers and bodies, while reading
   the token usage from it, and counts that usage against the ticket,
   whichever node of the ticket (an agent, a `run:` command) made the call.

Refusals use the provider's own error shape (providers.py::refusal): 401 for a
missing, wrong or ended capability, 403 for an undeclared Model, 404 for a
path that is not an inference endpoint, 400 for a path that tries to leave
its endpoint, 413 for a body over the limit, 408 for a body that did not
arrive in time, 429 when the ticket already holds its limit of body bytes
(retried by the SDKs; it passes), and 400 for a spent budget (400, not 429:
the SDKs retry 429 for minutes, while a spent budget is final for this ticket).

State (capability, declared models, budget, usage) is kept in the broker's
private folder so a restarted broker serves the same capability and budget.

The same socket and capability serve the ticket's MCP servers (R43) at
`/mcp/<server>`: mcptools/relay.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import socket
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from services.common.config.model import Config, Model
from services.common.errors import InvalidArgument, NotFound
from services.common.layout import Layout, check_ticket_id
from services.common.relayenv import RELAY_PROVIDERS, RELAY_SOCKET
from services.common.secrecy.env_secrets import SecretValue
from services.common.secrecy.redact import Redactor
from services.credentials.mcptools.filter import Call
from services.credentials.mcptools.relay import McpRelay
from services.credentials.relay.limits import GuardedSite, Limiter, RelayLimits, ServerLog
from services.credentials.relay.providers import (
    ROUTES,
    Refused,
    auth_headers,
    check_raw_path,
    presented_capability,
    refusal,
    rewrite,
    upstream_path,
    upstream_root,
)
from services.credentials.relay.secrets import SecretForms
from services.credentials.relay.state import McpCall, RelayStates, TicketRelay
from services.credentials.relay.upstream import Upstream
from services.credentials.relay.usage import Usage, UsageMeter, usage_of

# Older imports name these here; they live in providers.py, state.py and usage.py.
__all__ = ["MAX_BODY", "ROUTES", "RelayHub", "RelayLimits", "TicketRelay", "Usage", "UsageMeter", "auth_headers",
           "presented_capability", "rewrite", "upstream_path", "upstream_root", "usage_of"]

log = logging.getLogger(__name__)

MAX_BODY = 32 * 1024 * 1024          # a request body (a long conversation with images fits)
READ_CHUNK = 256 * 1024
SUN_PATH_MAX = 107


_TICKET = web.AppKey("ticket", TicketRelay)


class RelayHub:
    """Every ticket's relay in this broker process (see the module doc)."""

    def __init__(self, config: Config, layout: Layout, keys: Mapping[str, SecretValue], redactor: Redactor, *,
                 state_dir: Path, ca_file: Path | None = None, proxies: Mapping[str, str] | None = None,
                 max_body: int = MAX_BODY, limits: RelayLimits | None = None) -> None:
        self.config = config
        self.layout = layout
        self.keys = keys
        self.redactor = redactor
        self.state_dir = state_dir
        self.states = RelayStates(state_dir)
        self.max_body = max_body
        self.metrics: Any = None          # services.common.observability.metrics.RelayMetrics, set by main
        self.tickets: dict[str, TicketRelay] = {}
        self.limiter = Limiter(limits if limits is not None else RelayLimits(buffered=2 * max_body),
                               lambda reason: self._metric("limited", reason=reason))
        # Every secret this broker holds (model keys and forge tokens alike) is masked in answers.
        self.upstream = Upstream(keys, redactor, SecretForms(v.reveal() for v in keys.values()),
                                 self.limiter.throttle, ca_file=ca_file, proxies=proxies or {})
        self.upstream.masked = lambda n: self._metric("masked", n=n)
        self.mcp = McpRelay(config.mcp_servers, keys, self.upstream.forms, self.limiter.throttle,
                            self.upstream.session, dict(proxies or {}), self._record_mcp,
                            lambda n: self._metric("masked", n=n))

    def _metric(self, family: str, n: int = 1, **labels: str) -> None:
        if self.metrics is not None:
            with contextlib.suppress(Exception):
                m = getattr(self.metrics, family)
                (m.labels(**labels) if labels else m.metric).inc(n)

    # -- lifecycle ---------------------------------------------------------------
    def _check_models(self, models: list[str]) -> tuple[str, ...]:
        out = []
        for name in models:
            m = self.config.models.get(name)
            if m is None:
                known = ", ".join(sorted(self.config.models)) or "none"
                raise NotFound(f"unknown model {name!r}; the manifests define: {known}")
            if m.provider not in RELAY_PROVIDERS:
                raise InvalidArgument(f"model {name!r} has provider {m.provider}, which the relay cannot serve; "
                                      f"use one of: {', '.join(RELAY_PROVIDERS)}")
            out.append(name)
        return tuple(sorted(set(out)))

    def _check_mcp(self, grants: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
        out: dict[str, tuple[str, ...]] = {}
        for name, tools in grants.items():
            s = self.config.mcp_servers.get(name)
            if s is None:
                known = ", ".join(sorted(self.config.mcp_servers)) or "none"
                raise NotFound(f"unknown MCP server {name!r}; the manifests define: {known}")
            if s.transport != "http":
                raise InvalidArgument(f"MCP server {name!r} is {s.transport}: the relay serves remote servers that "
                                      "speak Streamable HTTP (transport: http); a stdio server runs in the sandbox")
            names = tuple(sorted({str(x) for x in tools}))
            if not names:
                raise InvalidArgument(f"MCP server {name!r}: a grant names at least one tool")
            out[name] = names
        return dict(sorted(out.items()))

    async def open(self, ticket_id: str, models: list[str], budget: int,
                   mcp: Mapping[str, Any] | None = None) -> str:
        """Serve the ticket's relay (idempotent); returns its capability. `mcp`: server -> the
        tools the ticket's agents may call through it (R43)."""
        check_ticket_id(ticket_id)
        names = self._check_models(models)
        grants = self._check_mcp(mcp or {})
        if not names and not grants:
            raise InvalidArgument("a relay needs at least one Model name or MCP grant")
        if budget < 0:
            raise InvalidArgument("budget_tokens must be >= 0 (0 = no budget)")
        t = self.tickets.get(ticket_id) or self.states.load(ticket_id)
        if t is None:
            t = TicketRelay(ticket_id, "afe-relay-" + secrets.token_urlsafe(32), names, budget)
        self.tickets[ticket_id] = t
        async with t.lock:
            t.models, t.budget, t.closed, t.mcp = names, budget, False, grants
            self.states.save(t)
            if t.runner is None:
                t.runner = await self._serve(t)
                log.info("relay of ticket %s serves %s (budget %s)", ticket_id,
                         ", ".join([*names, *(f"mcp:{k}" for k in grants)]), budget or "none")
        return t.capability

    async def resume(self) -> int:
        """After a restart: serve again every relay whose ticket has not ended."""
        n = 0
        if not self.state_dir.is_dir():
            return 0
        for p in sorted(self.state_dir.glob("*.json")):
            t = self.states.load(p.stem)
            if t is None or t.ticket_id in self.tickets:
                continue
            try:
                await self.open(t.ticket_id, list(t.models), t.budget, t.mcp)
                n += 1
            except Exception as exc:  # noqa: BLE001 - one bad relay must not stop the others
                log.warning("could not serve the relay of ticket %s again: %s", t.ticket_id,
                            self.redactor.redact(str(exc)))
        return n

    def usage(self, ticket_id: str) -> tuple[dict[str, Usage], int, bool]:
        """(usage per model, budget, open)."""
        check_ticket_id(ticket_id)
        t = self.tickets.get(ticket_id) or self.states.load(ticket_id)
        if t is None:
            return {}, 0, False
        return {k: Usage(**vars(u)) for k, u in t.usage.items()}, t.budget, not t.closed and t.runner is not None

    def mcp_calls(self, ticket_id: str, since: int = 0, limit: int = 1000) -> tuple[list[McpCall], int]:
        """(the MCP calls numbered `since` and on, at most `limit`, oldest first; the last number so far)."""
        check_ticket_id(ticket_id)
        t = self.tickets.get(ticket_id) or self.states.load(ticket_id)
        if t is None:
            return [], 0
        return [c for c in t.mcp_calls if int(c.get("seq", 0)) >= since][:limit], t.mcp_seq

    async def close(self, ticket_id: str) -> None:
        """Revoke the capability for good and remove the socket folder."""
        check_ticket_id(ticket_id)
        t = self.tickets.pop(ticket_id, None)
        if t is not None:
            t.closed = True
            if t.runner is not None:
                runner, t.runner = t.runner, None
                await runner.cleanup()
        with contextlib.suppress(FileNotFoundError):
            self.states.path(ticket_id).unlink()
        with contextlib.suppress(FileNotFoundError):
            self.states.calls_path(ticket_id).unlink()
        d = self.layout.relay_dir(ticket_id)
        with contextlib.suppress(FileNotFoundError):
            (d / RELAY_SOCKET).unlink()
        with contextlib.suppress(FileNotFoundError, OSError):
            d.rmdir()

    async def aclose(self) -> None:
        """Stop serving (the broker stops); the state stays for a restart."""
        for t in list(self.tickets.values()):
            if t.runner is not None:
                runner, t.runner = t.runner, None
                with contextlib.suppress(Exception):
                    await runner.cleanup()
        self.tickets.clear()
        await self.mcp.aclose()
        await self.upstream.close()

    async def _serve(self, t: TicketRelay) -> web.AppRunner:
        d = self.layout.relay_dir(t.ticket_id)
        d.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(FileExistsError):
            d.mkdir(mode=0o711)
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode):
            raise InvalidArgument(f"{d} is not a directory; remove it")
        # The folder stays across restarts (a running sandbox has it mounted):
        # only the socket is replaced. The sandbox user may enter the folder
        # and connect; nobody else can reach the private runtime folder.
        os.chmod(d, 0o711)
        path = d / RELAY_SOCKET
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if len(str(path).encode()) <= SUN_PATH_MAX:
                sock.bind(str(path))
            else:   # a long runtime folder: bind through the folder's fd
                dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                try:
                    sock.bind(f"/proc/self/fd/{dfd}/{RELAY_SOCKET}")
                finally:
                    os.close(dfd)
            os.chmod(path, 0o666)
        except BaseException:
            sock.close()
            raise
        app = web.Application(client_max_size=self.max_body)
        app[_TICKET] = t
        app.router.add_route("*", "/m/{model}/{rest:.*}", self._handle)
        app.router.add_route("*", "/mcp/{server}", self._mcp_handle)
        app.router.add_route("*", "/{rest:.*}", self._no_model)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5.0,
                               logger=ServerLog(t.ticket_id, self.limiter.throttle))
        await runner.setup()
        await GuardedSite(runner, sock, t.ticket_id, t.load, self.limiter).start()
        return runner

    # -- requests ----------------------------------------------------------------
    def _count(self, t: TicketRelay, model: str, provider: str, outcome: str) -> None:
        u = t.usage.setdefault(model, Usage()) if model in t.models else None
        if u is not None:
            if outcome == "denied":
                u.refused += 1
            else:
                u.requests += 1
        if self.metrics is not None:
            with contextlib.suppress(Exception):
                self.metrics.requests.labels(provider=provider if provider in RELAY_PROVIDERS else "openai",
                                             outcome=outcome).inc()

    async def _no_model(self, request: web.Request) -> web.Response:
        t: TicketRelay = request.app[_TICKET]
        self._count(t, "", "openai", "denied")
        self.limiter.busy(t.load, request.transport, False)     # answered at once: the connection is idle
        return refusal("openai", 404, "not_found_error",
                        "use the base URL afe gave the agent: /m/<Model name>/ followed by the API path, or "
                        "/mcp/<MCP server name> for an MCP server")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        t: TicketRelay = request.app[_TICKET]
        self.limiter.busy(t.load, request.transport, True)
        try:
            return await self._checked(request, t)
        except Exception as exc:  # noqa: BLE001 - one line per interval, never a traceback per request
            self.limiter.throttle.note(f"{t.ticket_id}:internal", f"model relay of ticket {t.ticket_id}: "
                                       f"internal error {self.redactor.redact(repr(exc))[:300]}", logging.ERROR)
            return refusal("openai", 500, "api_error", "internal error of the relay (the broker's log says more)")
        finally:
            self.limiter.busy(t.load, request.transport, False)

    async def _checked(self, request: web.Request, t: TicketRelay) -> web.StreamResponse:
        name = request.match_info["model"]
        model = self.config.models.get(name)
        provider = model.provider if model is not None else "openai"
        held = [0]     # body bytes this request holds of the ticket's limit

        async def release() -> None:
            n, held[0] = held[0], 0
            self.limiter.release(t.load, n)

        try:
            try:
                if t.closed:
                    raise Refused(401, "authentication_error",
                                  "this ticket has ended; its relay capability is no longer valid")
                cap = presented_capability(request)
                if not cap:
                    raise Refused(401, "authentication_error",
                                  "no capability: send the value afe set in the agent's API key variable")
                if not hmac.compare_digest(cap.encode(), t.capability.encode()):
                    raise Refused(401, "authentication_error",
                                  "the capability is not this ticket's; use the value afe set in the agent's "
                                  "API key variable")
                if model is None or name not in t.models:
                    raise Refused(403, "permission_error",
                                  f"model {name[:64]!r} is not declared by this ticket's workflow; it may use: "
                                  + ", ".join(t.models))
                rest = request.match_info["rest"]
                check_raw_path(request.raw_path)
                path = upstream_path(provider, request.method, rest, model)
                if t.budget and t.used >= t.budget:
                    raise Refused(400, "invalid_request_error",
                                  f"the ticket's token budget of {t.budget} is spent ({t.used} tokens used); "
                                  "raise maxTokens on the Workflow (or max_tokens on the node) to allow more")
                body = await self._read_body(request, t, held)
                body = rewrite(model, rest, body)
            except Refused as r:
                self._count(t, name, provider, "denied")
                resp = refusal(provider, r.status, r.kind, r.message)
                if r.status in (408, 413, 429):
                    resp.force_close()          # the rest of an unread body is not waited for
                    if r.status == 429:
                        resp.headers["retry-after"] = "1"
                return resp
            return await self.upstream.forward(request, t, model, path, body, release, self._count, self._record)
        finally:
            await release()

    async def _read_body(self, request: web.Request, t: TicketRelay, held: list[int], limit: int = 0) -> bytes:
        """The request body, within the body limit (`limit`, else the relay's) and the ticket's limits of
        body bytes held at once and of time (`held[0]`: the bytes reserved)."""
        max_body = limit or self.max_body
        over = Refused(413, "request_too_large", f"the request body is over the relay's limit of {max_body} "
                                                 "bytes")
        busy = Refused(429, "rate_limit_error", "this ticket's requests hold the relay's limit of request-body "
                                                "bytes at once; retry when one has been sent")
        length = request.content_length
        if length is not None and length > max_body:
            raise over
        if length and not self.limiter.reserve(t.ticket_id, t.load, length):
            raise busy
        held[0] = length or 0
        if length and request.content.is_eof():     # all of it came with the head (the usual small body)
            whole = request.content.read_nowait(-1)
            if len(whole) == length:
                return whole
            raise Refused(400, "invalid_request_error", "the request body is malformed (its length or chunked "
                                                        "encoding)")
        data = bytearray()
        try:
            async with asyncio.timeout(self.limiter.limits.body_s or None):
                async for chunk in request.content.iter_chunked(READ_CHUNK):
                    if len(data) + len(chunk) > max_body:
                        raise over
                    data += chunk
                    if len(data) > held[0]:           # no or a wrong Content-Length: reserve as it comes
                        extra = len(data) - held[0]
                        if not self.limiter.reserve(t.ticket_id, t.load, extra):
                            raise busy
                        held[0] += extra
        except HttpProcessingError:
            raise Refused(400, "invalid_request_error", "the request body is malformed (its length or chunked "
                                                        "encoding)") from None
        except TimeoutError:
            self.limiter.stopped(t.ticket_id, "body_timeout", "request bodies that did not arrive within "
                                 f"{self.limiter.limits.body_s:g}s were refused")
            raise Refused(408, "request_timeout", f"the request body did not arrive within "
                                                  f"{self.limiter.limits.body_s:g}s") from None
        return bytes(data)

    def _record(self, t: TicketRelay, model: Model, inp: int, out: int) -> None:
        u = t.usage.setdefault(model.name, Usage())
        u.input_tokens += inp
        u.output_tokens += out
        if self.metrics is not None and (inp or out):
            with contextlib.suppress(Exception):
                self.metrics.tokens.labels(model=model.name, direction="input").inc(inp)
                self.metrics.tokens.labels(model=model.name, direction="output").inc(out)
        if not t.closed:
            try:
                self.states.save(t)
            except OSError as exc:
                self.limiter.throttle.note(f"{t.ticket_id}:save", f"could not save the relay usage of ticket "
                                           f"{t.ticket_id}: {exc.strerror}")

    # -- MCP servers (R43) -------------------------------------------------------------
    async def _mcp_handle(self, request: web.Request) -> web.StreamResponse:
        t: TicketRelay = request.app[_TICKET]
        server = request.match_info["server"]
        self.limiter.busy(t.load, request.transport, True)
        held = [0]

        async def release() -> None:
            n, held[0] = held[0], 0
            self.limiter.release(t.load, n)

        try:
            try:
                if t.closed:
                    raise Refused(401, "", "this ticket has ended; its relay capability is no longer valid")
                cap = presented_capability(request)
                if not cap or not hmac.compare_digest(cap.encode(), t.capability.encode()):
                    raise Refused(401, "", "the capability is missing or not this ticket's; send the header afe "
                                           "gave the agent with this MCP server")
                return await self.mcp.handle(request, t, server,
                                             lambda limit: self._read_body(request, t, held, limit), release)
            except Refused as r:
                resp = web.json_response({"jsonrpc": "2.0", "id": None, "error": {
                    "code": -32600 if r.status != 401 else -32001, "message": f"afe relay: {r.message}"}},
                    status=r.status)
                if r.status in (408, 413, 429):
                    resp.force_close()
                    if r.status == 429:
                        resp.headers["retry-after"] = "1"
                return resp
        except Exception as exc:  # noqa: BLE001 - one line per interval, never a traceback per request
            self.limiter.throttle.note(f"{t.ticket_id}:mcp:internal", f"MCP relay of ticket {t.ticket_id}: "
                                       f"internal error {self.redactor.redact(repr(exc))[:300]}", logging.ERROR)
            return web.json_response({"jsonrpc": "2.0", "id": None, "error": {
                "code": -32603, "message": "afe relay: internal error of the relay (the broker's log says more)"}},
                status=500)
        finally:
            await release()
            self.limiter.busy(t.load, request.transport, False)

    def _record_mcp(self, t: TicketRelay, server: str, call: Call, outcome: str, response_bytes: int,
                    reason: str, started: float) -> None:
        kept = t.add_mcp_call({"server": server, "tool": call.tool, "tool_sha256": call.tool_sha256,
                               "arguments_sha256": call.arguments_sha256, "outcome": outcome,
                               "request_bytes": call.request_bytes, "response_bytes": response_bytes,
                               "at_ms": int(time.time() * 1000),
                               "duration_ms": int((time.monotonic() - started) * 1000), "reason": reason[:500]})
        # kept in memory now (the scheduler reads it from there); on disk, for a restart, just after
        # the answer is on its way
        asyncio.get_running_loop().call_soon(self._save_mcp_call, t, kept)

    def _save_mcp_call(self, t: TicketRelay, call: McpCall) -> None:
        if t.closed:
            return
        try:
            self.states.append_call(t, call)
        except OSError as exc:
            self.limiter.throttle.note(f"{t.ticket_id}:save", f"could not save the relay state of ticket "
                                       f"{t.ticket_id}: {exc.strerror}")
