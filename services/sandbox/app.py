"""Builds the sandbox broker from its parts (sandbox manager, runner, file
tools, servicer, server). Used by main.py and by tests that run the real
broker in-process; the one place that wires them together."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry

from services._gen.afe.sandbox.v1 import sandbox_pb2_grpc
from services.common.layout import Layout
from services.common.observability.metrics import sandbox_metrics
from services.common.rpc import grpcutil
from services.common.rpc.links import LinkSecrets
from services.common.secrecy.env_secrets import SecretValue
from services.common.secrecy.redact import Redactor
from services.sandbox.commands.execs import Runner
from services.sandbox.files.tools import FileTools

from .sandboxes import SandboxManager
from .servicer import SandboxServicer

log = logging.getLogger(__name__)

@dataclass
class SandboxApp:
    sandboxes: SandboxManager
    runner: Runner
    files: FileTools
    server: grpcutil.AfeServer
    boot_id: str = ""

    async def start(self) -> None:
        await self.server.start()

    async def stop(self, grace: float | None = 2.0) -> None:
        await self.server.stop(grace)


@dataclass(frozen=True)
class SandboxBrokerOptions:
    """How one sandbox broker is set up (the flags of `services/sandbox/main.py`);
    every default is the broker's default."""

    socket_path: str | None = None        # None: the layout's `sandbox` socket
    instance: str = "default"             # the afe.instance label on every object it creates
    egress_network: str = "bridge"        # the egress proxies' outside network
    allow_private: tuple[str, ...] = ()   # private subnets proxies may reach (tests, doctor)
    disk_mode: str | None = None          # the workspace disk cap's mode (diskcap.py); None: detect
    # With `listen` (`HOST:PORT`) and `tls`, the broker serves a scheduler on another
    # host over TCP with mutual TLS instead of the socket (R39, docs/SCALE.md).
    listen: str = ""
    tls: grpcutil.TlsFiles | None = None
    gvisor_runtime: str = "runsc"         # the engine's runtime a `gvisor` sandbox runs on
    egress_transport: str = "network"     # how a runc sandbox reaches its proxy: network or socket
    upstream_ca: bytes = b""              # AFE_CA_FILE's certificates, for proxies that decrypt (R44)


def build_app(layout: Layout, links: LinkSecrets, redactor: Redactor,
              options: SandboxBrokerOptions = SandboxBrokerOptions(), *,
              env_values: Mapping[str, SecretValue | str] | None = None,
              interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
              registry: CollectorRegistry | None = None) -> SandboxApp:
    """The broker `options` describe; `env_values` are the values of the
    environment names agents declare (R9), kept out of the options so no
    repr of them shows one."""
    o = options
    sandboxes = SandboxManager(layout, instance=o.instance, egress_network=o.egress_network,
                               allow_private=o.allow_private, env_values=env_values, disk_mode=o.disk_mode,
                               gvisor_runtime=o.gvisor_runtime, egress_transport=o.egress_transport,
                               upstream_ca=o.upstream_ca)
    # R34: say which disk cap holds (a loop-mounted image, or the coarser watchdog) and why
    log.info("workspace disk cap: %s mode (%s)", sandboxes.diskcap.mode, sandboxes.diskcap.why)
    runner = Runner(sandboxes)
    files = FileTools(layout.workspace)
    metrics = sandbox_metrics(registry) if registry is not None else None
    # New on every start: the scheduler sees a restarted broker and reconciles (R12).
    boot_id = secrets.token_hex(8)
    servicer = SandboxServicer(sandboxes, runner, files, metrics=metrics, boot_id=boot_id,
                               redact=redactor.redact)
    server = grpcutil.create_server(
        o.socket_path or str(layout.socket("sandbox")), links.serve, redactor,
        [lambda s: sandbox_pb2_grpc.add_SandboxBrokerServicer_to_server(servicer, s)],
        interceptors=interceptors, registry=registry, listen=o.listen, tls=o.tls)
    return SandboxApp(sandboxes, runner, files, server, boot_id)
