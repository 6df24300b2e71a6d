"""Composition root of the gateway: token, site, scheduler client, HTTP app
(and POST /hooks/github when the GitHub webhook secret is set, docs/GITHUB.md).

    python -m gateway.main --config DIR --data DIR --run DIR --link-fd N --status-fd N \
        --ops-host H --ops-port P [--listen HOST:PORT] [--public-url URL] [--token-file PATH]

The UI token comes from AFE_UI_TOKEN (taken out of the environment at once)
or else from --token-file (default <data>/ui-token), which is watched so that
`afe token rotate` ends every session.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from pathlib import Path

from aiohttp import web

from services.common import errors
from services.common.layout import DEFAULT_PORTS
from services.common.observability import metrics, telemetry
from services.common.process import make_context, parse_args, run_until_signalled
from services.common.secrecy.env_secrets import take_secret_env

from . import hooks
from .app import build_app
from .auth import Authenticator
from .backend import SchedulerBackend
from .metrics import GatewayMetrics
from .ratelimit import FailureLimiter
from .site import Site, parse_listen
from .tokens import TokenSource

log = logging.getLogger(__name__)


def _extra(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_PORTS['gateway']}",
                   help="HOST:PORT for the UI and /rpc (port 0 picks a free one)")
    p.add_argument("--public-url", default=None,
                   help="the URL people open (its origin is the only one trusted); default http://<listen>")
    p.add_argument("--max-failed-logins", type=_at_least_one, default=10, metavar="N",
                   help="failed logins and /rpc bearer tokens per client address per minute before it gets "
                        "429 (a valid token always passes)")
    p.add_argument("--max-bad-webhook-signatures", type=_at_least_one, default=10, metavar="N",
                   help="GitHub deliveries with a missing or wrong signature per client address per minute "
                        "before it gets 429 (a correctly signed delivery always passes)")
    p.add_argument("--github-webhook-secret-env", default="AFE_GITHUB_WEBHOOK_SECRET", metavar="NAME",
                   help="environment variable holding the GitHub webhook secret; when it is set, "
                        "POST /hooks/github takes deliveries (docs/GITHUB.md)")
    p.add_argument("--token-file", default=None,
                   help="0600 file holding the UI token, used when AFE_UI_TOKEN is unset "
                        "(default <data>/ui-token)")


def _at_least_one(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a count of failures; give 1 or more")
    return n


async def _main(argv: list[str] | None) -> None:
    args = parse_args("gateway", DEFAULT_PORTS["gateway_ops"], argv, extra=_extra)
    ctx = make_context("gateway", args)
    telemetry.setup_tracing("gateway", ctx.redactor)
    env = take_secret_env(["AFE_UI_TOKEN", args.github_webhook_secret_env], ctx.redactor)
    host, port = parse_listen(args.listen)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise errors.FailedPrecondition(f"cannot listen on {host}:{port} for the web UI and /rpc "
                                        f"({exc.strerror}): stop what holds the port, or pass another "
                                        "--listen HOST:PORT") from None
    port = sock.getsockname()[1]
    site = Site.build(args.public_url, host, port)
    token_file = Path(args.token_file) if args.token_file else ctx.layout.token_file
    fixed = env["AFE_UI_TOKEN"].reveal() if "AFE_UI_TOKEN" in env else None
    tokens = TokenSource(ctx.redactor, fixed=fixed, path=None if fixed else token_file)
    # One limiter per surface (R40): failures on the webhook never count against the UI/CLI, nor back.
    auth = Authenticator(tokens, site, FailureLimiter(max_failures=args.max_failed_logins),
                         metrics=GatewayMetrics(ctx.registry))
    backend = SchedulerBackend(ctx.layout.socket("scheduler"), ctx.links.call.get("scheduler"))
    app = build_app(auth, backend, ctx.redactor)
    webhook_secret = env.get(args.github_webhook_secret_env)
    if webhook_secret is not None and webhook_secret.reveal():
        webhook_limiter = FailureLimiter(max_failures=args.max_bad_webhook_signatures)
        app.router.add_post(hooks.PATH, hooks.GitHubWebhook(webhook_secret, backend, webhook_limiter,
                                                            registry=ctx.registry).handle)
    app.middlewares.insert(0, metrics.http_metrics_middleware(ctx.registry))
    app.middlewares.insert(0, telemetry.aiohttp_middleware())
    runner = web.AppRunner(app, access_log=None, handle_signals=False)

    async def start() -> dict[str, int | str]:
        tokens.start()
        await runner.setup()
        await web.SockSite(runner, sock).start()
        log.info("gateway listening on %s:%s, public origin %s", host, port, site.origin)
        return {"port": port, "url": site.origin}

    async def stop() -> None:
        await tokens.stop()
        await runner.cleanup()
        await backend.close()
        telemetry.shutdown_tracing()

    await run_until_signalled(ctx, {"scheduler": backend.healthy}, start, stop)


def main(argv: list[str] | None = None) -> int:
    try:
        asyncio.run(_main(argv))
    except errors.AfeError as exc:
        print(f"afe-gateway: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
