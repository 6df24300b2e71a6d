"""R25: no metric label carries a ticket id, an input, a path, a host or a
secret. Every label value comes from a closed set; anything else raises."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.observability import metered, metrics
from services.common.rpc import grpcutil
from services.common.rpc.links import new_secret
from services.common.secrecy.redact import Redactor

BAD_VALUES = ["T-20261201-abc123", "fix the login bug", "/work/data/workspaces/T-1", "pypi.org",
              "ghp_abcdefghijklmnopqrstuvwxyz012345", "running\n"]


def every_family(reg: CollectorRegistry):
    return [metrics.scheduler_metrics(reg), metrics.sandbox_metrics(reg), metrics.credentials_metrics(reg),
            metrics.gateway_metrics(reg), metrics.grpc_server_metrics(reg)]


def bounded_of(groups) -> list[metrics.Bounded]:
    return [v for g in groups for v in vars(g).values() if isinstance(v, metrics.Bounded)]


@pytest.mark.parametrize("bad", BAD_VALUES)
def test_r25_every_label_refuses_values_outside_its_set(bad):
    reg = CollectorRegistry()
    fams = bounded_of(every_family(reg))
    assert len(fams) >= 10
    for fam in fams:
        for label in fam.domains:
            good = {k: (d[0] if isinstance(d, tuple) else "/afe.sandbox.v1.SandboxBroker/Exec")
                    for k, d in fam.domains.items()}
            fam.labels(**good)   # the allowed values are accepted
            with pytest.raises(metrics.UnboundedLabel) as exc:
                fam.labels(**{**good, label: bad})
            assert bad not in str(exc.value), "the refused value is not repeated in the error"
    text = generate_latest(reg).decode()
    assert not any(b.strip() in text for b in BAD_VALUES)


def test_r25_positive_control_a_plain_counter_takes_any_label():
    reg = CollectorRegistry()
    c = Counter("plain_total", "no bounds", ["ticket"], registry=reg)
    c.labels(ticket=BAD_VALUES[0]).inc()
    assert BAD_VALUES[0] in generate_latest(reg).decode()


def test_r25_labels_must_be_exactly_the_declared_names():
    fam = metrics.scheduler_metrics(CollectorRegistry()).tickets
    with pytest.raises(metrics.UnboundedLabel):
        fam.labels(state="running", ticket="T-1")


def test_factories_are_idempotent_per_registry():
    reg = CollectorRegistry()
    assert metrics.scheduler_metrics(reg) is metrics.scheduler_metrics(reg)
    assert metrics.scheduler_metrics(CollectorRegistry()) is not metrics.scheduler_metrics(reg)


def test_r25_grpc_method_domain_is_a_shape_of_compiled_names():
    assert "/afe.scheduler.v1.Scheduler/CreateTicket" in metrics.GRPC_METHODS
    assert "/grpc.health.v1.Health/Check" in metrics.GRPC_METHODS
    for bad in ["/afe.scheduler.v1.Scheduler/T-1", "/evil/Method", "/afe.x.v1.Y/Z?x=1", "T-1"]:
        assert bad not in metrics.GRPC_METHODS


@pytest.mark.timeout(60)
async def test_r25_grpc_server_metrics_count_method_and_code_only(short_tmp):
    reg = CollectorRegistry()
    secret = new_secret()
    sock = str(short_tmp / "s.sock")
    server = grpcutil.create_server(sock, {"scheduler": secret}, Redactor(), [], registry=reg)
    await server.start()
    try:
        async with grpcutil.open_channel(sock, secret) as ch:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
        async with grpcutil.open_channel(sock, new_secret()) as ch:  # an unknown caller
            with pytest.raises(grpc.aio.AioRpcError):
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
        async with grpcutil.open_channel(sock, secret) as ch:  # a method nobody registered
            with pytest.raises(grpc.aio.AioRpcError):
                await ch.unary_unary("/afe.scheduler.v1.Scheduler/T-20261201-abc")(b"")
    finally:
        await server.stop(None)
    samples = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            if s.name == "afe_grpc_server_handled_total":
                samples[(s.labels["method"], s.labels["code"])] = s.value
    assert samples == {("/grpc.health.v1.Health/Check", "OK"): 1.0,
                       ("/grpc.health.v1.Health/Check", "PERMISSION_DENIED"): 1.0}
    assert "T-20261201" not in generate_latest(reg).decode()


@pytest.mark.timeout(60)
async def test_r25_http_metrics_name_method_and_status_class_never_the_path():
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    reg = CollectorRegistry()

    async def ok(request):
        return web.Response(text="ok")

    app = web.Application(middlewares=[metrics.http_metrics_middleware(reg)])
    app.router.add_get("/tickets/{id}", ok)
    async with TestClient(TestServer(app)) as client:
        assert (await client.get("/tickets/t-20261201-abc?q=secret-input")).status == 200
        assert (await client.get("/nowhere/t-20261201-def")).status == 404
        assert (await client.request("PROPFIND", "/tickets/x")).status == 405
    text = generate_latest(reg).decode()
    assert 'afe_http_requests_total{code_class="2xx",method="GET"} 1.0' in text
    assert 'afe_http_requests_total{code_class="4xx",method="GET"} 1.0' in text
    assert 'afe_http_requests_total{code_class="4xx",method="other"} 1.0' in text
    for v in ("t-20261201", "secret-input", "PROPFIND", "nowhere"):
        assert v not in text


# The decorator around the credential broker's core, with a stand-in core (the
# real one is exercised by the canary sweep, whose /metrics pages are checked).

def _sample(reg, name, **labels):
    return reg.get_sample_value(name, labels) or 0.0

class _Ws:
    def __init__(self, kind):
        self.forge = type("F", (), {"type": kind})()


class _Core:
    def workspace(self, name):
        return _Ws("github" if name == "gh" else "local")

    def model(self, name):
        return type("M", (), {"provider": "openai"})()

    async def push(self, ticket_id, workspace):
        return "afe/t", "sha"

    async def open_pull_request(self, ticket_id, workspace, title, body):
        from services.common.errors import PermissionDenied
        raise PermissionDenied("forge said no")

    async def complete(self, model, messages, tools, max_tokens):
        return "done"


async def test_r25_metered_credentials_counts_ops_forges_and_models():
    reg = CollectorRegistry()
    core = metered.MeteredCredentials(_Core(), reg)
    await core.push("t-20261201-abc", "gh")
    from services.common.errors import PermissionDenied

    with pytest.raises(PermissionDenied):
        await core.open_pull_request("t-20261201-abc", "gh", "title with input", "body")
    await core.complete("remote", [], [], 10)
    assert _sample(reg, "afe_git_operations_total", op="push", outcome="ok") == 1
    assert _sample(reg, "afe_forge_calls_total", forge="github", op="open_pr", outcome="denied") == 1
    assert _sample(reg, "afe_model_calls_total", provider="openai", outcome="ok") == 1
    assert _sample(reg, "afe_model_call_seconds_count", provider="openai") == 1
    text = generate_latest(reg).decode()
    for v in ("t-20261201", "title with input", "remote", '"gh"'):
        assert v not in text
