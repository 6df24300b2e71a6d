"""The one gRPC boundary of the three services (services/common/rpc/grpcutil.py
create_server): the caller table (services/common/rpc/callers.py), ticket-id
logging and text decoding, against the REAL scheduler, sandbox broker and
credential broker servers on temporary Unix sockets (no Docker needed: the
calls used touch only files and the store).

Every server here accepts the keys of all three link names, which the
launcher never does, so a refusal can only come from the table: health
answers every key on every socket (the key is good), and the same key is
served on the services the table lists it for."""

from __future__ import annotations

import contextlib
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services._gen.afe.credentials.v1 import credentials_pb2, credentials_pb2_grpc
from services._gen.afe.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from services._gen.afe.scheduler.v1 import hooks_pb2, hooks_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.common.config.manifests import load_config
from services.common.layout import Layout
from services.common.observability.logs import ticket_var
from services.common.rpc import callers, grpcutil
from services.common.rpc.links import LinkSecrets, new_secret
from services.common.secrecy.redact import Redactor
from services.credentials.app import CredentialBrokerOptions
from services.credentials.app import build_app as build_credentials
from services.launcher.launch import make_links
from services.sandbox.app import SandboxBrokerOptions
from services.sandbox.app import build_app as build_sandbox
from services.scheduler.app import SchedulerOptions
from services.scheduler.app import build_app as build_scheduler
from tests.scheduler.conftest import write_config

pytestmark = pytest.mark.timeout(120)

LINKS = ("gateway", "automation", "scheduler")
WORKFLOW = """\
kind: Workflow
name: quick
workspace: ws
nodes:
  - {id: one, run: "true"}
"""


class Servers:
    def __init__(self, layout: Layout, keys: dict[str, bytes], apps: dict[str, object]) -> None:
        self.layout, self.keys, self.apps = layout, keys, apps

    def channel(self, process: str, link: str) -> grpc.aio.Channel:
        return grpcutil.open_channel(str(self.layout.socket(process)), self.keys[link])


@contextlib.asynccontextmanager
async def three_servers(root):
    layout = Layout(root / "data", root / "run")
    layout.ensure()
    config = load_config(write_config(root, WORKFLOW))
    keys = {name: new_secret() for name in LINKS}
    links = LinkSecrets(serve=dict(keys))
    apps = {
        "scheduler": build_scheduler(config, layout, links, Redactor(), SchedulerOptions(recovery_interval=0)),
        "sandbox": build_sandbox(layout, links, Redactor(), SandboxBrokerOptions(instance="callers-test")),
        "credentials": build_credentials(config, layout, links, {}, Redactor(),
                                         CredentialBrokerOptions(spare_checkouts=False)),
    }
    started = []
    try:
        for app in apps.values():
            await app.server.start()      # servers only: the engine stays still
            started.append(app)
        yield Servers(layout, keys, apps)
    finally:
        for app in started:
            await app.server.stop(0)
        await apps["scheduler"].engine.stop()
        apps["scheduler"].store.close()
        await apps["credentials"].core.close()


# service -> (process serving it, a call that needs nothing but the server)
CALLS = {
    callers.SCHEDULER: ("scheduler", lambda ch: scheduler_pb2_grpc.SchedulerStub(ch).ListWorkflows(
        scheduler_pb2.ListWorkflowsRequest())),
    callers.GITHUB_HOOKS: ("scheduler", lambda ch: hooks_pb2_grpc.GitHubHooksStub(ch).DeliverGitHubEvent(
        hooks_pb2.GitHubDelivery(delivery_id="72d3162e-cc78-11e3-81ab-4c9367dc0958", event="ping",
                                 payload=b"{}"))),
    callers.SANDBOX: ("sandbox", lambda ch: sandbox_pb2_grpc.SandboxBrokerStub(ch).Identify(
        sandbox_pb2.IdentifyRequest())),
    callers.CREDENTIALS: ("credentials", lambda ch: credentials_pb2_grpc.CredentialBrokerStub(ch).RelayUsage(
        credentials_pb2.RelayUsageRequest(ticket_id="t-callers"))),
}


async def _code(call) -> tuple[grpc.StatusCode, str]:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def test_the_table_names_every_service_and_the_launcher_hands_out_exactly_its_keys():
    assert set(CALLS) == set(callers.CALLERS)
    assert {s for served in callers.SERVES.values() for s in served} == set(callers.CALLERS)
    links, _automation = make_links()
    for process, services in callers.SERVES.items():
        assert set(links[process].serve) == callers.callers_of(services), process
    # every link the launcher makes calls something the table lets it call
    for process, link in links.items():
        for callee in link.call:
            assert process in callers.callers_of(callers.SERVES[callee]), (process, callee)


async def test_r35_each_service_answers_only_the_callers_in_the_table(short_tmp):
    async with three_servers(short_tmp) as s:
        for process, app in s.apps.items():
            assert set(app.server.services) == set(callers.SERVES[process])
        seen = {}
        for service, (process, call) in CALLS.items():
            for link in LINKS:
                async with s.channel(process, link) as ch:
                    if process != "scheduler" or link in callers.callers_of(callers.SERVES["scheduler"]):
                        # the key is good on this socket (positive control for the refusals below)
                        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
                        assert health.status == health_pb2.HealthCheckResponse.SERVING
                    code, details = await _code(call(ch))
                seen[(service, link)] = code
                if link in callers.CALLERS[service]:
                    assert code != grpc.StatusCode.PERMISSION_DENIED, (service, link, details)
                else:
                    assert code == grpc.StatusCode.PERMISSION_DENIED, (service, link, code)
        # the automation key, good for the Scheduler service, is refused on GitHubHooks by the table
        assert seen[(callers.SCHEDULER, "automation")] == grpc.StatusCode.OK
        assert seen[(callers.GITHUB_HOOKS, "automation")] == grpc.StatusCode.PERMISSION_DENIED
        async with s.channel("scheduler", "automation") as ch:
            _, details = await _code(CALLS[callers.GITHUB_HOOKS][1](ch))
        assert details == callers.refusal("automation", callers.GITHUB_HOOKS)


class _Lines(logging.Handler):
    """What the JSON formatter would put in "ticket": the context's ticket at emit time."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str | None]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.getMessage(), ticket_var.get()))


@contextlib.contextmanager
def captured():
    handler, root = _Lines(), logging.getLogger()
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        root.removeHandler(handler)
        root.setLevel(old)


def _ticket_calls(ticket: str):
    """(process, link, method, call): each fails, so the guard logs a line about it."""
    return [
        ("scheduler", "gateway", "/afe.scheduler.v1.Scheduler/GetTicket",
         lambda ch: scheduler_pb2_grpc.SchedulerStub(ch).GetTicket(scheduler_pb2.GetTicketRequest(id=ticket))),
        ("scheduler", "automation", "/afe.scheduler.v1.Scheduler/WatchTicket",
         lambda ch: _drain(scheduler_pb2_grpc.SchedulerStub(ch).WatchTicket(
             scheduler_pb2.WatchTicketRequest(id=ticket, from_seq=1)))),
        ("sandbox", "scheduler", "/afe.sandbox.v1.SandboxBroker/ReadFile",
         lambda ch: sandbox_pb2_grpc.SandboxBrokerStub(ch).ReadFile(
             sandbox_pb2.ReadFileRequest(ticket_id=ticket, path="README.md"))),
        ("credentials", "scheduler", "/afe.credentials.v1.CredentialBroker/Diff",
         lambda ch: credentials_pb2_grpc.CredentialBrokerStub(ch).Diff(
             credentials_pb2.DiffRequest(ticket_id=ticket, workspace="ws"))),
    ]


async def _drain(stream) -> None:
    async for _ in stream:
        pass


async def test_log_lines_of_a_call_name_its_ticket_in_all_three_services(short_tmp):
    async with three_servers(short_tmp) as s:
        for ticket in ("t-0123456789abcdef", ""):
            for process, link, method, call in _ticket_calls(ticket):
                with captured() as lines:
                    async with s.channel(process, link) as ch:
                        code, _ = await _code(call(ch))
                assert code != grpc.StatusCode.OK, (method, ticket)
                about = [t for msg, t in lines if msg.startswith(method + " ")]
                assert about, (method, lines)
                # control: a request without a ticket id gives lines without one, so the name
                # in the lines above comes from the request, not from anything left in the context
                assert about == [ticket or None] * len(about), (method, ticket, lines)


def _raw(ch: grpc.aio.Channel, method: str):
    return ch.unary_unary(method, request_serializer=None, response_deserializer=None)


async def test_text_that_is_not_utf8_gets_invalid_argument_in_all_three_services(short_tmp):
    # field 1 (a string in each request) = b"t-\xff\xfe"; the control sends valid UTF-8 in its place
    bad, good = b"\x0a\x04t-\xff\xfe", b"\x0a\x04t-ok"
    methods = [("scheduler", "gateway", "/afe.scheduler.v1.Scheduler/GetTicket"),
               ("sandbox", "scheduler", "/afe.sandbox.v1.SandboxBroker/ReadFile"),
               ("credentials", "scheduler", "/afe.credentials.v1.CredentialBroker/Diff")]
    async with three_servers(short_tmp) as s:
        for process, link, method in methods:
            async with s.channel(process, link) as ch:
                code, details = await _code(_raw(ch, method)(bad))
                assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, grpcutil.NOT_UTF8), method
                code, details = await _code(_raw(ch, method)(good))
                assert details != grpcutil.NOT_UTF8 and code != grpc.StatusCode.INTERNAL, (method, code, details)
