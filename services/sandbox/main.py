"""The sandbox broker's composition root: the only process that talks to
Docker. It holds no git, forge or model secret; only the values of the
environment NAMES that `acp` agents declare (R9), read once and removed
from the environment (R30)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from services.common.layout import DEFAULT_PORTS
from services.common.manifests import load_config
from services.common.process import make_context, parse_args, run_until_signalled
from services.common.secrets import take_secret_env
from services.common.telemetry import grpc_server_interceptors, setup_tracing, shutdown_tracing

from .app import build_app

log = logging.getLogger(__name__)


def _extra(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instance", default="default",
                   help="value of the afe.instance label on every object this broker creates")
    p.add_argument("--egress-network", default="bridge",
                   help="the egress proxies' outside network (default: Docker's bridge)")
    p.add_argument("--allow-private", action="append", default=[], metavar="CIDR",
                   help="tests/doctor only: let proxies reach this private subnet")


async def amain(argv: list[str] | None = None) -> int:
    args = parse_args("sandbox", DEFAULT_PORTS["sandbox_ops"], argv, extra=_extra)
    ctx = make_context("sandbox", args)
    setup_tracing("sandbox", ctx.redactor)
    config = load_config(ctx.config_dir)
    env_values = take_secret_env(config.agent_env_names(), ctx.redactor)
    ctx.layout.ensure()
    app = build_app(ctx.layout, ctx.links, ctx.redactor, instance=args.instance,
                    egress_network=args.egress_network, allow_private=args.allow_private,
                    env_values=env_values, interceptors=grpc_server_interceptors(), registry=ctx.registry)

    async def start() -> dict:
        await app.start()
        return {"socket": app.server.socket_path}

    async def stop() -> None:
        await app.stop()
        shutdown_tracing()

    await run_until_signalled(ctx, {"docker": app.sandboxes.ping}, start, stop)
    return 0


def main() -> None:
    sys.exit(asyncio.run(amain()))


if __name__ == "__main__":
    main()
