"""`afe up`: start the scheduler, the two brokers and the gateway, and supervise them."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from services.common.errors import AfeError
from services.common.layout import DEFAULT_PORTS, Layout
from services.common.observability.logs import setup_logging
from services.common.observability.ops import check_ops_name
from services.common.secrecy.redact import Redactor

SERVICES = ("sandbox", "credentials", "scheduler", "gateway")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("up", help="start afe (all four processes) and supervise them",
                       description="Start the scheduler, sandbox broker, credential broker and gateway as "
                       "separate processes; restart crashed ones; stop them all on Ctrl-C.")
    p.add_argument("--config", default=None, metavar="DIR",
                   help="manifest folder (default: ./afe.d when it exists, else the bundled demo)")
    p.add_argument("--data", default=".afe/data", metavar="DIR", help="data folder (default: .afe/data)")
    p.add_argument("--run", default=None, metavar="DIR", help="runtime folder for sockets (default: .afe/run)")
    p.add_argument("--ops-host", default="127.0.0.1", metavar="HOST",
                   help="address the /livez /readyz /metrics endpoints bind to (default: 127.0.0.1)")
    p.add_argument("--ops-name", action="append", default=[], metavar="NAME",
                   help="another Host name the ops endpoints answer to, e.g. the name a Prometheus "
                   "scrapes them by (they refuse every other name: DNS rebinding); repeatable")
    p.add_argument("--ops-port", action="append", default=[], metavar="[SERVICE=]PORT",
                   help="ops port for a service (sandbox, credentials, scheduler, gateway), or PORT for "
                   "all; 0 picks a free port. Defaults: " + ", ".join(
                       f"{s} {DEFAULT_PORTS[s + '_ops']}" for s in SERVICES))
    p.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_PORTS['gateway']}", metavar="HOST:PORT",
                   help="HOST:PORT the web UI listens on")
    p.add_argument("--public-url", default=None, metavar="URL", help="the URL users open (e.g. behind a TLS proxy)")
    p.add_argument("--max-running", type=int, default=None, metavar="N", help="tickets running at once (all workspaces)")
    p.add_argument("--max-failed-logins", type=int, default=None, metavar="N",
                   help="failed UI logins and CLI tokens per address and minute before the gateway answers "
                        "429 (default 10; the right token always passes)")
    p.add_argument("--max-bad-webhook-signatures", type=int, default=None, metavar="N",
                   help="GitHub deliveries with a bad signature per address and minute before the gateway "
                        "answers 429 (default 10; a correctly signed delivery always passes)")
    p.add_argument("--sandbox-pool-max", type=int, default=None, metavar="N",
                   help="warm sandboxes kept ready in all (each Workspace asks for its own with sandbox.pool; "
                   "default 8; 0 = none)")
    p.add_argument("--instance", default=None, metavar="ID",
                   help="label value afe.instance=<ID> on every Docker object this afe owns (default: the data "
                   "folder's own, made on its first start and kept in <data>/instance; `default` for a data "
                   "folder used before); two afe installations on one Docker engine need different ids")
    p.add_argument("--egress-network", default="bridge", metavar="NAME",
                   help="the Docker network the egress proxies join to reach the allowed hosts (default: "
                   "bridge); pick the one that routes to an internal mirror a Workspace lists in "
                   "sandbox.egressPrivate")
    p.add_argument("--gvisor-runtime", default="runsc", metavar="NAME",
                   help="the engine's runtime a Workspace with sandbox.runtime: gvisor runs on (default: runsc)")
    p.add_argument("--egress-transport", choices=("network", "socket"), default="network",
                   help="how a runc sandbox reaches its egress proxy: the ticket's internal network (default) or "
                   "a Unix socket with no network interface (gVisor sandboxes always use the socket)")
    p.add_argument("--sandbox-broker", action="append", default=[], metavar="NAME=HOST:PORT[,capacity=N]",
                   help="a sandbox broker on another host, passed to the scheduler (docs/SCALE.md); repeatable. "
                   "With any, the scheduler places sandboxes only there, reached with mutual TLS; needs "
                   "--tls-cert, --tls-key and --tls-ca")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="this machine's certificate (`afe certs`): the scheduler's to --sandbox-broker, and "
                   "the client certificate to a PostgreSQL database")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="its private key (mode 0600)")
    p.add_argument("--tls-ca", "--ca", dest="tls_ca", default=None, metavar="PEM",
                   help="the deployment CA (ca.pem of `afe certs`); NAME.secret of each --sandbox-broker sits "
                   "next to it. With a PostgreSQL database and --tls-cert/--tls-key, the database link is "
                   "mutual TLS verified against it")
    p.add_argument("--join", action="store_true",
                   help="this machine joins a deployment already running on a PostgreSQL database: starts "
                   "its own scheduler, brokers and gateway on it; needs --database-url (or AFE_DATABASE_URL), "
                   "--ca, --tls-cert and --tls-key (docs/SCALE.md, \"Several machines\")")
    p.add_argument("--database-url", default=None, metavar="URL",
                   help="the store, postgresql://USER@HOST:PORT/DATABASE (no password here: it would show in the "
                   "process list; put a URL with a password in AFE_DATABASE_URL instead)")
    p.add_argument("--no-images", action="store_true",
                   help="do not check/build the Docker images before starting")
    p.add_argument("--ready-timeout", type=float, default=90.0, help=argparse.SUPPRESS)
    p.add_argument("--broker-recovery", type=float, default=None, help=argparse.SUPPRESS)  # tests
    p.set_defaults(func=run)


def parse_ops_ports(values: list[str]) -> dict[str, int]:
    ports = {s: DEFAULT_PORTS[f"{s}_ops"] for s in SERVICES}
    for v in values:
        service, _, port = v.rpartition("=")
        if not port.isdigit() or int(port) > 65535:
            raise SystemExit(f"afe up: --ops-port {v!r}: write PORT or SERVICE=PORT (0-65535)")
        if not service:
            ports = {s: int(port) for s in SERVICES}
        elif service in ports:
            ports[service] = int(port)
        else:
            raise SystemExit(f"afe up: --ops-port {v!r}: SERVICE is one of {', '.join(SERVICES)}")
    return ports


def run(args: argparse.Namespace) -> int:
    from services.common import demo
    from services.launcher.launch import Options
    from services.launcher.launch import run as launch

    setup_logging("launcher", Redactor(), level=os.environ.get("AFE_LOG_LEVEL", "INFO"))
    data = Path(args.data).absolute()
    run_dir = Path(args.run).absolute() if args.run else data.parent / "run"
    layout = Layout(data, run_dir)
    if args.config is not None:
        config_dir = Path(args.config).absolute()
    elif Path("afe.d").is_dir():
        config_dir = Path("afe.d").absolute()
    else:
        try:
            layout.ensure()     # first, so .afe/ is made with its .gitignore before the demo goes into it
        except AfeError as exc:
            raise SystemExit(f"afe up: {exc}") from None
        config_dir = demo.materialize(data.parent / "demo")
        print(f"afe up: no --config and no ./afe.d; using the bundled demo in {config_dir}")
    try:
        ops_names = tuple(check_ops_name(n) for n in args.ops_name)
    except ValueError as exc:
        raise SystemExit(f"afe up: {exc}") from None
    tls = [args.tls_cert, args.tls_key, args.tls_ca]
    if args.sandbox_broker and None in tls:
        raise SystemExit("afe up: --sandbox-broker needs mutual TLS: give --tls-cert, --tls-key and --tls-ca "
                         "(make them with `afe certs`; docs/SCALE.md)")
    from services.launcher.join import is_postgresql

    shared = args.join or is_postgresql(args.database_url or os.environ.get("AFE_DATABASE_URL", ""))
    if not args.sandbox_broker and not shared and any(tls):
        raise SystemExit("afe up: --tls-cert/--tls-key/--ca are for --sandbox-broker or a PostgreSQL database; "
                         "give those too, or leave the TLS flags out")
    if shared and any(tls) and None in tls and not args.join:
        raise SystemExit("afe up: the link to the PostgreSQL database is mutual TLS with all three of --tls-cert, "
                         "--tls-key and --ca (make them with `afe certs`; docs/SCALE.md)")
    for flag, count in (("--max-failed-logins", args.max_failed_logins),
                        ("--max-bad-webhook-signatures", args.max_bad_webhook_signatures)):
        if count is not None and count < 1:
            raise SystemExit(f"afe up: {flag} {count} would refuse every failure at once; give 1 or more")
    tls_cert, tls_key, tls_ca = (Path(t).absolute() if t else None for t in tls)
    opts = Options(config_dir=config_dir, layout=layout, ops_host=args.ops_host, ops_names=ops_names,
                   ops_ports=parse_ops_ports(args.ops_port), listen=args.listen,
                   public_url=args.public_url, max_running=args.max_running,
                   max_failed_logins=args.max_failed_logins,
                   max_bad_webhook_signatures=args.max_bad_webhook_signatures,
                   ready_timeout=args.ready_timeout, check_images=not args.no_images,
                   log_level=os.environ.get("AFE_LOG_LEVEL"), instance=args.instance,
                   broker_recovery=args.broker_recovery, egress_network=args.egress_network,
                   gvisor_runtime=args.gvisor_runtime, egress_transport=args.egress_transport,
                   sandbox_pool_max=args.sandbox_pool_max, sandbox_brokers=tuple(args.sandbox_broker),
                   tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca, join=args.join,
                   database_url=args.database_url)
    logging.getLogger(__name__).debug("launching with %s", config_dir)
    return launch(opts, out=lambda line: print(line, flush=True))
