"""Composition root of the credential broker: the only process holding git,
forge and model secrets. It serves the scheduler only.

    python -m services.credentials.main --config DIR --data DIR --run DIR \
        --link-fd N --status-fd N --ops-host H --ops-port P

Secrets: exactly the variables the manifests name (tokenEnv, apiKeyEnv) are
read once, registered with the redactor and removed from the environment
(R28, R30). `AFE_CA_FILE` (optional) names the CA bundle git and the HTTP
APIs trust (GitHub Enterprise or a proxy with a private CA); `https_proxy`,
`http_proxy` and `no_proxy` (optional) route git and the HTTP APIs through
the operator's proxy. `afe up` passes exactly these (services/launcher/environment.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from pathlib import Path
from typing import cast

from services.common import grpcutil
from services.common.childenv import proxy_env
from services.common.layout import DEFAULT_PORTS
from services.common.manifests import load_config
from services.common.metrics import MeteredCredentials, relay_metrics
from services.common.process import make_context, parse_args, run_until_signalled
from services.common.secrets import take_secret_env
from services.common.telemetry import grpc_server_interceptors, setup_tracing, shutdown_tracing

from .broker import CredentialCore
from .compose import build_core
from .servicer import SERVICE_NAME, register

log = logging.getLogger(__name__)


async def serve(argv: list[str] | None = None) -> None:
    args = parse_args("credentials", DEFAULT_PORTS["credentials_ops"], argv)
    ctx = make_context("credentials", args)
    setup_tracing("credentials", ctx.redactor)
    config = load_config(ctx.config_dir)
    secrets = take_secret_env(config.credential_env_names(), ctx.redactor)
    missing = [n for n in config.credential_env_names() if n not in secrets]
    if missing:
        log.warning("not set (workspaces/models using them will fail): %s", ", ".join(missing))
    ca = os.environ.get("AFE_CA_FILE")
    if ca and not os.path.isfile(ca):
        log.warning("AFE_CA_FILE=%s is not a readable file; HTTPS to a server of a private CA will fail", ca)
    ctx.layout.ensure()
    core = build_core(config, ctx.layout, secrets, ctx.redactor, ca_file=Path(ca) if ca else None,
                      proxies=proxy_env())
    if core.relay is not None:
        core.relay.metrics = relay_metrics(ctx.registry, config.models)
    socket_path = str(ctx.layout.socket("credentials"))
    accepted = {k: v for k, v in ctx.links.serve.items() if k == "scheduler"}
    server, health = grpcutil.create_server(socket_path, accepted, ctx.redactor,
                                            [register(cast(CredentialCore, MeteredCredentials(core, ctx.registry)))],
                                            service_names=[SERVICE_NAME],
                                            interceptors=grpc_server_interceptors(), registry=ctx.registry)

    async def git_ready() -> bool:
        return shutil.which("git") is not None

    async def start() -> dict:
        await grpcutil.start_server(server, health, socket_path)
        if core.relay is not None:
            resumed = await core.relay.resume()     # tickets still running keep their relay (R32)
            if resumed:
                log.info("serving the model relay of %d running ticket(s) again", resumed)
        return {"socket": socket_path}

    async def stop() -> None:
        await server.stop(2)
        await core.close()
        shutdown_tracing()

    await run_until_signalled(ctx, {"git": git_ready}, start, stop)


def main(argv: list[str] | None = None) -> None:
    asyncio.run(serve(argv))


if __name__ == "__main__":
    main()
