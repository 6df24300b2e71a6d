"""The relay's request to a Model's endpoint and its answer back (R32): the
client's credentials dropped and the real key added, the upstream URL built
from the Model's baseUrl and the endpoint's fixed path only (never
re-normalised, so no dot segment can move it), and the answer streamed back
with every secret of the broker masked (secrets.py) while its token
usage is read (usage.py)."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import aiohttp
from aiohttp import web
from yarl import URL

from services.common.config.model import Model
from services.common.host.proxies import proxy_for
from services.common.secrecy.env_secrets import SecretValue
from services.common.secrecy.redact import Redactor
from services.credentials.relay.limits import Throttle
from services.credentials.relay.providers import (
    DROP_REQUEST,
    KEEP_RESPONSE,
    auth_headers,
    refusal,
    upstream_root,
)
from services.credentials.relay.secrets import SecretForms, StreamRedactor
from services.credentials.relay.state import TicketRelay
from services.credentials.relay.usage import UsageMeter

log = logging.getLogger(__name__)

MAX_ERROR_BODY = 64 * 1024           # an upstream error body passed back
DECODED = frozenset({"", "identity", "gzip", "x-gzip", "deflate"})   # encodings the relay reads (to mask secrets)

Count = Callable[[TicketRelay, str, str, str], None]          # (ticket, model, provider, outcome)
Record = Callable[[TicketRelay, Model, int, int], None]        # (ticket, model, input, output tokens)


def upstream_url(model: Model, path: str, query: list[tuple[str, str]]) -> URL:
    """baseUrl + the endpoint's path, taken as already encoded: nothing resolves
    or decodes it again on the way out."""
    root = URL(upstream_root(model))
    url = root.with_path(root.raw_path.rstrip("/") + "/" + path, encoded=True)
    return url.with_query(query) if query else url


class Upstream:
    def __init__(self, keys: Mapping[str, SecretValue], redactor: Redactor, forms: SecretForms,
                 throttle: Throttle, *, ca_file: Path | None, proxies: Mapping[str, str]) -> None:
        self.keys = keys
        self.redactor = redactor
        self.forms = forms
        self.throttle = throttle
        self.ca_file = ca_file
        self.proxies = dict(proxies)
        self.masked: Callable[[int], None] = lambda n: None      # a metric: secrets masked in answers
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            ctx = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
            # No pool-wide connection limit: each ticket's connections are bounded (limits.py),
            # so one ticket's requests cannot hold the pool the other tickets need.
            # No cookie jar: one session serves every ticket, and a cookie one upstream answer set
            # must not ride along on another ticket's requests (nor be looked up on each request).
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ctx, limit=0), trust_env=False, auto_decompress=True,
                cookie_jar=aiohttp.DummyCookieJar())
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _mask(self, t: TicketRelay, model: Model, n: int) -> None:
        if n:
            self.masked(n)
            self.throttle.note(f"{t.ticket_id}:secret", f"model relay of ticket {t.ticket_id}: the answer of "
                               f"model {model.name!r} carried a secret of the broker; it was masked")

    def _headers(self, t: TicketRelay, model: Model, up: aiohttp.ClientResponse) -> dict[str, str]:
        out: dict[str, str] = {}
        masked = 0
        for k, v in up.headers.items():
            if not KEEP_RESPONSE.match(k.lower()):
                continue
            if self.forms.in_name(k):
                masked += 1
                continue
            v, n = self.forms.redact_text(v)
            masked += n
            out[k] = v
        self._mask(t, model, masked)
        return out

    async def forward(self, request: web.Request, t: TicketRelay, model: Model, path: str, body: bytes,
                      release: Callable[[], Awaitable[None]], count: Count, record: Record) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROP_REQUEST}
        headers["Accept-Encoding"] = "identity"
        if model.api_key_env:
            secret = self.keys.get(model.api_key_env)
            if secret is None:
                count(t, model.name, model.provider, "error")
                return refusal(model.provider, 502, "api_error",
                               f"model {model.name!r}: {model.api_key_env} (its apiKeyEnv) is not set in the "
                               "credential broker's environment")
            headers.update(auth_headers(model.provider, secret.reveal()))
        url = upstream_url(model, path, [(k, v) for k, v in request.query.items() if k != "key"])
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=model.timeout_s)
        outcome = "error"
        meter: UsageMeter | None = None
        resp: web.StreamResponse | None = None
        try:
            async with self.session().request(
                    request.method, url, data=body if body else None, headers=headers, timeout=timeout,
                    proxy=proxy_for(str(url), self.proxies), allow_redirects=False) as up:
                del body
                await release()                 # the body is sent: its bytes no longer count for the ticket
                encoding = (up.headers.get("Content-Encoding") or "").strip().lower()
                if encoding not in DECODED:
                    return refusal(model.provider, 502, "api_error",
                                   f"model {model.name!r} answered in the {encoding[:32]!r} encoding, which the "
                                   "relay cannot read; the relay asks for identity, gzip or deflate")
                out_headers = self._headers(t, model, up)
                if up.status >= 400:
                    raw = await up.content.read(MAX_ERROR_BODY)
                    data, n = self.forms.redact(raw)
                    self._mask(t, model, n)
                    count(t, model.name, model.provider, "error")
                    outcome = ""
                    return web.Response(status=up.status,
                                        text=self.redactor.redact(data.decode("utf-8", "replace")),
                                        headers={k: v for k, v in out_headers.items()
                                                 if k.lower() != "content-type"},
                                        content_type=(up.content_type or "application/json"))
                resp = web.StreamResponse(status=up.status, headers=out_headers)
                await resp.prepare(request)
                meter = UsageMeter("event-stream" in (up.headers.get("Content-Type") or ""))
                red = StreamRedactor(self.forms)
                try:
                    async for chunk in up.content.iter_any():
                        meter.feed(chunk)
                        out = red.feed(chunk)
                        if out:
                            await resp.write(out)
                    tail = red.finish()
                    if tail:
                        await resp.write(tail)
                finally:
                    self._mask(t, model, red.masked)
                await resp.write_eof()
                outcome = "ok"
                return resp
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            outcome = "timeout" if isinstance(exc, TimeoutError) else "error"
            what = "no answer in time" if isinstance(exc, TimeoutError) else type(exc).__name__
            if resp is not None:      # the answer had started: cut it, so the client sees it is incomplete
                self.throttle.note(f"{t.ticket_id}:cut", f"model relay of ticket {t.ticket_id}: an answer of "
                                   f"model {model.name!r} was cut ({what})")
                if request.transport is not None:
                    request.transport.abort()
                return resp
            self.throttle.note(f"{t.ticket_id}:{model.name}:unreachable",
                               f"model relay of ticket {t.ticket_id}: could not reach model {model.name!r} at "
                               f"{url.host}:{url.port} ({what})")
            return refusal(model.provider, 502, "api_error",
                           f"could not reach model {model.name!r} at {url.host}:{url.port} ({what}); check its "
                           "baseUrl and that the host can reach it")
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            await release()
            if outcome:
                count(t, model.name, model.provider, outcome)
            if meter is not None:
                record(t, model, *meter.finish())
