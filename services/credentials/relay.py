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
   Model the ticket's workflow did not declare, and any path that is not one
   of the provider's inference endpoints (`ROUTES`),
4. refuses it once the ticket's token budget is spent,
5. drops every credential the client sent (auth headers, cookies, `key=`),
   pins the Model's model id in the request, adds the real key the way the
   provider expects, and sends it to the Model's baseUrl from this host,
6. streams the answer back chunk by chunk (SSE or not) while reading the
   token usage from it, and counts that usage against the ticket.

Refusals use the provider's own error shape (see `_refusal`): 401 for a
missing, wrong or ended capability, 403 for an undeclared Model, 404 for a
path that is not an inference endpoint, 413 for a body over the limit, and
400 for a spent budget (400, not 429: the SDKs retry 429 for minutes, while
a spent budget is final for this ticket).

State (capability, declared models, budget, usage) is kept in the broker's
private folder so a restarted broker serves the same capability and budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import re
import secrets
import socket
import ssl
import stat
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from services.common.config import Config, Model
from services.common.errors import InvalidArgument, NotFound
from services.common.layout import Layout, check_ticket_id
from services.common.redact import Redactor
from services.common.relayenv import RELAY_PROVIDERS, RELAY_SOCKET
from services.common.secrets import SecretValue

from .httpclient import proxy_for

log = logging.getLogger(__name__)

MAX_BODY = 32 * 1024 * 1024          # a request body (a long conversation with images fits)
MAX_ERROR_BODY = 64 * 1024           # an upstream error body passed back
MAX_SSE_LINE = 1024 * 1024           # an SSE line longer than this is not parsed for usage
MAX_JSON_USAGE = 8 * 1024 * 1024     # a non-SSE answer longer than this is not parsed for usage
SUN_PATH_MAX = 107

# (method, path pattern) per provider: the inference endpoints an agent needs,
# nothing that manages the account (files, fine-tuning, keys, batches).
ROUTES: dict[str, tuple[tuple[str, re.Pattern[str]], ...]] = {
    "anthropic": (("POST", re.compile(r"v1/messages")),
                  ("POST", re.compile(r"v1/messages/count_tokens")),
                  ("GET", re.compile(r"v1/models(?:/[A-Za-z0-9._:@-]+)?"))),
    "openai": (("POST", re.compile(r"v1/chat/completions")),
               ("POST", re.compile(r"v1/responses")),
               ("POST", re.compile(r"v1/completions")),
               ("POST", re.compile(r"v1/embeddings")),
               ("GET", re.compile(r"v1/models(?:/[A-Za-z0-9._:@/-]+)?"))),
    "gemini": (("POST", re.compile(r"(?:v1|v1beta|v1alpha)/models/[A-Za-z0-9._@-]+"
                                   r":(?:generateContent|streamGenerateContent|countTokens)")),
               ("GET", re.compile(r"(?:v1|v1beta|v1alpha)/models(?:/[A-Za-z0-9._@-]+)?"))),
}
_GEMINI_MODEL = re.compile(r"^((?:v1|v1beta|v1alpha)/models/)([A-Za-z0-9._@-]+)(:.*)$")

# Request headers never forwarded: the client's credentials, hop-by-hop and
# framing headers (aiohttp sets its own), and proxy/forwarding information.
_DROP_REQUEST = frozenset({
    "authorization", "x-api-key", "x-goog-api-key", "api-key", "cookie", "proxy-authorization",
    "host", "content-length", "transfer-encoding", "connection", "keep-alive", "te", "trailer", "upgrade",
    "accept-encoding", "expect", "forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto",
    "x-real-ip", "via", "proxy-connection"})
# Response headers passed back.
_KEEP_RESPONSE = re.compile(r"^(?:content-type|cache-control|retry-after|request-id|x-request-id|"
                            r"anthropic-[a-z0-9-]+|openai-[a-z0-9-]+|x-ratelimit-[a-z0-9-]+)$")


@dataclass
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    requests: int = 0
    refused: int = 0

    @property
    def total(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass
class TicketRelay:
    ticket_id: str
    capability: str
    models: tuple[str, ...]
    budget: int
    usage: dict[str, Usage] = field(default_factory=dict)
    closed: bool = False
    runner: web.AppRunner | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def used(self) -> int:
        return sum(u.total for u in self.usage.values())

    def state(self) -> dict:
        return {"capability": self.capability, "models": list(self.models), "budget": self.budget,
                "usage": {k: [u.input_tokens, u.output_tokens, u.requests, u.refused]
                          for k, u in self.usage.items()}}


_TICKET = web.AppKey("ticket", TicketRelay)


class Refused(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


def _refusal(provider: str, status: int, kind: str, message: str) -> web.Response:
    """An error in the provider's own shape, so the agent shows the message."""
    message = f"afe relay: {message}"
    if provider == "anthropic":
        body: dict = {"type": "error", "error": {"type": kind, "message": message}}
    elif provider == "gemini":
        body = {"error": {"code": status, "message": message, "status": {
            400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
            413: "INVALID_ARGUMENT", 502: "UNAVAILABLE"}.get(status, "UNKNOWN")}}
    else:
        body = {"error": {"message": message, "type": kind, "code": kind}}
    return web.json_response(body, status=status)


def presented_capability(request: web.Request) -> str:
    """The credential the client sent, wherever its SDK puts an API key."""
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    for h in ("x-api-key", "x-goog-api-key", "api-key"):
        if request.headers.get(h):
            return request.headers[h].strip()
    return request.query.get("key", "")


# -- usage ----------------------------------------------------------------------


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def usage_of(obj: Any) -> tuple[int, int] | None:
    """(input, output) tokens in one JSON document or SSE event of any of the
    four APIs: Anthropic `usage` / `message.usage` (cache tokens included),
    OpenAI chat `usage` (prompt/completion), Responses `response.usage`,
    Gemini `usageMetadata` (thoughts count as output)."""
    if not isinstance(obj, dict):
        return None
    found = None
    for holder in (obj, obj.get("message"), obj.get("response")):
        if not isinstance(holder, dict):
            continue
        u = holder.get("usage")
        if isinstance(u, dict):
            inp = (_int(u.get("input_tokens")) + _int(u.get("cache_creation_input_tokens"))
                   + _int(u.get("cache_read_input_tokens")) + _int(u.get("prompt_tokens")))
            out = _int(u.get("output_tokens")) + _int(u.get("completion_tokens"))
            found = (max(inp, found[0]), max(out, found[1])) if found else (inp, out)
    meta = obj.get("usageMetadata")
    if isinstance(meta, dict):
        inp = _int(meta.get("promptTokenCount"))
        out = _int(meta.get("candidatesTokenCount")) + _int(meta.get("thoughtsTokenCount"))
        found = (max(inp, found[0]), max(out, found[1])) if found else (inp, out)
    return found


class UsageMeter:
    """Reads the usage from an answer as it streams past (never holding a
    whole SSE answer). Counts are cumulative in every API, so the largest
    value seen per direction is the answer's usage."""

    def __init__(self, sse: bool) -> None:
        self.sse = sse
        self.input = 0
        self.output = 0
        self._line = bytearray()
        self._skip = False
        self._doc = bytearray()
        self._doc_over = False

    def _take(self, obj: Any) -> None:
        for o in (obj if isinstance(obj, list) else [obj]):
            u = usage_of(o)
            if u:
                self.input, self.output = max(self.input, u[0]), max(self.output, u[1])

    def _event_line(self, line: bytes) -> None:
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data and data != b"[DONE]":
                with contextlib.suppress(ValueError):
                    self._take(json.loads(data))

    def feed(self, chunk: bytes) -> None:
        if not self.sse:
            if not self._doc_over:
                if len(self._doc) + len(chunk) > MAX_JSON_USAGE:
                    self._doc_over = True
                    self._doc.clear()
                else:
                    self._doc += chunk
            return
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                rest = chunk[start:]
                if not self._skip:
                    if len(self._line) + len(rest) > MAX_SSE_LINE:
                        self._skip, self._line = True, bytearray()
                    else:
                        self._line += rest
                return
            if not self._skip:
                self._line += chunk[start:nl]
                self._event_line(bytes(self._line).rstrip(b"\r"))
            self._line, self._skip = bytearray(), False
            start = nl + 1

    def finish(self) -> tuple[int, int]:
        if self.sse and self._line and not self._skip:
            self._event_line(bytes(self._line))
        elif not self.sse and self._doc and not self._doc_over:
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                self._take(json.loads(self._doc))
        return self.input, self.output


# -- the relay ------------------------------------------------------------------


def upstream_root(model: Model) -> str:
    """Where `/m/<name>/<path>` goes: the Model's baseUrl, for openai without
    its conventional trailing `/v1` (clients send `v1/...` themselves)."""
    base = model.base_url.rstrip("/")
    if model.provider == "openai" and base.endswith("/v1"):
        base = base[:-3]
    return base


def auth_headers(provider: str, key: str) -> dict[str, str]:
    if provider == "anthropic":
        return {"x-api-key": key}
    if provider == "gemini":
        return {"x-goog-api-key": key}
    return {"Authorization": f"Bearer {key}"}


def check_route(provider: str, method: str, path: str) -> None:
    for m, pattern in ROUTES.get(provider, ()):
        if m == method and pattern.fullmatch(path):
            return
    raise Refused(404, "not_found_error",
                  f"{method} /{path} is not an inference endpoint of a {provider} model; the relay forwards "
                  "only " + ", ".join(f"{m} /{p.pattern}" for m, p in ROUTES.get(provider, ())))


def rewrite(model: Model, path: str, body: bytes) -> tuple[str, bytes]:
    """Pin the Model's model id (the agent cannot pick another model) and ask
    an OpenAI chat stream for its usage."""
    if model.provider == "gemini":
        m = _GEMINI_MODEL.match(path)
        if m and model.model:
            path = f"{m[1]}{model.model}{m[3]}"
        return path, body
    if not body:
        return path, body
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise Refused(400, "invalid_request_error", "the request body is not JSON") from None
    if not isinstance(doc, dict):
        raise Refused(400, "invalid_request_error", "the request body must be a JSON object")
    if model.model:
        doc["model"] = model.model
    if model.provider == "openai" and path == "v1/chat/completions" and doc.get("stream"):
        opts = doc.get("stream_options")
        doc["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    return path, json.dumps(doc, separators=(",", ":")).encode()


class RelayHub:
    """Every ticket's relay in this broker process (see the module doc)."""

    def __init__(self, config: Config, layout: Layout, keys: Mapping[str, SecretValue], redactor: Redactor, *,
                 state_dir: Path, ca_file: Path | None = None, proxies: Mapping[str, str] | None = None,
                 max_body: int = MAX_BODY) -> None:
        self.config = config
        self.layout = layout
        self.keys = keys
        self.redactor = redactor
        self.state_dir = state_dir
        self.ca_file = ca_file
        self.proxies = dict(proxies or {})
        self.max_body = max_body
        self.metrics: Any = None          # services.common.metrics.RelayMetrics, set by main
        self.tickets: dict[str, TicketRelay] = {}
        self._session: aiohttp.ClientSession | None = None

    # -- lifecycle ---------------------------------------------------------------
    def _state_file(self, ticket_id: str) -> Path:
        return self.state_dir / f"{check_ticket_id(ticket_id)}.json"

    def _save(self, t: TicketRelay) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self._state_file(t.ticket_id)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(t.state(), f)
        os.replace(tmp, path)

    def _load(self, ticket_id: str) -> TicketRelay | None:
        try:
            doc = json.loads(self._state_file(ticket_id).read_text())
            usage = {k: Usage(*[int(x) for x in v]) for k, v in doc.get("usage", {}).items()}
            return TicketRelay(ticket_id, str(doc["capability"]), tuple(doc["models"]), int(doc["budget"]), usage)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("relay state of ticket %s is unreadable; a new capability is made", ticket_id)
            return None

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

    async def open(self, ticket_id: str, models: list[str], budget: int) -> str:
        """Serve the ticket's relay (idempotent); returns its capability."""
        check_ticket_id(ticket_id)
        names = self._check_models(models)
        if not names:
            raise InvalidArgument("a relay needs at least one Model name")
        if budget < 0:
            raise InvalidArgument("budget_tokens must be >= 0 (0 = no budget)")
        t = self.tickets.get(ticket_id) or self._load(ticket_id)
        if t is None:
            t = TicketRelay(ticket_id, "afe-relay-" + secrets.token_urlsafe(32), names, budget)
        self.tickets[ticket_id] = t
        async with t.lock:
            t.models, t.budget, t.closed = names, budget, False
            self._save(t)
            if t.runner is None:
                t.runner = await self._serve(t)
                log.info("relay of ticket %s serves %s (budget %s)", ticket_id, ", ".join(names), budget or "none")
        return t.capability

    async def resume(self) -> int:
        """After a restart: serve again every relay whose ticket has not ended."""
        n = 0
        if not self.state_dir.is_dir():
            return 0
        for p in sorted(self.state_dir.glob("*.json")):
            t = self._load(p.stem)
            if t is None or t.ticket_id in self.tickets:
                continue
            try:
                await self.open(t.ticket_id, list(t.models), t.budget)
                n += 1
            except Exception as exc:  # noqa: BLE001 - one bad relay must not stop the others
                log.warning("could not serve the relay of ticket %s again: %s", t.ticket_id,
                            self.redactor.redact(str(exc)))
        return n

    def usage(self, ticket_id: str) -> tuple[dict[str, Usage], int, bool]:
        """(usage per model, budget, open)."""
        check_ticket_id(ticket_id)
        t = self.tickets.get(ticket_id) or self._load(ticket_id)
        if t is None:
            return {}, 0, False
        return {k: Usage(**vars(u)) for k, u in t.usage.items()}, t.budget, not t.closed and t.runner is not None

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
            self._state_file(ticket_id).unlink()
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
        if self._session is not None:
            await self._session.close()
            self._session = None

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
        app.router.add_route("*", "/{rest:.*}", self._no_model)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        return runner

    def _session_for(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            ctx = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ctx, limit=256), trust_env=False, auto_decompress=False)
        return self._session

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
        return _refusal("openai", 404, "not_found_error",
                        "use the base URL afe gave the agent: /m/<Model name>/ followed by the API path")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        t: TicketRelay = request.app[_TICKET]
        name = request.match_info["model"]
        model = self.config.models.get(name)
        provider = model.provider if model is not None else "openai"
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
            check_route(provider, request.method, rest)
            if t.budget and t.used >= t.budget:
                raise Refused(400, "invalid_request_error",
                              f"the ticket's token budget of {t.budget} is spent ({t.used} tokens used); "
                              "raise maxTokens on the Workflow (or max_tokens on the node) to allow more")
            if request.content_length is not None and request.content_length > self.max_body:
                raise Refused(413, "request_too_large",
                              f"the request body is over the relay's limit of {self.max_body} bytes")
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise Refused(413, "request_too_large",
                              f"the request body is over the relay's limit of {self.max_body} bytes") from None
            rest, body = rewrite(model, rest, body)
        except Refused as r:
            self._count(t, name, provider, "denied")
            return _refusal(provider, r.status, r.kind, r.message)
        return await self._forward(request, t, model, rest, body)

    async def _forward(self, request: web.Request, t: TicketRelay, model: Model, rest: str,
                       body: bytes) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
        headers["Accept-Encoding"] = "identity"
        if model.api_key_env:
            secret = self.keys.get(model.api_key_env)
            if secret is None:
                self._count(t, model.name, model.provider, "error")
                return _refusal(model.provider, 502, "api_error",
                                f"model {model.name!r}: {model.api_key_env} (its apiKeyEnv) is not set in the "
                                "credential broker's environment")
            headers.update(auth_headers(model.provider, secret.reveal()))
        query = [(k, v) for k, v in request.query.items() if k != "key"]
        url = f"{upstream_root(model)}/{rest}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=model.timeout_s)
        outcome = "error"
        meter: UsageMeter | None = None
        try:
            async with self._session_for().request(
                    request.method, url, data=body if body else None, headers=headers, timeout=timeout,
                    proxy=proxy_for(url, self.proxies), allow_redirects=False) as up:
                out_headers = {k: v for k, v in up.headers.items() if _KEEP_RESPONSE.match(k.lower())}
                if up.status >= 400:
                    text = (await up.content.read(MAX_ERROR_BODY)).decode("utf-8", "replace")
                    self._count(t, model.name, model.provider, "error")
                    outcome = ""
                    return web.Response(status=up.status, text=self.redactor.redact(text),
                                        headers={k: v for k, v in out_headers.items()
                                                 if k.lower() != "content-type"},
                                        content_type=(up.content_type or "application/json"))
                resp = web.StreamResponse(status=up.status, headers=out_headers)
                await resp.prepare(request)
                meter = UsageMeter("event-stream" in (up.headers.get("Content-Type") or ""))
                async for chunk in up.content.iter_any():
                    meter.feed(chunk)
                    await resp.write(chunk)
                await resp.write_eof()
                outcome = "ok"
                return resp
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            if meter is not None:       # the answer had started: it just ends
                raise
            what = "no answer in time" if isinstance(exc, TimeoutError) else type(exc).__name__
            outcome = "timeout" if isinstance(exc, TimeoutError) else "error"
            return _refusal(model.provider, 502, "api_error",
                            f"could not reach model {model.name!r} at {urllib.parse.urlsplit(url).netloc} "
                            f"({what}); check its baseUrl and that the host can reach it")
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            if outcome:
                self._count(t, model.name, model.provider, outcome)
            if meter is not None:
                self._record(t, model, *meter.finish())

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
                self._save(t)
            except OSError as exc:
                log.warning("could not save the relay usage of ticket %s: %s", t.ticket_id, exc.strerror)
