"""The gateway with its failure limiting as it was before R40, for positive
controls: ONE limiter for every surface (logins, /rpc bearers, webhook
signatures), consulted BEFORE the credential is checked, so once an address
is over the budget the right token and a correctly signed delivery are
refused 429 too.

    python -m tests.gateway.old_lockout <gateway.main arguments>

Everything else is today's gateway: only the order and the sharing are put
back, by wrapping the handlers and the limiter's constructor."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from gateway import auth, hooks, main
from gateway.ratelimit import FailureLimiter, retry_after_header


def _one_limiter() -> Callable[..., FailureLimiter]:
    """Every FailureLimiter the gateway makes is the first one (its budget: --max-failed-logins)."""
    made: list[FailureLimiter] = []

    def make(max_failures: int = 10) -> FailureLimiter:
        if not made:
            made.append(FailureLimiter(max_failures=max_failures))
        return made[0]
    return make


def _wait(limiter: FailureLimiter, request: web.Request) -> float:
    return limiter.retry_after(request.remote or "unknown")


def _limiter_first(handler: Callable[[Any, web.Request], Awaitable[web.Response]]):
    async def handle(self: Any, request: web.Request) -> web.Response:
        wait = _wait(self.limiter, request)
        if wait > 0:
            return web.json_response({"reason": "rate_limited"}, status=429, headers=retry_after_header(wait))
        return await handler(self, request)
    return handle


def _rpc_limiter_first(check: Callable[[Any, web.Request], auth.Principal]):
    def authenticate_rpc(self: Any, request: web.Request) -> auth.Principal:
        if request.headers.get("Authorization") is not None:
            wait = _wait(self.limiter, request)
            if wait > 0:
                raise auth.Denied(429, "too many failed tokens or logins from this address",
                                  retry_after=int(wait) + 1)
        return check(self, request)
    return authenticate_rpc


def install() -> None:
    main.FailureLimiter = _one_limiter()  # type: ignore[misc, assignment]
    auth.Authenticator.login = _limiter_first(auth.Authenticator.login)  # type: ignore[method-assign]
    auth.Authenticator.authenticate_rpc = _rpc_limiter_first(  # type: ignore[method-assign]
        auth.Authenticator.authenticate_rpc)
    hooks.GitHubWebhook.handle = _limiter_first(hooks.GitHubWebhook.handle)  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    sys.exit(main.main(sys.argv[1:]))
