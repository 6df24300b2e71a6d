"""The client side of a local link: channels that present the caller's link
secret on every call, and status codes turned back into `AfeError`s."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import errors
from services.common.observability import telemetry
from services.common.rpc.links import METADATA_KEY
from services.common.rpc.sockets import OPTIONS, socket_target
from services.common.rpc.statuses import ORIGIN_KEY, reason_in
from services.common.rpc.tls import TlsFiles, channel_credentials

log = logging.getLogger(__name__)

_TRANSPORT_CODES = ("UNAVAILABLE", "UNKNOWN", "INTERNAL", "CANCELLED")

# A peer that went away (a broker restarted) is connected to again within about 0.6 s of
# its return: gRPC's default back-off between connection attempts starts at 1 s and grows
# by 1.6 times to 120 s, so a broker away for a few seconds was found again only seconds
# after it was back. Tries every 100 ms at first, at most 500 ms apart (+-20% jitter).
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
CHANNEL_OPTIONS = OPTIONS + RECONNECT_OPTIONS

_Continuation = Callable[..., Awaitable[Any]]     # (call details, request or request iterator) -> the call


class _LinkAuth(grpc.AuthMetadataPlugin):  # type: ignore[misc]  # grpc ships no type information
    """The link secret as call credentials (for a synchronous channel; an aio
    channel of `open_channel` uses `_LinkSecret`, which costs no thread)."""

    def __init__(self, secret: bytes) -> None:
        self._value = secret.hex()

    def __call__(self, context: grpc.AuthMetadataContext,
                 callback: Callable[[tuple[tuple[str, str], ...], Any], None]) -> None:
        callback(((METADATA_KEY, self._value),), None)


class _LinkSecret:
    """Adds the link secret to every call's metadata. Not call credentials:
    gRPC runs a metadata plugin on a new thread for every call (about 0.3 ms
    a call, several under load, on each node's Exec); the secret goes over the
    same local Unix-socket channel either way."""

    def __init__(self, secret: bytes) -> None:
        self._pair = (METADATA_KEY, secret.hex())

    def details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(d.metadata or ()))
        metadata.add(*self._pair)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)

    def interceptors(self) -> list[Any]:
        """One per kind of call (a channel files an interceptor under the first kind it is)."""
        return [_UnaryUnary(self), _UnaryStream(self), _StreamUnary(self), _StreamStream(self)]


# grpc ships no type information: the base classes are Any to mypy.
class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, link: _LinkSecret) -> None:
        self.link = link

    async def intercept_unary_unary(
            self, continuation: _Continuation, client_call_details: grpc.aio.ClientCallDetails,
            request: Any) -> Any:
        return await continuation(self.link.details(client_call_details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, link: _LinkSecret) -> None:
        self.link = link

    async def intercept_unary_stream(
            self, continuation: _Continuation, client_call_details: grpc.aio.ClientCallDetails,
            request: Any) -> Any:
        return await continuation(self.link.details(client_call_details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, link: _LinkSecret) -> None:
        self.link = link

    async def intercept_stream_unary(
            self, continuation: _Continuation, client_call_details: grpc.aio.ClientCallDetails,
            request_iterator: Any) -> Any:
        return await continuation(self.link.details(client_call_details), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, link: _LinkSecret) -> None:
        self.link = link

    async def intercept_stream_stream(
            self, continuation: _Continuation, client_call_details: grpc.aio.ClientCallDetails,
            request_iterator: Any) -> Any:
        return await continuation(self.link.details(client_call_details), request_iterator)


def open_channel(socket_path: str, secret: bytes | None) -> grpc.aio.Channel:
    """A channel to a local socket that presents `secret` on every call (and,
    when tracing is on, the current trace context)."""
    creds = grpc.local_channel_credentials(grpc.LocalConnectionType.UDS)
    interceptors = telemetry.grpc_client_interceptors()
    if secret is not None:
        interceptors += _LinkSecret(secret).interceptors()
    return grpc.aio.secure_channel(socket_target(socket_path), creds, options=CHANNEL_OPTIONS,
                                   interceptors=interceptors or None)


def open_remote_channel(address: str, secret: bytes | None, tls: TlsFiles) -> grpc.aio.Channel:
    """A channel to `host:port` on another host (R39): mutual TLS with the
    certificate and CA of `tls`, and `secret` on every call as on a local link."""
    interceptors = telemetry.grpc_client_interceptors()
    if secret is not None:
        interceptors += _LinkSecret(secret).interceptors()
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=CHANNEL_OPTIONS,
                                   interceptors=interceptors or None)


def _from_peer(exc: grpc.aio.AioRpcError) -> bool:
    with contextlib.suppress(Exception):
        for key, _value in exc.trailing_metadata() or ():
            if key == ORIGIN_KEY:
                return True
    return False


def _reason(exc: grpc.aio.AioRpcError) -> errors.Reason | None:
    with contextlib.suppress(Exception):
        return reason_in(exc.trailing_metadata() or ())
    return None


def error_from_rpc(exc: grpc.aio.AioRpcError, peer: str = "", what: str = "") -> errors.AfeError:
    """The AfeError for a failed call. A status the peer set keeps its code and
    text; one the gRPC library made up (the peer is not running, or its
    connection closed mid-call) becomes a `PeerUnavailable` that names the
    process and the step, never the transport's own words."""
    code = exc.code().name
    if _from_peer(exc):
        return errors.from_code(code, exc.details() or code.lower(), _reason(exc))
    who = peer or "the afe process at the other end"
    during = f" during {what}" if what else ""
    log.info("%s%s: transport status %s: %s", who, during, code, exc.details())
    if code == "DEADLINE_EXCEEDED":
        return errors.DeadlineExceeded(f"{who} did not answer{during} in time")
    if code in _TRANSPORT_CODES:
        return errors.PeerUnavailable(f"{who} went away{during} (it is not running or its connection closed)")
    return errors.from_code(code, exc.details() or code.lower())


@contextlib.asynccontextmanager
async def rpc_errors(peer: str = "", what: str = "") -> AsyncIterator[None]:
    """Turn gRPC status errors raised inside the block into AfeErrors
    (`peer`, `what`: the process called and the step, for the message)."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        raise error_from_rpc(exc, peer, what) from exc


async def check_health(socket_path: str, secret: bytes | None, timeout: float = 2.0) -> bool:
    try:
        async with open_channel(socket_path, secret) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
    except Exception:  # noqa: BLE001 - any failure means "not healthy"
        return False
