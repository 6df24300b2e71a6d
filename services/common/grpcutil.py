"""gRPC plumbing shared by every process: local Unix-socket servers that
check the caller's link secret on every call and map `AfeError`s to status
codes in one place, the standard health service, and clients that present
their link secret and turn status codes back into `AfeError`s.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from . import callers, errors, metrics, telemetry
from .links import METADATA_KEY
from .logs import ticket_var
from .redact import Redactor

log = logging.getLogger(__name__)

caller_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("afe_caller", default=None)

_CODES = {name: getattr(grpc.StatusCode, name) for name in errors.BY_CODE}

# Every status an afe server sets on purpose carries this trailing metadata,
# so a client can tell "the peer answered with an error" from "the peer went
# away" (a status made up by the gRPC library from a closed connection).
ORIGIN_KEY = "afe-status"
_ORIGIN = ((ORIGIN_KEY, "1"),)
_TRANSPORT_CODES = ("UNAVAILABLE", "UNKNOWN", "INTERNAL", "CANCELLED")


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, errors.AfeError):
        return _CODES.get(exc.code, grpc.StatusCode.INTERNAL), exc.message
    return grpc.StatusCode.INTERNAL, "internal error (details are in the server log)"


class CallerSecrets:
    """The secrets a server accepts, by caller name. A caller's secret may be
    replaced while the server runs (the scheduler follows `<run>/automation.key`
    so `afe token rotate --automation` takes effect without a restart); the set
    of callers never changes."""

    def __init__(self, secrets: Mapping[str, bytes]) -> None:
        self._secrets = dict(secrets)

    def __repr__(self) -> str:  # never show the secrets
        return f"CallerSecrets({sorted(self._secrets)})"

    def items(self) -> list[tuple[str, bytes]]:
        return list(self._secrets.items())

    def get(self, caller: str) -> bytes | None:
        return self._secrets.get(caller)

    def replace(self, caller: str, secret: bytes) -> None:
        if caller not in self._secrets:
            raise KeyError(f"{caller!r} is not a caller of this server")
        self._secrets[caller] = secret


NO_KEY = ("no link key presented: send the caller's key as hex in the `" + METADATA_KEY
          + "` metadata (local automation: the contents of <run>/automation.key)")
WRONG_KEY = "this caller is not allowed on this socket (the key is not one this server accepts)"


class _Guard(grpc.aio.ServerInterceptor):
    """Checks the link secret, then maps exceptions to redacted statuses."""

    def __init__(self, accepted: Mapping[str, bytes] | CallerSecrets, redactor: Redactor) -> None:
        self.accepted = accepted if isinstance(accepted, CallerSecrets) else CallerSecrets(accepted)
        self.redactor = redactor

    @staticmethod
    def _presented(metadata: Iterable[Any] | None) -> bool:
        return any(key == METADATA_KEY and value for key, value in metadata or ())

    def _who(self, metadata: Iterable[Any] | None) -> str | None:
        presented: bytes | None = None
        for key, value in metadata or ():
            if key == METADATA_KEY:
                presented = value.encode() if isinstance(value, str) else value
        if not presented:
            return None
        try:
            raw = bytes.fromhex(presented.decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            return None
        found = None
        for name, secret in self.accepted.items():
            if hmac.compare_digest(raw, secret):  # compare with every secret: no early exit
                found = name
        return found

    async def intercept_service(self, continuation, details):  # type: ignore[override]
        handler = await continuation(details)
        if handler is None:
            return None
        who = self._who(details.invocation_metadata)
        method = details.method
        redact = self.redactor.redact

        # PERMISSION_DENIED either way (the documented contract); the text says which mistake it was.
        why = WRONG_KEY if self._presented(details.invocation_metadata) else NO_KEY
        service = callers.service_of(method)
        if who is not None and not callers.may_call(who, service):
            why, who = callers.refusal(who, service), None   # a good key, but not for this service

        async def deny(request_or_iter, context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why, _ORIGIN)

        async def deny_stream(request_or_iter, context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why, _ORIGIN)
            yield  # pragma: no cover

        async def fail(context, exc: BaseException):
            if isinstance(exc, errors.AfeError):
                code, msg = status_for(exc)
                log.info("%s -> %s: %s", method, code.name, redact(msg))
            else:
                code, msg = status_for(exc)
                log.error("%s failed: %s", method, redact(repr(exc)), exc_info=exc)
            await context.abort(code, redact(msg), _ORIGIN)

        def wrap_unary(fn):
            async def call(request_or_iter, context):
                token = caller_var.set(who)
                try:
                    return await fn(request_or_iter, context)
                except (grpc.aio.AbortError, grpc.RpcError):
                    raise
                except Exception as exc:  # noqa: BLE001 - the server boundary: every error becomes a status
                    await fail(context, exc)
                finally:
                    caller_var.reset(token)
            return call

        def wrap_stream(fn):
            async def call(request_or_iter, context):
                token = caller_var.set(who)
                try:
                    async for item in fn(request_or_iter, context):
                        yield item
                except StreamDropped:
                    return  # send_within has already set the status; ending here lets grpc finish the call
                except (grpc.aio.AbortError, grpc.RpcError):
                    raise
                except Exception as exc:  # noqa: BLE001 - the server boundary: every error becomes a status
                    await fail(context, exc)
                finally:
                    caller_var.reset(token)
            return call

        if handler.unary_unary:
            fn = deny if who is None else wrap_unary(handler.unary_unary)
            return grpc.unary_unary_rpc_method_handler(fn, handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.unary_stream:
            fn = deny_stream if who is None else wrap_stream(handler.unary_stream)
            return grpc.unary_stream_rpc_method_handler(fn, handler.request_deserializer,
                                                        handler.response_serializer)
        if handler.stream_unary:
            fn = deny if who is None else wrap_unary(handler.stream_unary)
            return grpc.stream_unary_rpc_method_handler(fn, handler.request_deserializer,
                                                        handler.response_serializer)
        fn = deny_stream if who is None else wrap_stream(handler.stream_stream)
        return grpc.stream_stream_rpc_method_handler(fn, handler.request_deserializer,
                                                     handler.response_serializer)


class _Metrics(grpc.aio.ServerInterceptor):
    """Counts handled calls by method and status code, and times them (R25:
    the method comes from the compiled-in contracts, never from a caller)."""

    def __init__(self, families: metrics.GrpcServerMetrics) -> None:
        self.families = families

    async def intercept_service(self, continuation, details):  # type: ignore[override]
        handler = await continuation(details)
        method = details.method
        if handler is None or method not in metrics.GRPC_METHODS:
            return handler
        handled, seconds, dropped = self.families.handled, self.families.seconds, self.families.dropped

        def record(context, t0: float, exc: BaseException | None) -> None:
            code = None
            with contextlib.suppress(Exception):
                code = context.code()
            if isinstance(exc, asyncio.CancelledError):
                name = "CANCELLED"
            elif code is not None and hasattr(code, "name"):
                name = code.name
            elif exc is not None:
                name = "UNKNOWN"
            else:
                name = "OK"
            handled.labels(method=method, code=name).inc()
            seconds.labels(method=method).observe(time.perf_counter() - t0)

        def wrap_unary(fn):
            async def call(request_or_iter, context):
                t0, exc = time.perf_counter(), None
                try:
                    return await fn(request_or_iter, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    record(context, t0, exc)
            return call

        def count_drop() -> None:
            dropped.labels(method=method).inc()

        def wrap_stream(fn):
            async def call(request_or_iter, context):
                t0, exc = time.perf_counter(), None
                token = _on_drop.set(count_drop)
                try:
                    async for item in fn(request_or_iter, context):
                        yield item
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    with contextlib.suppress(ValueError):  # finalized in another context: nothing to reset
                        _on_drop.reset(token)
                    record(context, t0, exc)
            return call

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary),
                                                       handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(wrap_stream(handler.unary_stream),
                                                        handler.request_deserializer,
                                                        handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(wrap_unary(handler.stream_unary),
                                                        handler.request_deserializer,
                                                        handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(wrap_stream(handler.stream_stream),
                                                     handler.request_deserializer,
                                                     handler.response_serializer)


def _rebuild(handler, wrap: Callable[[Any, bool, bool], Any],
             deserializer: Callable[[bytes], Any] | None = None):
    """The same kind of method handler around `wrap(fn, request_streaming, response_streaming)`."""
    des = deserializer or handler.request_deserializer
    ser = handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, False, False), des, ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, False, True), des, ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, True, False), des, ser)
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream, True, True), des, ser)


def _call(fn, request_streaming: bool, response_streaming: bool,
          before: Callable[[Any], Any], after: Callable[[Any], None],
          each: Callable[[Any], None] | None = None):
    """A handler that runs `before(request)` (its result goes to `after`), then
    `fn`; with a request stream, `each` sees every message as it is read."""
    async def requests(it):
        async for message in it:
            if each is not None:
                each(message)
            yield message

    if response_streaming:
        async def stream(request_or_iter, context):
            token = before(None if request_streaming else request_or_iter)
            try:
                source = requests(request_or_iter) if request_streaming else request_or_iter
                async for item in fn(source, context):
                    yield item
            finally:
                after(token)
        return stream

    async def unary(request_or_iter, context):
        token = before(None if request_streaming else request_or_iter)
        try:
            return await fn(requests(request_or_iter) if request_streaming else request_or_iter, context)
        finally:
            after(token)
    return unary


def ticket_of(message: Any) -> str | None:
    """The ticket a request is about: its `ticket_id` field; the `id` of a
    scheduler `*TicketRequest` (GetTicketRequest, WatchTicketRequest, ...);
    else that of the one sub-message set (a stream's `start`)."""
    desc = getattr(message, "DESCRIPTOR", None)
    if desc is None:
        return None
    fields = desc.fields_by_name
    if "ticket_id" in fields and fields["ticket_id"].type == fields["ticket_id"].TYPE_STRING:
        return message.ticket_id or None
    if desc.name.endswith("TicketRequest") and "id" in fields:
        return message.id or None
    for f in desc.fields:
        if f.message_type is None:
            continue
        try:
            present = message.HasField(f.name)
        except ValueError:  # repeated or map: not a sub-message naming the call's ticket
            continue
        if present and (found := ticket_of(getattr(message, f.name))):
            return found
    return None


class TicketLogging(grpc.aio.ServerInterceptor):
    """Log records written while a call is handled name the ticket the
    request is about (services/common/logs.py::ticket_var; logs may name a
    ticket, metric labels may not). Sits outside the guard, so the guard's
    own line about a failed call names the ticket too."""

    async def intercept_service(self, continuation, details):  # type: ignore[override]
        handler = await continuation(details)
        if handler is None:
            return None

        def before(request):
            return ticket_var.set(ticket_of(request))

        def after(token) -> None:
            with contextlib.suppress(ValueError):  # finalized in another context: nothing to reset
                ticket_var.reset(token)

        def each(message) -> None:
            if ticket_var.get() is None:
                ticket_var.set(ticket_of(message))

        return _rebuild(handler, lambda fn, rs, ss: _call(fn, rs, ss, before, after, each))


class _BadRequest:
    """What the lenient decoder hands on instead of a message it could not decode."""

    def __init__(self, message: str) -> None:
        self.message = message


NOT_UTF8 = "a text field is not valid UTF-8; send UTF-8 text"


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(data: bytes):
        try:
            return deserializer(data)
        except DecodeError as exc:
            if "UTF-8" in str(exc):
                return _BadRequest(NOT_UTF8)
            return _BadRequest("the request could not be decoded as this method's request message")
    return decode


class TextDecoding(grpc.aio.ServerInterceptor):
    """Requests are decoded here rather than inside grpc, so a string field
    with invalid UTF-8 (or bytes that are no message at all) gets
    INVALID_ARGUMENT with a message that says so, not an opaque decode
    failure. Sits inside the guard, which turns the error into the status."""

    async def intercept_service(self, continuation, details):  # type: ignore[override]
        handler = await continuation(details)
        if handler is None:
            return None

        def check(request) -> None:
            if isinstance(request, _BadRequest):
                raise errors.InvalidArgument(request.message)

        return _rebuild(handler, lambda fn, rs, ss: _call(fn, rs, ss, check, lambda _: None, check),
                        _lenient(handler.request_deserializer))


def socket_target(path: str) -> str:
    return "unix://" + os.path.abspath(path)


MAX_MESSAGE = 32 * 1024 * 1024
_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
]


class _Registrations:
    """Hands the grpc server to `register` callables and notes the services
    they add (the generated `add_XServicer_to_server` names each one)."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server
        self.services: list[str] = []

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, name: str, handlers) -> None:
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

    async def start(self) -> None:
        """Listen (socket mode from `socket_mode()`), then report every service SERVING."""
        mode = socket_mode()
        old = os.umask(0o177)
        try:
            await self.grpc_server.start()
        finally:
            os.umask(old)
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
                  reflection: bool = False) -> AfeServer:
    """An afe gRPC server on a Unix socket, guarded by link secrets.

    `accepted`: the link keys of this process's callers (LinkSecrets.serve);
    a caller is then served only the services services/common/callers.py
    lists it for. `register` callables add servicers
    (`add_XServicer_to_server(servicer, server)`). Every server has the same
    boundary, in this order: tracing (when on, telemetry.setup_tracing);
    call metrics with `registry` (`afe_grpc_server_handled_total{method,code}`);
    `TicketLogging`; the guard (key and caller table, AfeError -> status);
    `TextDecoding`. With `reflection`, the server also answers gRPC server
    reflection for its services and health, behind the same key check.
    """
    chain: list[grpc.aio.ServerInterceptor] = [*telemetry.grpc_server_interceptors()]
    if registry is not None:
        chain.append(_Metrics(metrics.grpc_server_metrics(registry)))
    # A caller may still pass telemetry.grpc_server_interceptors() itself: keep one tracing interceptor.
    extra = [i for i in interceptors if not (chain and telemetry.is_tracing_interceptor(i))]
    server = grpc.aio.server(interceptors=[*chain, *extra, TicketLogging(), _Guard(accepted, redactor),
                                           TextDecoding()],
                             options=_OPTIONS)
    added = _Registrations(server)
    for reg in register:
        reg(added)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if reflection:
        from grpc_reflection.v1alpha import reflection as grpc_reflection

        grpc_reflection.enable_server_reflection(
            [*added.services, health.SERVICE_NAME, grpc_reflection.SERVICE_NAME], server)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    server.add_secure_port(socket_target(socket_path),
                           grpc.local_server_credentials(grpc.LocalConnectionType.UDS))
    return AfeServer(server, health_servicer, socket_path, tuple(added.services))


class StreamDropped(errors.ResourceExhausted):
    """A server stream that `send_within` ended: its RESOURCE_EXHAUSTED status
    is already on its way, so the guard ends the handler without another one."""


# Called (by the metrics interceptor, per call) when send_within drops a stream.
_on_drop: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("afe_on_drop", default=None)
# The status sends of dropped streams: they finish when the caller reads up to
# them or its connection closes (referenced here so they are not collected).
_dropping: set[asyncio.Future] = set()


def _dropped_status_done(task: asyncio.Future) -> None:
    _dropping.discard(task)
    if not task.cancelled():
        task.exception()  # AbortError once delivered, ExecuteBatchError if the caller went away first


async def send_within(context: grpc.aio.ServicerContext, message: Any, timeout: float, resume_hint: str) -> None:
    """Write one message of a server stream, or drop a caller that has
    stopped reading: when the transport has not taken the message within
    `timeout` seconds (its flow-control window to the caller stayed full, so
    the caller consumed nothing in that time), the call ends with
    RESOURCE_EXHAUSTED and `StreamDropped` is raised to end the handler.

    grpc.aio cannot cancel a send the transport already holds, and waiting
    for the status would wait for the caller (the status is queued behind
    the data it has not read; `context.abort` blocks until then). So the
    status is handed to the transport without waiting for it: the handler
    and whatever it holds (the watch's subscription) end at once, and the
    caller gets what the transport already held for it, then the status.
    The transport's share is bounded by the caller's flow-control window and
    is released when the caller reads it or closes its connection.
    """
    try:
        await asyncio.wait_for(context.write(message), timeout)
        return
    except TimeoutError:
        pass
    text = (f"the stream was dropped: the caller took in nothing for {timeout:g} s (it stopped reading or "
            f"reads far slower than the stream is written); {resume_hint}")
    status = asyncio.ensure_future(context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, text, _ORIGIN))
    _dropping.add(status)
    status.add_done_callback(_dropped_status_done)
    # One turn of the loop runs `abort` up to its wait for the caller: the code is set and the
    # status is queued in the transport (tasks start in the order they were scheduled).
    await asyncio.sleep(0)
    count = _on_drop.get()
    if count is not None:
        count()
    log.info("a server stream was dropped: its caller took in nothing for %g s", timeout)
    raise StreamDropped(text)


def socket_mode() -> int:
    """0600 (same user only) unless AFE_SOCKET_MODE=0660: the deployment in
    deploy/systemd and deploy/compose runs each process as its own user and
    lets exactly one caller group connect (the process's primary group)."""
    value = os.environ.get("AFE_SOCKET_MODE", "0600").strip()
    if value not in ("0600", "0660"):
        raise errors.ConfigError("AFE_SOCKET_MODE must be 0600 or 0660")
    return int(value, 8)


class _LinkAuth(grpc.AuthMetadataPlugin):
    def __init__(self, secret: bytes) -> None:
        self._value = secret.hex()

    def __call__(self, context, callback):
        callback(((METADATA_KEY, self._value),), None)


def open_channel(socket_path: str, secret: bytes | None) -> grpc.aio.Channel:
    """A channel to a local socket that presents `secret` on every call (and,
    when tracing is on, the current trace context)."""
    creds = grpc.local_channel_credentials(grpc.LocalConnectionType.UDS)
    if secret is not None:
        creds = grpc.composite_channel_credentials(creds, grpc.metadata_call_credentials(_LinkAuth(secret)))
    return grpc.aio.secure_channel(socket_target(socket_path), creds, options=_OPTIONS,
                                   interceptors=telemetry.grpc_client_interceptors() or None)


def _from_peer(exc: grpc.aio.AioRpcError) -> bool:
    with contextlib.suppress(Exception):
        for key, _value in exc.trailing_metadata() or ():
            if key == ORIGIN_KEY:
                return True
    return False


def error_from_rpc(exc: grpc.aio.AioRpcError, peer: str = "", what: str = "") -> errors.AfeError:
    """The AfeError for a failed call. A status the peer set keeps its code and
    text; one the gRPC library made up (the peer is not running, or its
    connection closed mid-call) becomes a `PeerUnavailable` that names the
    process and the step, never the transport's own words."""
    code = exc.code().name
    if _from_peer(exc):
        return errors.from_code(code, exc.details() or code.lower())
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
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except Exception:  # noqa: BLE001 - any failure means "not healthy"
        return False
