"""OpenTelemetry tracing for every process (R26).

`setup_tracing(service, redactor)` is called once by each composition root.
Export is configured ONLY by the standard `OTEL_EXPORTER_OTLP_*` variables;
when no endpoint variable is set, nothing is built and every helper here is
a no-op (no interceptors, no spans).

The OTLP header values (`OTEL_EXPORTER_OTLP_HEADERS`,
`OTEL_EXPORTER_OTLP_TRACES_HEADERS`) usually carry a collector API key. They
go into the exporter and nowhere else: each value is registered with the
process's redactor BEFORE the exporter is built (so an exporter failure that
echoes them — collector down, 401 with a chatty body — is masked by the
logging filter), and the variables are deleted from the environment and from
`/proc/self/environ` once the exporter holds them. Every span passes through
`RedactingSpanExporter` on its way out, so a span attribute, event or status
text cannot carry a registered secret either.

gRPC spans come from opentelemetry-instrumentation-grpc's aio interceptors,
which `grpcutil.create_server` / `grpcutil.open_channel` add when tracing is
on; the W3C `traceparent` travels in gRPC metadata, so gateway -> scheduler
-> brokers is one trace. The gateway's HTTP server spans come from
`aiohttp_middleware()`; the scheduler carries a ticket's trace across its
background run with `current_traceparent()` / `span(..., parent=...)`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from services.common.errors import ConfigError
from services.common.secrecy.env_secrets import take_secret_env
from services.common.secrecy.redact import Redactor

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler, Middleware
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)

HEADER_VARS = ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS")
ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")

# The provider built by setup_tracing, consulted by grpcutil and the helpers
# below. The OpenTelemetry API is process-global by design; this is the one
# place afe keeps that global, so tests can reset it.
_active: Any = None


def parse_headers(raw: str) -> dict[str, str]:
    """`k1=v1,k2=v2` (values URL-encoded, as the OTLP spec says)."""
    out: dict[str, str] = {}
    for part in raw.split(","):
        if "=" not in part:
            continue
        key, value = part.split("=", 1)
        out[urllib.parse.unquote(key.strip()).lower()] = urllib.parse.unquote(value.strip())
    return out


def _register_header_values(redactor: Redactor, environ: Mapping[str, str]) -> None:
    for var in HEADER_VARS:
        raw = environ.get(var)
        if not raw:
            continue
        redactor.register(raw)
        for value in parse_headers(raw).values():
            redactor.register(value)
            if value.lower().startswith(("bearer ", "basic ", "token ")):
                redactor.register(value.split(None, 1)[1])


def tracing_configured(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return any(env.get(v) for v in ENDPOINT_VARS)


def _protocol() -> str:
    for var in PROTOCOL_VARS:
        value = os.environ.get(var, "").strip().lower()
        if value:
            if value in ("grpc", "http/protobuf"):
                return value
            raise ConfigError(f"{var}={value!r} is not supported; use 'grpc' or 'http/protobuf'")
    return "grpc"


def _build_exporter() -> SpanExporter:
    """The OTLP span exporter; it reads endpoint, headers, TLS, timeout and
    compression from the standard variables itself."""
    if _protocol() == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
    return OTLPSpanExporter()


class RedactingSpanExporter:
    """Passes each span through the redactor before the real exporter sees it."""

    def __init__(self, inner: Any, redactor: Redactor) -> None:
        self.inner = inner
        self.redactor = redactor

    def _attrs(self, attrs: Mapping[str, Any] | None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in (attrs or {}).items():
            if isinstance(value, str):
                value = self.redactor.redact(value)
            elif isinstance(value, (list, tuple)):
                value = tuple(self.redactor.redact(v) if isinstance(v, str) else v for v in value)
            out[self.redactor.redact(key)] = value
        return out

    def _span(self, span: Any) -> Any:
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.trace import Status

        status = span.status
        if status.description:
            status = Status(status.status_code, self.redactor.redact(status.description))
        events = [Event(self.redactor.redact(e.name), self._attrs(e.attributes), e.timestamp)
                  for e in span.events]
        return ReadableSpan(
            name=self.redactor.redact(span.name), context=span.context, parent=span.parent,
            resource=span.resource, attributes=self._attrs(span.attributes), events=events,
            links=span.links, kind=span.kind, status=status, start_time=span.start_time,
            end_time=span.end_time, instrumentation_scope=span.instrumentation_scope,
        )

    def export(self, spans: Sequence[Any]) -> Any:
        return self.inner.export([self._span(s) for s in spans])

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return bool(self.inner.force_flush(timeout_millis))


def setup_tracing(service_name: str, redactor: Redactor, *, exporter: Any = None) -> Any:
    """Build and activate the TracerProvider for this process, or return None.

    `exporter` replaces the OTLP exporter (tests use an in-memory one); the
    header variables are still registered and removed.
    """
    global _active
    _register_header_values(redactor, os.environ)
    configured = exporter is not None or tracing_configured()
    try:
        if not configured:
            return None
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        inner = exporter if exporter is not None else _build_exporter()
        provider = TracerProvider(resource=Resource.create({"service.name": f"afe-{service_name}"}))
        provider.add_span_processor(BatchSpanProcessor(RedactingSpanExporter(inner, redactor),  # type: ignore[arg-type]
                                                       schedule_delay_millis=500))
        _active = provider
        log.info("tracing on (%s)", "custom exporter" if exporter is not None else _protocol())
        return provider
    finally:
        # The exporter holds the headers now; nothing else in this process may.
        take_secret_env(HEADER_VARS, redactor)


def active_provider() -> Any:
    return _active


SHUTDOWN_GRACE_S = 3.0


def shutdown_tracing(grace_s: float = SHUTDOWN_GRACE_S) -> bool:
    """Flush and stop the exporter, waiting at most `grace_s` seconds.

    A collector that is down must not hold a process past the launcher's
    stop budget (SIGTERM to gone in under 10 s), so the flush runs in a
    daemon thread and is abandoned when the grace is over: the spans still
    queued are lost, which is logged. Returns True when the flush finished.
    Afterwards every helper is a no-op again.
    """
    global _active
    provider, _active = _active, None
    if provider is None:
        return True

    def _stop() -> None:
        try:
            provider.shutdown()
        except Exception as exc:  # noqa: BLE001 - an exporter failing at exit must not crash shutdown
            log.warning("tracing shutdown failed: %s", exc)

    worker = threading.Thread(target=_stop, name="afe-tracing-shutdown", daemon=True)
    worker.start()
    worker.join(grace_s)
    if worker.is_alive():
        log.warning("tracing: the collector did not take the last spans within %.0f s; dropped", grace_s)
        return False
    return True


def force_flush(timeout_millis: int = 5000) -> None:
    if _active is not None:
        _active.force_flush(timeout_millis)


# ---- gRPC -----------------------------------------------------------------

# Calls made on a timer, not for a ticket or a person: no span (else a trace every few seconds).
# The Commands stream is shared by every ticket: each command on it has a span of its
# own in its ticket's trace instead (services/sandbox/commands/stream.py, COMMAND_SPAN).
UNTRACED_METHODS = ("/afe.sandbox.v1.SandboxBroker/Identify", "/afe.sandbox.v1.SandboxBroker/Commands")


def _traced_calls() -> Callable[[Any], bool]:
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(filters.any_of(*(filters.full_method_name(m) for m in UNTRACED_METHODS)))


def grpc_server_interceptors() -> list[Any]:
    if _active is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=_active, filter_=_traced_calls())]


def is_tracing_interceptor(obj: object) -> bool:
    return type(obj).__name__ == "OpenTelemetryAioServerInterceptor"


def grpc_client_interceptors() -> list[Any]:
    if _active is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors(tracer_provider=_active, filter_=_traced_calls()))


# ---- spans of our own -------------------------------------------------------

def current_traceparent() -> str | None:
    """The W3C traceparent of the current span (store it with a ticket)."""
    if _active is None:
        return None
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier.get("traceparent")


@contextlib.contextmanager
def span(name: str, *, parent: str | None = None, root: bool = False,
         attributes: Mapping[str, Any] | None = None) -> Iterator[Any]:
    """A span named `name`; `parent` is a traceparent string to continue,
    `root=True` starts a new trace. Yields None when tracing is off."""
    if _active is None:
        yield None
        return
    from opentelemetry import context as otel_context
    from opentelemetry.propagate import extract

    ctx = None
    if parent:
        ctx = extract({"traceparent": parent})
    elif root:
        ctx = otel_context.Context()
    tracer = _active.get_tracer("afe")
    with tracer.start_as_current_span(name, context=ctx, attributes=dict(attributes or {})) as s:
        yield s


def aiohttp_middleware() -> Middleware:
    """aiohttp middleware giving every gateway request a SERVER span.

    The span carries the method, the route's template (never the path, query
    string, headers or cookies) and the status. An incoming `traceparent` is
    ignored: the gateway faces the internet, so a request starts a new trace.
    """
    from aiohttp import web

    @web.middleware
    async def tracing(request: web.Request, handler: Handler) -> web.StreamResponse:
        if _active is None:
            return await handler(request)
        from opentelemetry import context as otel_context
        from opentelemetry.trace import SpanKind, Status, StatusCode

        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        tracer = _active.get_tracer("afe.gateway.http")
        with tracer.start_as_current_span(
            f"{request.method} {route}", context=otel_context.Context(), kind=SpanKind.SERVER,
            attributes={"http.request.method": request.method, "http.route": route},
            record_exception=False, set_status_on_exception=False,
        ) as s:
            try:
                response = await handler(request)
            except web.HTTPException as exc:
                s.set_attribute("http.response.status_code", exc.status)
                if exc.status >= 500:
                    s.set_status(Status(StatusCode.ERROR))
                raise
            except Exception as exc:
                s.set_attribute("http.response.status_code", 500)
                s.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                raise
            s.set_attribute("http.response.status_code", response.status)
            if response.status >= 500:
                s.set_status(Status(StatusCode.ERROR))
            return response

    return tracing
