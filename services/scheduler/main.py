"""Composition root of the scheduler: tickets, workflows, the store, events.
It holds no git/forge/model secret and never talks to Docker; it asks the
sandbox broker and the credential broker over their sockets.

    python -m services.scheduler.main --config DIR --data DIR --run DIR \
        --link-fd N --status-fd N --ops-host H --ops-port P [--max-running N] [--public-url URL]

Serves the callers "gateway" and "automation"; calls "sandbox" and
"credentials". `AFE_DATABASE_URL` (optional: a SQLite file or a PostgreSQL
database, see store/url.py) is read once and removed from the environment
(R29); the default store is `<data>/afe.db`. A store that cannot be opened
(unreachable, refused login, newer schema) ends the process with one log
line that says what to change, before it reports ready.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

from services.common.config.database_url import read_database_url
from services.common.config.manifests import load_config
from services.common.errors import AfeError
from services.common.layout import DEFAULT_PORTS
from services.common.observability.telemetry import grpc_server_interceptors, setup_tracing, shutdown_tracing
from services.common.process import make_context, parse_args, run_until_signalled
from services.common.rpc import grpcutil

from .app import SchedulerOptions, build_app
from .engine.core import LEASE_S
from .engine.followups import SETTLE_S
from .sandboxes.placement import add_flags as add_placement_flags
from .sandboxes.placement import from_flags as brokers_from_flags
from .sandboxes.pool import DEFAULT_CAP
from .store.url import open_store
from .store.worker import store_answers, threaded

log = logging.getLogger(__name__)


def _extra(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-running", type=int, default=4,
                   help="global limit on tickets running at once (default 4)")
    p.add_argument("--sandbox-pool-max", type=int, default=DEFAULT_CAP, metavar="N",
                   help=f"warm sandboxes kept ready in all workspaces together (default {DEFAULT_CAP}; "
                   "0 = none); each Workspace asks for its own with sandbox.pool")
    p.add_argument("--broker-recovery", type=float, default=2.0, metavar="SECONDS",
                   help="how often to check for a restarted sandbox broker (then reconcile) and to retry "
                   "failed teardowns at the latest (default 2; 0 = never, tests only)")
    p.add_argument("--scheduler-id", default="", metavar="ID",
                   help="this scheduler's name in the leases of the tickets it drives, when several share "
                   "one PostgreSQL database (default: host, pid and a random part; docs/SCALE.md)")
    p.add_argument("--lease-seconds", type=float, default=LEASE_S, metavar="SECONDS",
                   help=f"how long a ticket's lease lasts without a heartbeat (default {LEASE_S:g}): another "
                   "scheduler on the same database takes the ticket over within about 1.2 times this")
    p.add_argument("--public-url", default="", metavar="URL",
                   help="the URL users open the UI at (the gateway's --public-url); ticket links in the "
                   "comments and commit statuses afe writes on GitHub start with it (none without it)")
    p.add_argument("--github-settle-seconds", type=float, default=SETTLE_S, metavar="SECONDS",
                   help=f"how long a follow-up from a pull request waits for more of the same review (its "
                   f"inline comments) before the ticket re-runs with all of them (default {SETTLE_S:g}; "
                   "docs/GITHUB.md)")
    add_placement_flags(p)


async def amain(argv: list[str] | None = None) -> int:
    args = parse_args("scheduler", DEFAULT_PORTS["scheduler_ops"], argv, extra=_extra)
    ctx = make_context("scheduler", args)
    setup_tracing("scheduler", ctx.redactor)
    ctx.layout.ensure()
    config = load_config(ctx.config_dir)
    try:
        # From here on every statement runs on the store's own thread (store/worker.py).
        store = threaded(open_store(read_database_url(ctx.layout, ctx.redactor)))
    except AfeError as exc:
        log.error("scheduler: cannot open its store: %s", ctx.redactor.redact(str(exc)))
        return 2
    try:
        brokers = brokers_from_flags(args, store)
    except AfeError as exc:
        log.error("scheduler: %s", ctx.redactor.redact(str(exc)))
        return 2
    options = SchedulerOptions(max_running=args.max_running, recovery_interval=args.broker_recovery,
                               pool_cap=max(0, args.sandbox_pool_max), public_url=args.public_url,
                               owner=args.scheduler_id, lease_s=max(1.0, args.lease_seconds),
                               github_settle_s=max(0.0, args.github_settle_seconds))
    app = build_app(config, ctx.layout, ctx.links, ctx.redactor, options, store=store, sandboxes=brokers,
                    interceptors=grpc_server_interceptors(), registry=ctx.registry)

    async def store_ready() -> bool:
        # Not ready while events wait in memory for the store (events/writes.py), even if it answers a ping;
        # at once not ready while its thread sees it failing, else a ping on that thread within 1.5 s.
        return app.engine.events.unavailable_since is None and await store_answers(app.store)

    async def sandbox_ready() -> bool:
        if brokers is not None:   # ready while one broker answers (placement.py)
            try:
                await brokers.identify()
            except AfeError:
                return False
            return True
        return await grpcutil.check_health(str(ctx.layout.socket("sandbox")), ctx.links.call.get("sandbox"))

    async def credentials_ready() -> bool:
        return await grpcutil.check_health(str(ctx.layout.socket("credentials")),
                                           ctx.links.call.get("credentials"))

    async def start() -> dict[str, Any]:
        await app.start()
        return {"socket": app.server.socket_path}

    async def stop() -> None:
        await app.stop()
        shutdown_tracing()

    await run_until_signalled(ctx, {"store": store_ready, "sandbox": sandbox_ready,
                                    "credentials": credentials_ready}, start, stop)
    return 0


def main() -> None:
    sys.exit(asyncio.run(amain()))


if __name__ == "__main__":
    main()
