"""The sandbox broker's composition root: the only process that talks to
Docker. It holds no git, forge or model secret; only the values of the
environment NAMES that `acp` agents declare (R9), read once and removed
from the environment (R30)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from services.common.config.manifests import load_config
from services.common.errors import AfeError, ConfigError
from services.common.layout import DEFAULT_PORTS
from services.common.observability.telemetry import grpc_server_interceptors, setup_tracing, shutdown_tracing
from services.common.process import make_context, parse_args, run_until_signalled
from services.common.rpc.links import LinkSecrets
from services.common.rpc.tls import TlsFiles, read_secret_file
from services.common.secrecy.env_secrets import take_secret_env

from .app import SandboxBrokerOptions, build_app

log = logging.getLogger(__name__)


def _extra(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instance", default="default",
                   help="value of the afe.instance label on every object this broker creates")
    p.add_argument("--egress-network", default="bridge",
                   help="the egress proxies' outside network (default: Docker's bridge)")
    p.add_argument("--gvisor-runtime", default="runsc", metavar="NAME",
                   help="the engine's runtime a `sandbox.runtime: gvisor` sandbox runs on (default: runsc)")
    p.add_argument("--egress-transport", choices=("network", "socket"), default="network",
                   help="how a runc sandbox reaches its egress proxy: the ticket's internal network (default) "
                   "or a Unix socket with no network interface (gVisor sandboxes always use the socket)")
    p.add_argument("--allow-private", action="append", default=[], metavar="CIDR",
                   help="tests/doctor only: let proxies reach this private subnet")
    p.add_argument("--listen", default="", metavar="HOST:PORT",
                   help="serve a scheduler on another host over TCP with mutual TLS (R39) instead of the "
                   "local socket; needs --tls-cert, --tls-key, --tls-ca and --link-secret-file")
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="this broker's certificate (`afe certs`)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="its private key (mode 0600)")
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="the deployment CA: only schedulers with a certificate it signed are served")
    p.add_argument("--link-secret-file", default=None, metavar="FILE",
                   help="the link secret the scheduler presents (`afe certs` writes <name>.secret, 0600)")


def _upstream_ca(path: str | None) -> bytes:
    """AFE_CA_FILE's certificates: a proxy that decrypts a host with egress
    rules (R44) trusts them besides the system store for the upstream."""
    if not path:
        return b""
    try:
        with open(path, "rb") as f:
            data = f.read(8 << 20)
    except OSError as exc:
        raise ConfigError(f"AFE_CA_FILE={path} cannot be read ({exc.strerror}); point it at the PEM bundle of "
                          "your private CA, or unset it") from None
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise ConfigError(f"AFE_CA_FILE={path} holds no PEM certificate; point it at the PEM bundle of your "
                          "private CA, or unset it")
    return data


async def amain(argv: list[str] | None = None) -> int:
    args = parse_args("sandbox", DEFAULT_PORTS["sandbox_ops"], argv, extra=_extra)
    ctx = make_context("sandbox", args)
    setup_tracing("sandbox", ctx.redactor)
    config = load_config(ctx.config_dir)
    env_values = take_secret_env(config.agent_env_names(), ctx.redactor)
    ctx.layout.ensure()
    links = ctx.links
    try:
        tls = TlsFiles.from_flags(args.tls_cert, args.tls_key, args.tls_ca, "--listen")
        if args.listen and tls is None:
            raise ConfigError("--listen needs mutual TLS: give --tls-cert, --tls-key and --tls-ca "
                              "(make them with `afe certs`)")
        if args.listen and not args.link_secret_file:
            raise ConfigError("--listen needs --link-secret-file: the link secret is the second factor "
                              "next to the certificate (`afe certs` writes <name>.secret)")
        if args.link_secret_file:
            secret = read_secret_file(args.link_secret_file, "the link secret file")
            ctx.redactor.register(secret.hex())
            links = LinkSecrets(serve={"scheduler": secret}, call=dict(ctx.links.call))
        options = SandboxBrokerOptions(instance=args.instance, listen=args.listen, tls=tls,
                                       egress_network=args.egress_network,
                                       allow_private=tuple(args.allow_private),
                                       gvisor_runtime=args.gvisor_runtime,
                                       egress_transport=args.egress_transport,
                                       upstream_ca=_upstream_ca(os.environ.get("AFE_CA_FILE")))
        app = build_app(ctx.layout, links, ctx.redactor, options, env_values=env_values,
                        interceptors=grpc_server_interceptors(), registry=ctx.registry)
    except AfeError as exc:
        log.error("sandbox broker: %s", ctx.redactor.redact(str(exc)))
        return 2

    async def start() -> dict[str, str]:
        await app.start()
        if app.server.port:
            return {"listen": f"{args.listen.rpartition(':')[0]}:{app.server.port}"}
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
