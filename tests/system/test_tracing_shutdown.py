"""Stopping a process never waits on a collector that does not answer:
the final flush is bounded, so `afe up` still stops within its budget."""

from __future__ import annotations

import threading

from opentelemetry.sdk.trace.export import SpanExportResult

from services.common.observability import telemetry
from services.common.secrecy.redact import Redactor


class _Exporter:
    def __init__(self, block: threading.Event | None) -> None:
        self.block = block
        self.exported = 0

    def export(self, spans):
        if self.block is not None:
            self.block.wait(30)  # a collector that never answers
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis=30000):
        return True


def _one_span() -> None:
    with telemetry.span("work", root=True):
        pass


def test_shutdown_with_a_hung_collector_gives_up_after_the_grace():
    release = threading.Event()
    hung = _Exporter(release)
    telemetry.setup_tracing("test", Redactor(), exporter=hung)
    try:
        _one_span()
        assert telemetry.shutdown_tracing(grace_s=0.5) is False
        assert telemetry.active_provider() is None
    finally:
        release.set()


def test_shutdown_with_a_working_collector_flushes_everything():
    ok = _Exporter(None)
    telemetry.setup_tracing("test", Redactor(), exporter=ok)
    _one_span()
    assert telemetry.shutdown_tracing(grace_s=10) is True
    assert ok.exported == 1
