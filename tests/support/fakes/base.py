"""Shared plumbing for the aiohttp-based API fakes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Seen:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body) if self.body else None


@dataclass
class Failure:
    status: int
    body: str
    headers: dict[str, str] = field(default_factory=dict)


class FakeServer:
    """Start with `async with Fake(...) as f:`; `f.url` is the base URL."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.failures: list[Failure] = []
        self.port = 0
        self.ssl_context = None          # an ssl.SSLContext serves HTTPS instead of HTTP
        self._runner: web.AppRunner | None = None

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{self.port}"

    def fail_next(self, status: int, body: str = "", headers: dict[str, str] | None = None,
                  times: int = 1) -> None:
        """The next `times` requests get this answer instead of the real one."""
        for _ in range(times):
            self.failures.append(Failure(status, body, dict(headers or {})))

    @web.middleware
    async def _record(self, request: web.Request, handler):
        body = await request.read()
        self.seen.append(Seen(request.method, request.path, request.query_string,
                              dict(request.headers), body))
        if self.failures:
            f = self.failures.pop(0)
            return web.Response(status=f.status, text=f.body, headers=f.headers,
                                content_type="application/json" if f.body.startswith("{") else "text/plain")
        return await handler(request)

    async def __aenter__(self):
        app = web.Application(middlewares=[self._record])
        self.routes(app)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.ssl_context)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def token_seen_outside(self, token: str, header: str) -> bool:
        """True if `token` appeared anywhere but the named header."""
        for s in self.seen:
            others = {k: v for k, v in s.headers.items() if k.lower() != header.lower()}
            if token in s.path or token in s.query or token in repr(others) or token.encode() in s.body:
                return True
        return False
