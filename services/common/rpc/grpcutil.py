"""The gRPC layer every process uses, in one import: `create_server` builds
a local Unix-socket server with afe's boundary (tracing, call metrics,
ticket logging, the link-secret guard, text decoding) and the standard
health service; the client side (`open_channel`, `rpc_errors`, ...) is
re-exported from channels.py.

Each concept has its own module: guard.py (link secret, caller table,
AfeError -> status), statuses.py, callmetrics.py, ticketlogging.py,
textdecoding.py, streamdrop.py (`send_within`), methodhandlers.py,
sockets.py and channels.py.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from services.common import errors
from services.common.observability import metrics, telemetry
from services.common.rpc.callmetrics import CallMetrics
from services.common.rpc.channels import (
    _LinkAuth,
    check_health,
    error_from_rpc,
    open_channel,
    open_remote_channel,
    rpc_errors,
)
from services.common.rpc.guard import NO_KEY, WRONG_KEY, CallerSecrets, Guard, caller_var
from services.common.rpc.sockets import MAX_MESSAGE, OPTIONS, socket_mode, socket_target
from services.common.rpc.statuses import ORIGIN_KEY, status_for
from services.common.rpc.streamdrop import StreamDropped, send_within
from services.common.rpc.textdecoding import NOT_UTF8, TextDecoding
from services.common.rpc.ticketlogging import TicketLogging, ticket_of
from services.common.rpc.tls import TlsFiles
from services.common.rpc.tls import server_credentials as tls_server_credentials
from services.common.secrecy.redact import Redactor

__all__ = [
    "MAX_MESSAGE", "NOT_UTF8", "NO_KEY", "ORIGIN_KEY", "WRONG_KEY", "AfeServer", "CallerSecrets", "StreamDropped",
    "TextDecoding", "TicketLogging", "TlsFiles", "_LinkAuth", "caller_var", "check_health", "create_server",
    "error_from_rpc", "open_channel", "open_remote_channel", "rpc_errors", "send_within", "socket_mode",
    "socket_target", "status_for", "ticket_of",
]


class _Registrations:
    """Hands the grpc server to `register` callables and notes the services
    they add (the generated `add_XServicer_to_server` names each one)."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server
        self.services: list[str] = []

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, name: str, handlers: Any) -> None:
        self.services.append(name)
        self._server.add_registered_method_handlers(name, handlers)


@dataclass
class AfeServer:
    """One afe gRPC server: the grpc.aio server, its health service, the
    socket it listens on and the afe services it answers."""

    grpc_server: grpc.aio.Server
    health: health.aio.HealthServicer
    socket_path: str
    services: tuple[str, ...]

    port: int = 0           # the TCP port of a server made with `listen` (0: a Unix socket)

    async def start(self) -> None:
        """Listen (socket mode from `socket_mode()`), then report every service SERVING."""
        mode = socket_mode()
        old = os.umask(0o177)
        try:
            await self.grpc_server.start()
        finally:
            os.umask(old)
        if not self.port:
            os.chmod(self.socket_path, mode)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        for name in self.services:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float | None = 2.0) -> None:
        await self.grpc_server.stop(grace)


def create_server(socket_path: str, accepted: Mapping[str, bytes] | CallerSecrets, redactor: Redactor,
                  register: Iterable[Callable[[Any], None]], *,
                  interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
                  registry: CollectorRegistry | None = None,
                  reflection: bool = False, listen: str = "", tls: TlsFiles | None = None) -> AfeServer:
    """An afe gRPC server on a Unix socket, guarded by link secrets.

    `accepted`: the link keys of this process's callers (LinkSecrets.serve);
    a caller is then served only the services services/common/rpc/callers.py
    lists it for. `register` callables add servicers
    (`add_XServicer_to_server(servicer, server)`). Every server has the same
    boundary, in this order: tracing (when on, telemetry.setup_tracing);
    call metrics with `registry` (`afe_grpc_server_handled_total{method,code}`);
    `TicketLogging`; the guard (key and caller table, AfeError -> status,
    guard.py::Guard); `TextDecoding`; every error text passes `redactor`
    before it leaves the process. With `reflection`, the server also answers
    gRPC server reflection for its services and health, behind the same key
    check.

    With `listen` (`HOST:PORT`, a link from another host), the server listens
    on TCP instead of the socket, with mutual TLS from `tls` (required): only
    a client whose certificate the deployment's CA signed gets as far as the
    link-secret check (R39, tls.py).
    """
    if listen and tls is None:
        raise errors.ConfigError(f"listening on {listen} needs mutual TLS: give --tls-cert, --tls-key and "
                                 "--tls-ca (make them with `afe certs`)")
    creds = tls_server_credentials(tls) if listen and tls is not None else None
    chain: list[grpc.aio.ServerInterceptor] = [*telemetry.grpc_server_interceptors()]
    if registry is not None:
        chain.append(CallMetrics(metrics.grpc_server_metrics(registry)))
    # A caller may still pass telemetry.grpc_server_interceptors() itself: keep one tracing interceptor.
    extra = [i for i in interceptors if not (chain and telemetry.is_tracing_interceptor(i))]
    server = grpc.aio.server(interceptors=[*chain, *extra, TicketLogging(), Guard(accepted, redactor),
                                           TextDecoding()],
                             options=OPTIONS)
    added = _Registrations(server)
    for reg in register:
        reg(added)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if reflection:
        from grpc_reflection.v1alpha import reflection as grpc_reflection

        grpc_reflection.enable_server_reflection(
            [*added.services, health.SERVICE_NAME, grpc_reflection.SERVICE_NAME], server)
    if creds is not None:
        try:
            port = server.add_secure_port(listen, creds)
        except RuntimeError:
            port = 0
        if not port:
            raise errors.Unavailable(f"cannot listen on {listen} (the address is in use or not this host's); "
                                     "choose another --listen")
        return AfeServer(server, health_servicer, "", tuple(added.services), port)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    server.add_secure_port(socket_target(socket_path),
                           grpc.local_server_credentials(grpc.LocalConnectionType.UDS))
    return AfeServer(server, health_servicer, socket_path, tuple(added.services))
