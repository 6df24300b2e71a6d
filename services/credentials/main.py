"""Composition root of the credential broker: the only process holding git,
forge and model secrets. It serves the scheduler only.

    python -m services.credentials.main --config DIR --data DIR --run DIR \
        --link-fd N --status-fd N --ops-host H --ops-port P

Secrets: exactly the variables the manifests name (tokenEnv, apiKeyEnv) are
read once, registered with the redactor and removed from the environment
(R28, R30). `AFE_CA_FILE` (optional) names the CA bundle git and the HTTP
APIs trust (GitHub Enterprise or a proxy with a private CA); `https_proxy`,
`http_proxy` and `no_proxy` (optional) route git and the HTTP APIs through
the operator's proxy. `AFE_DATABASE_URL` (only when the store is PostgreSQL:
several schedulers, maybe on several machines) is read once and removed from
the environment (R29): every fenced side effect is then checked against the
ticket's row in that database (fencing/database.py) instead of this machine's fence
file. `afe up` passes exactly these (services/launcher/environment.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
from pathlib import Path

from services.common.config.manifests import load_config
from services.common.errors import AfeError
from services.common.layout import DEFAULT_PORTS
from services.common.observability.telemetry import grpc_server_interceptors, setup_tracing, shutdown_tracing
from services.common.process import make_context, parse_args, run_until_signalled
from services.common.secrecy.childenv import proxy_env
from services.common.secrecy.env_secrets import take_secret_env
from services.credentials.fencing.database import ENV as DATABASE_ENV
from services.credentials.fencing.database import database_from_url

from .app import CredentialBrokerOptions, build_app

log = logging.getLogger(__name__)


async def amain(argv: list[str] | None = None) -> int:
    args = parse_args("credentials", DEFAULT_PORTS["credentials_ops"], argv)
    ctx = make_context("credentials", args)
    setup_tracing("credentials", ctx.redactor)
    config = load_config(ctx.config_dir)
    secrets = take_secret_env(config.credential_env_names(), ctx.redactor)
    missing = [n for n in config.credential_env_names() if n not in secrets]
    if missing:
        log.warning("not set (workspaces/models using them will fail): %s", ", ".join(missing))
    ca = os.environ.get("AFE_CA_FILE")
    if ca and not os.path.isfile(ca):  # noqa: ASYNC240 - once at start, before serving
        log.warning("AFE_CA_FILE=%s is not a readable file; HTTPS to a server of a private CA will fail", ca)
    taken = take_secret_env([DATABASE_ENV], ctx.redactor)
    try:
        fence_db = database_from_url(taken[DATABASE_ENV].reveal() if DATABASE_ENV in taken else "", ctx.redactor)
    except AfeError as exc:
        log.error("credentials: %s", exc)
        return 2
    if fence_db is not None:
        log.info("fences are checked in %s (R37)", fence_db.where)
    ctx.layout.ensure()
    options = CredentialBrokerOptions(ca_file=Path(ca) if ca else None, proxies=proxy_env())
    app = build_app(config, ctx.layout, ctx.links, secrets, ctx.redactor, options, registry=ctx.registry,
                    interceptors=grpc_server_interceptors(), fence_db=fence_db)

    async def git_ready() -> bool:
        return shutil.which("git") is not None

    async def start() -> dict[str, str]:
        await app.start()
        return {"socket": app.server.socket_path}

    async def stop() -> None:
        await app.stop()
        shutdown_tracing()

    await run_until_signalled(ctx, {"git": git_ready}, start, stop)
    return 0


def main() -> None:
    sys.exit(asyncio.run(amain()))


if __name__ == "__main__":
    main()
