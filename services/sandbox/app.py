"""Assembling the sandbox broker's core and gRPC server (used by main.py and
by tests that run the real broker in-process)."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry

from services._gen.afe.sandbox.v1 import sandbox_pb2_grpc
from services.common import grpcutil
from services.common.layout import Layout
from services.common.metrics import sandbox_metrics
from services.common.redact import Redactor

from .execs import Runner
from .files import FileTools
from .sandboxes import SandboxManager
from .servicer import SandboxServicer

log = logging.getLogger(__name__)

SERVICE_NAME = "afe.sandbox.v1.SandboxBroker"


@dataclass
class Broker:
    sandboxes: SandboxManager
    runner: Runner
    files: FileTools
    server: grpc.aio.Server
    health: object
    socket_path: str
    boot_id: str = ""

    async def start(self) -> None:
        await grpcutil.start_server(self.server, self.health, self.socket_path)

    async def stop(self, grace: float = 2.0) -> None:
        await self.server.stop(grace)


def build_broker(layout: Layout, socket_path: str, accepted: dict[str, bytes], redactor: Redactor, *,
                 instance: str = "default", egress_network: str = "bridge",
                 allow_private: Iterable[str] = (), env_values: dict | None = None,
                 interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
                 registry: CollectorRegistry | None = None, disk_mode: str | None = None) -> Broker:
    sandboxes = SandboxManager(layout, instance=instance, egress_network=egress_network,
                               allow_private=allow_private, env_values=env_values, disk_mode=disk_mode)
    # R34: say which disk cap holds (a loop-mounted image, or the coarser watchdog) and why
    log.info("workspace disk cap: %s mode (%s)", sandboxes.diskcap.mode, sandboxes.diskcap.why)
    runner = Runner(sandboxes)
    files = FileTools(layout.workspace)
    metrics = sandbox_metrics(registry) if registry is not None else None
    # New on every start: the scheduler sees a restarted broker and reconciles (R12).
    boot_id = secrets.token_hex(8)
    servicer = SandboxServicer(sandboxes, runner, files, metrics=metrics, boot_id=boot_id)
    server, health = grpcutil.create_server(
        socket_path, accepted, redactor,
        [lambda s: sandbox_pb2_grpc.add_SandboxBrokerServicer_to_server(servicer, s)],
        service_names=[SERVICE_NAME], interceptors=interceptors, registry=registry)
    return Broker(sandboxes, runner, files, server, health, socket_path, boot_id)
