"""What every process's composition root (its `main` module) shares: argument
parsing, logging with the redactor, link secrets from the inherited fd, the
ops server, the readiness report to the launcher, and signal handling.

Convention (the launcher relies on it): each process is started as
`python -m <package>.main --config DIR --data DIR --run DIR --link-fd N
--status-fd N --ops-host H --ops-port P`. When it is ready it writes one JSON
line to the status fd ({"service", "pid", "ops_port", ...}) and closes it.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from services.common.observability.logs import setup_logging
from services.common.observability.ops import OpsServer, ReadyCheck, check_ops_name
from services.common.rpc.links import LinkSecrets, read_link_fd
from services.common.secrecy.redact import Redactor

from .errors import AfeError
from .layout import Layout

log = logging.getLogger(__name__)


@dataclass
class ProcessContext:
    name: str
    config_dir: Path
    layout: Layout
    links: LinkSecrets
    redactor: Redactor
    registry: CollectorRegistry
    ops_host: str
    ops_port: int
    status_fd: int | None
    extra: dict[str, Any] = field(default_factory=dict)
    ops_names: tuple[str, ...] = ()
    stopping: asyncio.Event = field(default_factory=asyncio.Event)


def _ops_name(value: str) -> str:
    try:
        return check_ops_name(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(name: str, default_ops_port: int, argv: list[str] | None = None,
               extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"afe-{name}")
    p.add_argument("--config", required=True, help="manifest folder")
    p.add_argument("--data", required=True, help="data folder")
    p.add_argument("--run", required=True, help="runtime folder (sockets)")
    p.add_argument("--link-fd", type=int, default=None, help="inherited fd carrying link secrets")
    p.add_argument("--status-fd", type=int, default=None, help="inherited fd for the readiness line")
    p.add_argument("--ops-host", default="127.0.0.1")
    p.add_argument("--ops-name", action="append", default=[], metavar="NAME", type=_ops_name,
                   help="another Host name the ops endpoints answer to (R38); repeatable")
    p.add_argument("--ops-port", type=int, default=default_ops_port)
    p.add_argument("--log-level", default=os.environ.get("AFE_LOG_LEVEL", "INFO"))
    if extra:
        extra(p)
    return p.parse_args(argv)


def enable_stack_dumps() -> None:
    """`kill -USR1 <pid>` prints every thread's stack (file, line, function: no
    values) on stderr, which the launcher keeps in the process's log: what a
    process that hangs is waiting for, without stopping it."""
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


def make_context(name: str, args: argparse.Namespace) -> ProcessContext:
    redactor = Redactor()
    setup_logging(name, redactor, level=args.log_level)
    enable_stack_dumps()
    links = read_link_fd(args.link_fd) if args.link_fd is not None else LinkSecrets()
    for secret in [*links.serve.values(), *links.call.values()]:
        redactor.register(secret.hex())
    return ProcessContext(
        name=name,
        config_dir=Path(args.config).absolute(),
        layout=Layout.from_args(args.data, args.run),
        links=links,
        redactor=redactor,
        registry=CollectorRegistry(),
        ops_host=args.ops_host,
        ops_port=args.ops_port,
        status_fd=args.status_fd,
        ops_names=tuple(getattr(args, "ops_name", ()) or ()),
    )


def report_ready(ctx: ProcessContext, **fields: object) -> None:
    """Tell the launcher we are up (one JSON line on the status fd)."""
    if ctx.status_fd is None:
        return
    line = json.dumps({"service": ctx.name, "pid": os.getpid(), **fields}) + "\n"
    try:
        os.write(ctx.status_fd, line.encode())
    finally:
        os.close(ctx.status_fd)
        ctx.status_fd = None


async def run_until_signalled(ctx: ProcessContext, checks: dict[str, ReadyCheck],
                              start: Callable[[], Awaitable[dict[str, Any]]],
                              stop: Callable[[], Awaitable[None]]) -> None:
    """Start the ops server and the service, report ready, wait for SIGTERM/SIGINT, stop."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, ctx.stopping.set)
    ops = OpsServer(ctx.registry, checks, host=ctx.ops_host, port=ctx.ops_port, names=ctx.ops_names)
    info = await start()
    try:
        port = await ops.start()
    except AfeError as exc:     # a taken port: said once, without a traceback, and nothing left running
        log.error("%s: %s", ctx.name, exc)
        await asyncio.wait_for(stop(), 8)
        raise SystemExit(2) from None
    log.info("%s ready (ops on %s:%s)", ctx.name, ctx.ops_host, port)
    report_ready(ctx, ops_port=port, **(info or {}))
    try:
        await ctx.stopping.wait()
    finally:
        log.info("%s stopping", ctx.name)
        try:
            await asyncio.wait_for(stop(), 8)
        finally:
            await ops.stop()
