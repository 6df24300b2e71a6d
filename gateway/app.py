"""The gateway's HTTP application: static UI, login/logout, and /rpc."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from aiohttp import web

from services.common.redact import Redactor

from .auth import Authenticator, Denied
from .backend import SchedulerBackend
from .rpc import MAX_MESSAGE, RpcConnection

log = logging.getLogger(__name__)

SWEEP_INTERVAL = 15.0
STATIC_DIR = Path(__file__).with_name("static")

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "font-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}

AUTH_KEY: web.AppKey[Authenticator] = web.AppKey("auth", Authenticator)
BACKEND_KEY: web.AppKey[SchedulerBackend] = web.AppKey("backend", SchedulerBackend)
CONNS_KEY: web.AppKey[set] = web.AppKey("conns", set)


def _plain(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


@web.middleware
async def _guard(request: web.Request, handler):
    auth: Authenticator = request.app[AUTH_KEY]
    if not auth.site.host_allowed(request.headers.get("Host")):
        # DNS rebinding: a foreign name resolving to us. Answer nothing useful.
        resp: web.StreamResponse = _plain(421, "unknown Host; use the configured public URL")
    else:
        try:
            resp = await handler(request)
        except web.HTTPException as exc:
            resp = _plain(exc.status, exc.reason or "error")
    if not resp.prepared:
        for k, v in SECURITY_HEADERS.items():
            resp.headers.setdefault(k, v)
    return resp


async def _index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-store"})


async def _rpc(request: web.Request) -> web.StreamResponse:
    auth = request.app[AUTH_KEY]
    try:
        principal = auth.authenticate_rpc(request)
    except Denied as exc:
        auth.metrics.handshakes.labels(str(exc.status)).inc()
        log.info("rpc handshake refused (%s): %s", exc.status, exc.reason)
        return _plain(exc.status, exc.reason,
                      {"Retry-After": str(exc.retry_after)} if exc.retry_after else None)
    ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE, heartbeat=30, autoping=True)
    if not ws.can_prepare(request).ok:
        return _plain(400, "/rpc is a WebSocket endpoint")
    await ws.prepare(request)
    for k, v in SECURITY_HEADERS.items():
        ws.headers.setdefault(k, v)
    conn = RpcConnection(ws, principal, request.app[BACKEND_KEY], auth, request.app["redactor"])
    conns = request.app[CONNS_KEY]
    conns.add(conn)
    auth.metrics.handshakes.labels("ok").inc()
    gauge = auth.metrics.connections.labels(principal.name)
    gauge.inc()
    try:
        await conn.serve()
    finally:
        gauge.dec()
        conns.discard(conn)
    return ws


def build_app(auth: Authenticator, backend: SchedulerBackend, redactor: Redactor) -> web.Application:
    app = web.Application(middlewares=[_guard], client_max_size=64 * 1024)
    app[AUTH_KEY] = auth
    app[BACKEND_KEY] = backend
    app["redactor"] = redactor
    conns: set[RpcConnection] = set()
    app[CONNS_KEY] = conns

    def on_token_change() -> None:
        for conn in list(conns):
            if not auth.still_valid(conn.principal):
                conn.close_for_auth()

    auth.tokens.on_change(on_token_change)

    app.router.add_get("/", _index)
    app.router.add_post("/auth/login", auth.login)
    app.router.add_post("/auth/logout", auth.logout)
    app.router.add_get("/auth/session", auth.whoami)
    app.router.add_get("/rpc", _rpc)
    app.router.add_static("/static/", STATIC_DIR, show_index=False, follow_symlinks=False)

    async def _sweep(app: web.Application):
        """Close cookie sessions whose cookie expired while the socket stayed open."""
        async def loop() -> None:
            while True:
                await asyncio.sleep(SWEEP_INTERVAL)
                for conn in list(conns):
                    if not auth.still_valid(conn.principal):
                        conn.close_for_auth()
        task = asyncio.get_running_loop().create_task(loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(_sweep)

    async def _close_all(app: web.Application) -> None:
        for conn in list(conns):
            await conn.ws.close(code=1001, message=b"server shutting down")

    app.on_shutdown.append(_close_all)
    return app
