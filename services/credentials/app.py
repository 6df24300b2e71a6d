"""Builds the credential broker from its parts (core, metrics, servicer,
server). Used by main.py and by the in-process test broker; the one place
that wires them together."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import grpc
from prometheus_client import CollectorRegistry

from services.common.config.model import Config
from services.common.layout import Layout
from services.common.observability.metered import MeteredCredentials
from services.common.observability.metrics import relay_metrics
from services.common.rpc import grpcutil
from services.common.rpc.links import LinkSecrets
from services.common.secrecy.env_secrets import SecretValue
from services.common.secrecy.redact import Redactor
from services.credentials.fencing.database import FenceDatabase

from .broker import CredentialCore
from .compose import build_core
from .httpclient import RetryPolicy
from .servicer import register

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CredentialBrokerOptions:
    """How one credential broker is set up (its settings from `services/credentials/main.py`);
    every default is the broker's default."""

    socket_path: str | None = None                  # None: the layout's `credentials` socket
    ca_file: Path | None = None                     # AFE_CA_FILE: the CA bundle git and HTTPS calls trust
    proxies: Mapping[str, str] | None = None        # the operator's http(s)_proxy / no_proxy; None: none
    retry: RetryPolicy | None = None                # None: the HTTP client's own policy
    spare_checkouts: bool = True                    # checkouts made ahead of the next ticket (spares.py)


@dataclass
class CredentialsApp:
    core: CredentialCore
    server: grpcutil.AfeServer

    async def start(self) -> None:
        await self.server.start()
        if self.core.relay is not None:
            resumed = await self.core.relay.resume()     # tickets still running keep their relay (R32)
            if resumed:
                log.info("serving the model relay of %d running ticket(s) again", resumed)

    async def stop(self, grace: float | None = 2.0) -> None:
        await self.server.stop(grace)
        await self.core.close()


def build_app(config: Config, layout: Layout, links: LinkSecrets, secrets: dict[str, SecretValue],
              redactor: Redactor, options: CredentialBrokerOptions = CredentialBrokerOptions(), *,
              registry: CollectorRegistry | None = None,
              interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
              fence_db: FenceDatabase | None = None) -> CredentialsApp:
    """The broker `options` describe; the parts it is given (the metrics registry, the
    server's interceptors, the fence database: compose.build_core) stay keywords."""
    o = options
    core = build_core(config, layout, secrets, redactor, ca_file=o.ca_file, proxies=o.proxies, retry=o.retry,
                      spare_checkouts=o.spare_checkouts, fence_db=fence_db)
    served: CredentialCore = core
    if registry is not None:
        if core.relay is not None:
            core.relay.metrics = relay_metrics(registry, config.models)
        served = cast(CredentialCore, MeteredCredentials(core, registry))
    server = grpcutil.create_server(o.socket_path or str(layout.socket("credentials")), links.serve, redactor,
                                    [register(served)], interceptors=interceptors, registry=registry)
    return CredentialsApp(core, server)
