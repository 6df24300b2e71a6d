"""The ops HTTP endpoints every process serves on its own port (R23-R25):
`/livez`, `/readyz` (names of failing dependencies only) and `/metrics`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

ReadyCheck = Callable[[], Awaitable[bool]]


class OpsServer:
    """`checks` maps a dependency NAME to an async probe returning True when ready.

    A probe that raises counts as not ready; its error is logged (redacted by
    the process's filter) and never returned to the caller (R24).
    """

    def __init__(self, registry: CollectorRegistry, checks: dict[str, ReadyCheck] | None = None,
                 host: str = "127.0.0.1", port: int = 0, timeout: float = 2.0) -> None:
        self.registry = registry
        self.checks = dict(checks or {})
        self.host = host
        self.port = port
        self.timeout = timeout
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/livez", self._livez)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def _livez(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _probe(self, name: str, check: ReadyCheck) -> bool:
        try:
            return bool(await asyncio.wait_for(check(), self.timeout))
        except Exception as exc:  # noqa: BLE001 - any failure of a probe means "not ready"
            log.warning("readiness check %s failed: %s", name, exc)
            return False

    async def _readyz(self, request: web.Request) -> web.Response:
        names = list(self.checks)
        results = await asyncio.gather(*(self._probe(n, self.checks[n]) for n in names))
        failing = [n for n, ok in zip(names, results) if not ok]
        if failing:
            return web.json_response({"status": "unavailable", "failing": failing}, status=503)
        return web.json_response({"status": "ok"})

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self) -> int:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
