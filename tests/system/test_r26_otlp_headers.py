"""R26: OTLP header values go only into the export request — never into a
span, an error or a log, including when the collector is down or answers
401 (and echoes the headers back in its error text)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.otlp import OtlpReceiver

ROOT = Path(__file__).resolve().parents[2]
KEY = "otlpcanary-apikey-4f1d9c"
TOKEN = "otlpcanary-bearer-8b2e71"
HEADERS = f"x-api-key={KEY},authorization=Bearer%20{TOKEN}"


def run_probe(mode: str, env_extra: dict[str, str]) -> tuple[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT),
           "OTEL_EXPORTER_OTLP_TIMEOUT": "2", **env_extra}
    proc = subprocess.run([sys.executable, "-m", "tests.system.otel_probe", mode], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, proc.stderr


def leaks(text: str) -> list[str]:
    return [name for name, v in (("x-api-key", KEY), ("authorization", TOKEN)) if v in text]


@pytest.fixture
def receiver():
    with OtlpReceiver() as rx:
        yield rx


@pytest.mark.timeout(90)
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_r26_headers_reach_only_the_export_request(receiver, protocol):
    out, err = run_probe("defended", receiver.env(headers=HEADERS, protocol=protocol))
    spans, requests = receiver.snapshot()
    assert any(r.get("x-api-key") == KEY and r.get("authorization") == f"Bearer {TOKEN}" for r in requests), \
        "the collector must receive the configured headers"
    probe = [s for s in spans if s.name == "probe.work"]
    assert probe, "the span must arrive"
    assert not leaks("\n".join(s.text() for s in spans)), "header value in a span"
    assert not leaks(err), "header value in a log line"
    assert "ENV_STILL_HAS_HEADERS False False" in out, "header variable left in the environment"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_r26_collector_answering_401_with_echo_logs_no_header(receiver, protocol):
    receiver.reject = True
    receiver.echo_headers_in_error = True
    _, err = run_probe("defended", receiver.env(headers=HEADERS, protocol=protocol))
    _, requests = receiver.snapshot()
    assert requests, "the exporter must have tried"
    assert "401" in err or "UNAUTHENTICATED" in err, "the failure itself must be logged"
    assert not leaks(err), f"header value in a log line: {err[-2000:]}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_r26_collector_down_logs_no_header(protocol):
    rx = OtlpReceiver().start()
    env = rx.env(headers=HEADERS, protocol=protocol)
    rx.stop()
    out, err = run_probe("defended", env)
    assert err.strip(), "the export failure must be logged"
    assert not leaks(err), f"header value in a log line: {err[-2000:]}"
    assert "ENV_STILL_HAS_HEADERS False False" in out


@pytest.mark.timeout(90)
def test_r26_positive_control_without_the_defence_headers_leak(receiver):
    """The same probe without redactor, redacting exporter and env scrubbing:
    the header value shows up in the span, the log and the environment —
    so the tests above would notice a leak."""
    receiver.reject = False
    out, err = run_probe("undefended", receiver.env(headers=HEADERS, protocol="http/protobuf"))
    spans, _ = receiver.snapshot()
    assert leaks("\n".join(s.text() for s in spans)), "control: the careless span attribute must leak"
    assert leaks(err), "control: the careless log line must leak"
    assert "ENV_STILL_HAS_HEADERS True True" in out


@pytest.mark.timeout(90)
def test_r26_positive_control_echoing_collector_leaks_into_unfiltered_logs(receiver):
    receiver.reject = True
    receiver.echo_headers_in_error = True
    _, err = run_probe("undefended", receiver.env(headers=HEADERS, protocol="grpc"))
    exporter_lines = [ln for ln in err.splitlines() if "careless" not in ln]
    assert leaks("\n".join(exporter_lines)), "control: the exporter logs the collector's echoed error text"


@pytest.mark.timeout(60)
def test_no_endpoint_means_no_tracing_and_headers_still_removed():
    out = subprocess.run(
        [sys.executable, "-c",
         "import os,sys\n"
         "from services.common.observability import telemetry\n"
         "from services.common.secrecy.redact import Redactor\n"
         "r=Redactor()\n"
         "p=telemetry.setup_tracing('x', r)\n"
         "print(p is None, 'OTEL_EXPORTER_OTLP_HEADERS' in os.environ, telemetry.grpc_server_interceptors(),"
         " r.redact('k=" + KEY + "'))\n"],
        cwd=ROOT, env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT),
                       "OTEL_EXPORTER_OTLP_HEADERS": HEADERS},
        capture_output=True, text=True, timeout=60, check=False).stdout
    assert out.split() == ["True", "False", "[]", "k=[redacted]"]
