"""Login, logout and the /rpc handshake check (R20-R22).

- `POST /auth/login` compares the submitted token with `hmac.compare_digest`
  on bytes and sets a signed, stateless cookie; failures are rate-limited per
  client address; a POST whose `Origin` is not ours is refused (login CSRF).
- The /rpc handshake takes either `Authorization: Bearer <token>` (the CLI)
  or the cookie, and the cookie only with `Origin` equal to our origin.
- The token is checked first, in constant time; a valid one always passes
  (R40). Failed bearer tokens and failed logins count against one
  per-address limiter of the UI/CLI surface (webhook signatures have their
  own, ratelimit.py): past its budget a wrong token gets 429 with
  Retry-After instead of 401 (R38), and the right token from the same
  address still gets in, so failing on purpose locks nobody out.
"""

from __future__ import annotations

import hmac
import json
import logging
from dataclasses import dataclass
from typing import NoReturn

from aiohttp import web

from . import cookies
from .metrics import GatewayMetrics
from .ratelimit import FailureLimiter, retry_after_header
from .site import Site
from .tokens import TokenSource

log = logging.getLogger(__name__)

MAX_LOGIN_BODY = 4096


@dataclass(frozen=True)
class Principal:
    """Who is on a connection: `ui` (cookie) or `cli` (bearer)."""

    name: str
    generation: int
    session: cookies.Session | None = None


class Denied(Exception):
    def __init__(self, status: int, reason: str, retry_after: int = 0) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.retry_after = retry_after


class Authenticator:
    def __init__(self, tokens: TokenSource, site: Site, limiter: FailureLimiter,
                 cookie_ttl: int = cookies.DEFAULT_TTL, metrics: GatewayMetrics | None = None) -> None:
        self.metrics = metrics or GatewayMetrics(None)
        self.tokens = tokens
        self.site = site
        self.limiter = limiter
        self.cookie_ttl = cookie_ttl
        self._key: tuple[int, bytes] | None = None

    # -- primitives -------------------------------------------------------
    def token_matches(self, presented: str) -> bool:
        current = self.tokens.current()
        if not current:
            return False
        return hmac.compare_digest(presented.encode("utf-8", "surrogatepass"), current.encode("utf-8"))

    def key(self) -> bytes:
        self.tokens.current()  # notice a rotation before choosing the key
        gen = self.tokens.generation
        if self._key is None or self._key[0] != gen:
            self._key = (gen, cookies.derive_key(self.tokens.current()))
        return self._key[1]

    def session(self, request: web.Request) -> cookies.Session | None:
        if not self.tokens.current():
            return None
        return cookies.verify(self.key(), request.cookies.get(cookies.COOKIE_NAME))

    def still_valid(self, principal: Principal) -> bool:
        self.tokens.current()
        if principal.generation != self.tokens.generation:
            return False
        return principal.session is None or not principal.session.expired()

    # -- /rpc handshake ---------------------------------------------------
    def authenticate_rpc(self, request: web.Request) -> Principal:
        if request.query_string:
            raise Denied(400, "credentials and parameters are not accepted in the /rpc URL; "
                              "send Authorization: Bearer <token> or log in")
        origin = request.headers.get("Origin")
        authz = request.headers.get("Authorization")
        if authz is not None:
            scheme, _, value = authz.partition(" ")
            if scheme.lower() != "bearer" or not value:
                raise Denied(401, "Authorization must be 'Bearer <token>'")
            if origin is not None and not self.site.origin_is_ours(origin):
                raise Denied(403, "requests from another origin are refused")
            if not self.token_matches(value.strip()):
                self._bearer_failed(self._client(request))
            return Principal("cli", self.tokens.generation)
        if cookies.COOKIE_NAME not in request.cookies:
            raise Denied(401, "log in first, or send Authorization: Bearer <token>")
        if not self.site.origin_is_ours(origin):
            raise Denied(403, "the session cookie is only accepted from this server's own origin")
        session = self.session(request)
        if session is None:
            raise Denied(401, "the session is not valid (expired, or the token was rotated); log in again")
        return Principal("ui", self.tokens.generation, session)

    def _bearer_failed(self, client: str) -> NoReturn:
        wait = self.limiter.failed(client)
        if wait > 0:
            raise Denied(429, "too many failed tokens or logins from this address; check the token, "
                              "wait and try again", retry_after=int(wait) + 1)
        log.info("failed bearer token from %s", client)
        raise Denied(401, "the bearer token is not valid (was it rotated?)")

    # -- HTTP handlers ----------------------------------------------------
    @staticmethod
    def _client(request: web.Request) -> str:
        return request.remote or "unknown"

    async def login(self, request: web.Request) -> web.Response:
        if not self.site.origin_is_ours(request.headers.get("Origin")):
            self.metrics.logins.labels("foreign_origin").inc()
            return _json_error(403, "login is only accepted from this server's own pages")
        client = self._client(request)
        token = await _read_token(request)
        if token is None or not self.token_matches(token):
            wait = self.limiter.failed(client)
            if wait > 0:
                self.metrics.logins.labels("rate_limited").inc()
                return _json_error(429, "too many failed logins from this address; check the token, wait "
                                   "and try again", headers=retry_after_header(wait))
            self.metrics.logins.labels("failed").inc()
            log.info("failed login from %s", client)
            return _json_error(401, "that token is not valid")
        value = cookies.sign(self.key(), ttl=self.cookie_ttl)
        resp = web.json_response({"ok": True}, headers={"Cache-Control": "no-store"})
        resp.headers["Set-Cookie"] = cookies.set_cookie_header(value, secure=self.site.secure,
                                                               max_age=self.cookie_ttl)
        self.metrics.logins.labels("ok").inc()
        log.info("login from %s", client)
        return resp

    async def logout(self, request: web.Request) -> web.Response:
        if not self.site.origin_is_ours(request.headers.get("Origin")):
            return _json_error(403, "logout is only accepted from this server's own pages")
        resp = web.json_response({"ok": True}, headers={"Cache-Control": "no-store"})
        resp.headers["Set-Cookie"] = cookies.clear_cookie_header(secure=self.site.secure)
        return resp

    async def whoami(self, request: web.Request) -> web.Response:
        session = self.session(request)
        if session is None:
            return _json_error(401, "not logged in")
        return web.json_response({"ok": True, "expires_at": session.expires_at},
                                 headers={"Cache-Control": "no-store"})


async def _read_token(request: web.Request) -> str | None:
    if request.content_length is not None and request.content_length > MAX_LOGIN_BODY:
        return None
    raw = await request.read()  # bounded by the app's client_max_size
    if len(raw) > MAX_LOGIN_BODY:
        return None
    ctype = request.content_type
    try:
        if ctype == "application/json":
            doc = json.loads(raw.decode("utf-8"))
            token = doc.get("token") if isinstance(doc, dict) else None
        elif ctype == "application/x-www-form-urlencoded":
            from urllib.parse import parse_qs

            found = parse_qs(raw.decode("utf-8"), keep_blank_values=True).get("token")
            token = found[0] if found else None
        else:
            return None
    except (UnicodeDecodeError, ValueError):
        return None
    return token if isinstance(token, str) else None


def _json_error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status,
                             headers={"Cache-Control": "no-store", **(headers or {})})
