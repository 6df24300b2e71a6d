"""The ops HTTP endpoints every process serves on its own port (R23-R25):
`/livez`, `/readyz` (names of failing dependencies only) and `/metrics`.

Every request must name this server in its `Host` header (R38, DNS
rebinding): the bound address (an IPv6 literal in brackets), `localhost`
when bound to loopback, any IP literal when bound to every address, or a
name the operator gave with `--ops-name`; an optional `:port` is allowed.
Anything else gets 421.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import re
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from services.common.errors import FailedPrecondition

log = logging.getLogger(__name__)

ReadyCheck = Callable[[], Awaitable[bool]]

_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$")
_WILDCARDS = ("", "0.0.0.0", "::")


def check_ops_name(name: str) -> str:
    """A host name (or IP literal) the operator lets the ops port answer to."""
    n = name.strip().lower()
    if _ip(n) is None and not _NAME_RE.match(n):
        raise ValueError(f"--ops-name {name[:80]!r} is not a host name or IP address")
    return str(_ip(n)) if _ip(n) is not None else n


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None


def _split_host(header: str) -> str | None:
    """The host part of a Host header (IPv6 without brackets), or None when malformed."""
    h = header.strip().lower()
    if h.startswith("["):
        end = h.find("]")
        if end < 0:
            return None
        host, rest = h[1:end], h[end + 1:]
        addr = _ip(host)
        if addr is None or addr.version != 6:
            return None
    else:
        host, sep, port = h.partition(":")
        rest = sep + port
    if rest and not (rest.startswith(":") and rest[1:].isdigit() and len(rest) <= 6):
        return None
    return host or None


class HostPolicy:
    """Which Host values a server bound to `bind` answers (R38)."""

    def __init__(self, bind: str, names: tuple[str, ...] = ()) -> None:
        b = bind.strip("[]").lower()
        self.any_ip = b in _WILDCARDS
        addr = _ip(b)
        self.names = {check_ops_name(n) for n in names}
        if not self.any_ip:
            self.names.add(str(addr) if addr is not None else b)
        if self.any_ip or (addr is not None and addr.is_loopback) or b == "localhost":
            self.names.add("localhost")

    def allows(self, header: str | None) -> bool:
        host = _split_host(header) if header else None
        if host is None:
            return False
        addr = _ip(host)
        if addr is not None:
            return self.any_ip or str(addr) in self.names
        return host.rstrip(".") in self.names


class OpsServer:
    """`checks` maps a dependency NAME to an async probe returning True when ready.

    A probe that raises counts as not ready; its error is logged (redacted by
    the process's filter) and never returned to the caller (R24).
    """

    def __init__(self, registry: CollectorRegistry, checks: dict[str, ReadyCheck] | None = None,
                 host: str = "127.0.0.1", port: int = 0, timeout: float = 2.0,
                 names: tuple[str, ...] = ()) -> None:
        self.registry = registry
        self.hosts = HostPolicy(host, tuple(names))
        self.checks = dict(checks or {})
        self.host = host
        self.port = port
        self.timeout = timeout
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._host_guard])
        app.router.add_get("/livez", self._livez)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        return app

    @web.middleware
    async def _host_guard(self, request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:
        if not self.hosts.allows(request.headers.get("Host")):
            return web.json_response(
                {"error": "unknown Host: use the address the ops port is bound to, or let the process "
                          "answer to this name with --ops-name"}, status=421)
        return await handler(request)

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
        failing = [n for n, ok in zip(names, results, strict=True) if not ok]
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
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            self._runner = None
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            raise FailedPrecondition(f"cannot listen on {self.host}:{self.port} for /livez, /readyz and "
                                     f"/metrics ({why}): stop what holds the port, or pass another "
                                     "--ops-port (0 picks a free one)") from None
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
