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


def build_app(layout: Layout, links: LinkSecrets, redactor: Redactor, *, socket_path: str | None = None,
              instance: str = "default", egress_network: str = "bridge",
              allow_private: Iterable[str] = (), env_values: Mapping[str, SecretValue | str] | None = None,
              interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
              registry: CollectorRegistry | None = None, disk_mode: str | None = None,
              listen: str = "", tls: grpcutil.TlsFiles | None = None, gvisor_runtime: str = "runsc",
              egress_transport: str = "network", upstream_ca: bytes = b"") -> SandboxApp:
    """`socket_path` defaults to the layout's `sandbox` socket. With `listen`
    (`HOST:PORT`) and `tls`, the broker serves a scheduler on another host
    over TCP with mutual TLS instead (R39, docs/SCALE.md)."""
    sandboxes = SandboxManager(layout, instance=instance, egress_network=egress_network,
                               allow_private=allow_private, env_values=env_values, disk_mode=disk_mode,
                               gvisor_runtime=gvisor_runtime, egress_transport=egress_transport,
                               upstream_ca=upstream_ca)
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
        socket_path or str(layout.socket("sandbox")), links.serve, redactor,
        [lambda s: sandbox_pb2_grpc.add_SandboxBrokerServicer_to_server(servicer, s)],
        interceptors=interceptors, registry=registry, listen=listen, tls=tls)
    return SandboxApp(sandboxes, runner, files, server, boot_id)
