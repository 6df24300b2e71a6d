"""Tracing through the central gRPC helpers: a client span, a server span in
the first service, its client span to the next service and that service's
server span all share one trace, parent by parent — the same propagation
that links gateway -> scheduler -> brokers across processes."""

from __future__ import annotations

import grpc
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services._gen.afe.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from services._gen.afe.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.observability import telemetry
from services.common.rpc import grpcutil
from services.common.rpc.links import new_secret
from services.common.secrecy.redact import Redactor


@pytest.fixture
def memory_tracing():
    exporter = InMemorySpanExporter()
    redactor = Redactor()
    provider = telemetry.setup_tracing("test", redactor, exporter=exporter)
    try:
        yield exporter, redactor
    finally:
        telemetry.shutdown_tracing()
    assert provider is not None


class Sandbox(sandbox_pb2_grpc.SandboxBrokerServicer):
    async def ListSandboxes(self, request, context):
        return sandbox_pb2.ListSandboxesResponse()


class Scheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, sandbox_sock: str, secret: bytes) -> None:
        self.sock, self.secret = sandbox_sock, secret

    async def ListWorkflows(self, request, context):
        async with grpcutil.open_channel(self.sock, self.secret) as ch:
            await sandbox_pb2_grpc.SandboxBrokerStub(ch).ListSandboxes(sandbox_pb2.ListSandboxesRequest())
        return scheduler_pb2.ListWorkflowsResponse()


@pytest.mark.timeout(60)
async def test_one_trace_across_two_grpc_hops(memory_tracing, short_tmp):
    exporter, redactor = memory_tracing
    s_secret, g_secret = new_secret(), new_secret()
    sb_sock, sc_sock = str(short_tmp / "sandbox.sock"), str(short_tmp / "scheduler.sock")
    sb = grpcutil.create_server(
        sb_sock, {"scheduler": s_secret}, redactor,
        [lambda srv: sandbox_pb2_grpc.add_SandboxBrokerServicer_to_server(Sandbox(), srv)])
    sc = grpcutil.create_server(
        sc_sock, {"gateway": g_secret}, redactor,
        [lambda srv: scheduler_pb2_grpc.add_SchedulerServicer_to_server(Scheduler(sb_sock, s_secret), srv)])
    await sb.start()
    await sc.start()
    try:
        with telemetry.span("gateway.rpc tickets.list", root=True):
            async with grpcutil.open_channel(sc_sock, g_secret) as ch:
                await scheduler_pb2_grpc.SchedulerStub(ch).ListWorkflows(scheduler_pb2.ListWorkflowsRequest())
    finally:
        await sc.stop(None)
        await sb.stop(None)
    telemetry.force_flush()
    spans = exporter.get_finished_spans()
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    root = by_name["gateway.rpc tickets.list"][0]
    chain = [s for s in spans if s.name.endswith("/ListWorkflows") or s.name.endswith("/ListSandboxes")]
    assert len(chain) == 4, [s.name for s in spans]   # client+server for each hop
    assert {s.context.trace_id for s in chain} == {root.context.trace_id}
    ids = {s.context.span_id: s for s in [root, *chain]}
    for s in chain:   # every span's parent is in the same chain
        assert s.parent is not None and s.parent.span_id in ids
    for secret in (s_secret.hex(), g_secret.hex()):   # link secrets travel in metadata, never in spans
        assert not any(secret in repr(dict(s.attributes or {})) for s in spans)


@pytest.mark.timeout(60)
async def test_tracing_off_adds_no_interceptors():
    telemetry.shutdown_tracing()
    assert telemetry.grpc_server_interceptors() == [] and telemetry.grpc_client_interceptors() == []
    with telemetry.span("nothing") as s:
        assert s is None
    assert telemetry.current_traceparent() is None


@pytest.mark.timeout(60)
async def test_traceparent_carries_a_ticket_run_into_the_same_trace(memory_tracing):
    exporter, _ = memory_tracing
    with telemetry.span("CreateTicket", root=True) as create:
        tp = telemetry.current_traceparent()
    with telemetry.span("ticket.run", parent=tp):
        pass
    telemetry.force_flush()
    run = next(s for s in exporter.get_finished_spans() if s.name == "ticket.run")
    assert run.context.trace_id == create.get_span_context().trace_id
    assert run.parent.span_id == create.get_span_context().span_id


@pytest.mark.timeout(60)
async def test_aiohttp_middleware_spans_name_the_route_not_the_path(memory_tracing):
    exporter, _ = memory_tracing

    async def handler(request):
        return web.Response(text="ok")

    app = web.Application(middlewares=[telemetry.aiohttp_middleware()])
    app.router.add_get("/tickets/{ticket}", handler)
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/tickets/T-secretish-123?q=input-value",
                                headers={"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01",
                                         "Cookie": "afe_session=cookie-value"})
        assert resp.status == 200
    telemetry.force_flush()
    (s,) = [s for s in exporter.get_finished_spans() if s.name.startswith("GET")]
    assert s.name == "GET /tickets/{ticket}"
    assert s.attributes["http.response.status_code"] == 200
    text = repr(dict(s.attributes)) + s.name
    for v in ("T-secretish-123", "input-value", "cookie-value"):
        assert v not in text
    assert s.context.trace_id != int("ab" * 16, 16), "an incoming traceparent from the internet is ignored"


@pytest.mark.timeout(60)
async def test_r26_redacting_exporter_masks_registered_values(memory_tracing):
    exporter, redactor = memory_tracing
    redactor.register("canary-span-value-9z")
    with telemetry.span("x", root=True, attributes={"a": "has canary-span-value-9z"}) as s:
        s.add_event("e", {"b": "canary-span-value-9z"})
    telemetry.force_flush()
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "x"]
    exported = repr(dict(span.attributes)) + repr([dict(e.attributes) for e in span.events])
    assert "canary-span-value-9z" not in exported
    # positive control: the SDK span itself (before the exporter wrapper) held the value
    assert "canary-span-value-9z" in s.attributes["a"]


@pytest.mark.timeout(60)
async def test_r26_header_value_in_an_error_text_is_redacted_before_it_leaves(short_tmp, monkeypatch):
    """A servicer that (wrongly) puts the OTLP header value in an error: the
    caller gets the text redacted, because setup_tracing registered it."""
    from services.common.errors import InvalidArgument

    value = "otlp-err-canary-77aa"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"x-api-key={value}")
    protected = Redactor()
    telemetry.setup_tracing("t", protected, exporter=InMemorySpanExporter())
    telemetry.shutdown_tracing()
    assert "OTEL_EXPORTER_OTLP_HEADERS" not in __import__("os").environ

    class Leaky(sandbox_pb2_grpc.SandboxBrokerServicer):
        async def ListSandboxes(self, request, context):
            raise InvalidArgument(f"collector said no to x-api-key={value}")

    async def details_with(redactor: Redactor) -> str:
        secret, sock = new_secret(), str(short_tmp / f"{id(redactor)}.sock")
        srv = grpcutil.create_server(
            sock, {"scheduler": secret}, redactor,
            [lambda s: sandbox_pb2_grpc.add_SandboxBrokerServicer_to_server(Leaky(), s)])
        await srv.start()
        try:
            async with grpcutil.open_channel(sock, secret) as ch:
                try:
                    await sandbox_pb2_grpc.SandboxBrokerStub(ch).ListSandboxes(sandbox_pb2.ListSandboxesRequest())
                except grpc.aio.AioRpcError as exc:
                    return exc.details() or ""
        finally:
            await srv.stop(None)
        return "no error"

    assert value not in await details_with(protected)
    assert value in await details_with(Redactor())   # positive control: an unaware redactor lets it through
