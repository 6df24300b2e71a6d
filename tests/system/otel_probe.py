"""Subprocess used by the R26 tests: sets tracing up from the standard
OTEL_* variables exactly as a composition root does, then does the careless
things a bug could do with the OTLP header value (put it in a span
attribute, an event, a status text and a log line), flushes and exits.

`python -m tests.system.otel_probe defended|undefended`
`undefended` is the positive control: the same steps with a plain exporter
and a plain log handler, no redactor and no environment scrubbing.
"""

from __future__ import annotations

import logging
import os
import sys


def main() -> int:
    mode = sys.argv[1]
    leaked = os.environ.get("OTEL_EXPORTER_OTLP_HEADERS", "")  # what a careless caller might hold
    from services.common.observability import telemetry
    from services.common.observability.logs import setup_logging
    from services.common.secrecy.redact import Redactor

    if mode == "defended":
        redactor = Redactor()
        setup_logging("probe", redactor, level="INFO", stream=sys.stderr, json_format=True)
        provider = telemetry.setup_tracing("probe", redactor)
    else:
        logging.basicConfig(stream=sys.stderr, level=logging.INFO)
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": "afe-probe"}))
        provider.add_span_processor(BatchSpanProcessor(telemetry._build_exporter()))
        telemetry._active = provider
    assert provider is not None, "tracing should be on: an endpoint is set"
    from opentelemetry.trace import Status, StatusCode

    log = logging.getLogger("probe")
    with telemetry.span("probe.work", root=True, attributes={"afe.note": f"careless {leaked}"}) as s:
        s.add_event("careless", {"value": leaked})
        s.set_status(Status(StatusCode.ERROR, f"failed with {leaked}"))
        log.error("careless log line %s", leaked)
    provider.force_flush(8000)
    with open("/proc/self/environ", "rb") as fh:
        environ = fh.read()
    value = leaked.split("=", 1)[-1].split(",")[0]
    print("ENV_STILL_HAS_HEADERS", bool(value) and value.encode() in environ,
          "OTEL_EXPORTER_OTLP_HEADERS" in os.environ, flush=True)
    telemetry.shutdown_tracing()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
