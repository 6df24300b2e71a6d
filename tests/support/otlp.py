"""A local OTLP trace receiver for tests: gRPC (TraceService) and HTTP
(`POST /v1/traces`, protobuf bodies) on 127.0.0.1.

It records every span and the request headers of every export request. It
can answer 401/UNAUTHENTICATED (optionally echoing the headers it got in the
error text, like a chatty collector would — the hardest case for R26), and
`stop()` simulates "collector down".

    with OtlpReceiver() as rx:
        env = rx.env(headers="x-api-key=secret", protocol="grpc")
        ...
        rx.wait_for_spans(lambda spans: len(spans) >= 3)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict
    status_message: str
    events: list
    raw: bytes = field(repr=False, default=b"")

    def text(self) -> str:
        """Everything in the span as text, for substring searches."""
        return "\n".join([self.service, self.name, repr(self.attributes), self.status_message,
                          repr(self.events), self.raw.decode("latin-1")])


def _value(v) -> object:
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which)


def _spans(req: trace_service_pb2.ExportTraceServiceRequest) -> list[Span]:
    out = []
    for rs in req.resource_spans:
        res = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        service = str(res.get("service.name", ""))
        for ss in rs.scope_spans:
            for sp in ss.spans:
                out.append(Span(
                    service=service, name=sp.name, trace_id=sp.trace_id.hex(), span_id=sp.span_id.hex(),
                    parent_span_id=sp.parent_span_id.hex(), kind=sp.kind,
                    attributes={kv.key: _value(kv.value) for kv in sp.attributes},
                    status_message=sp.status.message,
                    events=[(e.name, {kv.key: _value(kv.value) for kv in e.attributes}) for e in sp.events],
                    raw=sp.SerializeToString(),
                ))
    return out


class OtlpReceiver:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[Span] = []
        self.requests: list[dict[str, str]] = []   # headers of each export request
        self.reject: bool = False                   # answer 401 / UNAUTHENTICATED
        self.echo_headers_in_error: bool = False    # put received headers in the error text
        self.grpc_port = 0
        self.http_port = 0
        self._grpc: grpc.Server | None = None
        self._http: ThreadingHTTPServer | None = None

    # -- recording -----------------------------------------------------------
    def _record(self, headers: dict[str, str], body: bytes) -> tuple[bool, str]:
        with self.lock:
            self.requests.append(headers)
            if self.reject:
                text = "unauthorized"
                if self.echo_headers_in_error:
                    text += ": got " + ", ".join(f"{k}={v}" for k, v in headers.items())
                return False, text
        req = trace_service_pb2.ExportTraceServiceRequest()
        req.ParseFromString(body)
        with self.lock:
            self.spans.extend(_spans(req))
        return True, ""

    # -- servers ---------------------------------------------------------------
    def start(self) -> OtlpReceiver:
        rx = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                headers = {k: (v if isinstance(v, str) else v.decode("latin-1"))
                           for k, v in context.invocation_metadata()}
                ok, text = rx._record(headers, request.SerializeToString())
                if not ok:
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, text)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._grpc)
        self.grpc_port = self._grpc.add_insecure_port(f"127.0.0.1:{self.grpc_port}")
        self._grpc.start()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    import gzip

                    body = gzip.decompress(body)
                headers = {k.lower(): v for k, v in self.headers.items()}
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                ok, text = rx._record(headers, body)
                data = (b"" if ok else text.encode())
                self.send_response(200 if ok else 401)
                self.send_header("Content-Type", "application/x-protobuf" if ok else "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # keep test output quiet
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", self.http_port), Handler)
        self.http_port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Collector down: both ports stop answering (connections refused)."""
        if self._grpc is not None:
            self._grpc.stop(0).wait()
            self._grpc = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def __enter__(self) -> OtlpReceiver:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- helpers ----------------------------------------------------------------
    def env(self, *, headers: str | None = None, protocol: str = "grpc") -> dict[str, str]:
        """The standard variables pointing a process at this receiver."""
        if protocol == "grpc":
            env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.grpc_port}",
                   "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_INSECURE": "true"}
        else:
            env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.http_port}",
                   "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
        if headers is not None:
            env["OTEL_EXPORTER_OTLP_HEADERS"] = headers
        return env

    def snapshot(self) -> tuple[list[Span], list[dict[str, str]]]:
        with self.lock:
            return list(self.spans), list(self.requests)

    def wait_for(self, pred: Callable[[OtlpReceiver], bool], timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if pred(self):
                    return True
            time.sleep(0.1)
        with self.lock:
            return pred(self)
