"""The automation endpoint of the scheduler (docs/AUTOMATION.md) against the
REAL scheduler, brokers and Docker: reflection and health behind the key, bad
callers get the documented status and are counted with bounded labels, a
caller that stops reading its watch is dropped without holding up anyone
else, and a watch resumed from a seq misses and repeats nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services._gen.afe.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from services.common import errors
from services.common.layout import Layout
from services.common.observability import metrics
from services.common.rpc import grpcutil
from services.common.rpc.links import METADATA_KEY, new_secret
from services.common.secrecy.redact import Redactor
from services.scheduler.app import SchedulerOptions, build_app
from tests.scheduler.conftest import wait_for_state, write_config
from tests.support.system import REPO_ROOT, afe_system

pytestmark = [pytest.mark.docker, pytest.mark.timeout(240)]

# Twelve nodes of 4 MB output each (48 MB of events): far more than the transport (its flow-control
# window grows with the measured bandwidth) buffers for one stalled stream.
BIG = "head -c 4000000 /dev/zero | tr '\\\\0' x"
NODES = "".join(f"  - {{id: n{i}, run: \"{BIG}\"{f', needs: [n{i - 1}]' if i else ''}}}\n" for i in range(12))
WORKFLOWS = f"""\
kind: Workflow
name: quick
workspace: ws
nodes:
  - {{id: one, run: "true"}}
---
kind: Workflow
name: chatty
workspace: ws
nodes:
{NODES}"""
SEND_TIMEOUT = 4.0     # the scheduler drops a watch whose caller took in nothing for this long
PAUSE = 1.0            # a slow reader's pauses: each well under SEND_TIMEOUT, together more
PAUSE_EVERY = 6_000_000   # bytes read between two pauses (more than the transport's window)


class Endpoint:
    def __init__(self, sys_, app, registry: CollectorRegistry) -> None:
        self.sys = sys_
        self.app = app
        self.registry = registry
        self.sock = str(sys_.layout.socket("scheduler"))
        self.key = sys_.automation_secret

    def channel(self, secret: bytes | None) -> grpc.aio.Channel:
        return grpcutil.open_channel(self.sock, secret)

    def dropped(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(generate_latest(self.registry).decode()):
            for s in fam.samples:
                if s.name == "afe_grpc_server_streams_dropped_total":
                    out[s.labels["method"]] = s.value
        return out

    def handled(self) -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = {}
        for fam in text_string_to_metric_families(generate_latest(self.registry).decode()):
            for s in fam.samples:
                if s.name == "afe_grpc_server_handled_total":
                    out[(s.labels["method"], s.labels["code"])] = s.value
        return out


@pytest.fixture
async def endpoint(short_tmp):
    cfg = write_config(short_tmp, WORKFLOWS)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout, start=False) as sys_:
        # The automation key file as `afe up` writes it.
        fd = os.open(layout.automation_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, sys_.automation_secret.hex().encode() + b"\n")
        os.close(fd)
        reg = CollectorRegistry()
        app = build_app(sys_.config, layout, sys_.scheduler_links, Redactor(),
                        SchedulerOptions(watch_send_timeout=SEND_TIMEOUT), registry=reg)
        await app.start()
        try:
            yield Endpoint(sys_, app, reg)
        finally:
            await app.stop(0.5)


async def _code(coro) -> grpc.StatusCode:
    try:
        await coro
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def _list_services(ch) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(ch)
    async for resp in stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
        return sorted(s.name for s in resp.list_services_response.service)
    raise AssertionError("no reflection answer")


async def test_reflection_lists_and_describes_the_services_for_a_caller_with_the_key(endpoint):
    async with endpoint.channel(endpoint.key) as ch:
        names = await _list_services(ch)
    assert names == ["afe.scheduler.v1.GitHubHooks", "afe.scheduler.v1.Scheduler", "grpc.health.v1.Health",
                     "grpc.reflection.v1alpha.ServerReflection"]


async def test_a_generic_client_calls_the_scheduler_from_reflection_alone(endpoint):
    """No .proto and no generated stub: the descriptors come from the server."""
    # A synchronous client (as generic tools are), in a thread: the server runs on this loop.
    await asyncio.to_thread(_generic_client, endpoint)


def _generic_client(endpoint) -> None:
    creds = grpc.composite_channel_credentials(
        grpc.local_channel_credentials(grpc.LocalConnectionType.UDS),
        grpc.metadata_call_credentials(lambda ctx, cb: cb(((METADATA_KEY, endpoint.key.hex()),), None)))
    with grpc.secure_channel(grpcutil.socket_target(endpoint.sock), creds) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        pool = descriptor_pool.DescriptorPool(db)
        svc = pool.FindServiceByName("afe.scheduler.v1.Scheduler")
        method = svc.methods_by_name["ListWorkflows"]
        req_cls = message_factory.GetMessageClass(method.input_type)
        resp_cls = message_factory.GetMessageClass(method.output_type)
        call = ch.unary_unary("/afe.scheduler.v1.Scheduler/ListWorkflows",
                              request_serializer=req_cls.SerializeToString,
                              response_deserializer=resp_cls.FromString)
        resp = call(req_cls(), timeout=30)
    assert sorted(w.name for w in resp.workflows) == ["chatty", "quick"]
    fdp = descriptor_pb2.FileDescriptorProto()
    svc.file.CopyToProto(fdp)
    assert fdp.package == "afe.scheduler.v1"


async def test_bad_callers_get_the_documented_status_and_are_counted_with_bounded_labels(endpoint):
    sb_key = endpoint.sys.sandbox_secret       # the key of another link (scheduler -> sandbox)
    cr_key = endpoint.sys.credentials_secret   # and of scheduler -> credentials
    for secret in (None, new_secret(), sb_key, cr_key):
        async with endpoint.channel(secret) as ch:
            stub = pb_grpc.SchedulerStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.ListWorkflows(pb.ListWorkflowsRequest())
            assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert ("no link key presented" in exc.value.details()) == (secret is None), exc.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _ in stub.WatchTicket(pb.WatchTicketRequest(id="t-none", follow=True)):
                    pass
            assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert await _code(_list_services(ch)) == grpc.StatusCode.PERMISSION_DENIED
            assert await _code(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())) \
                == grpc.StatusCode.PERMISSION_DENIED
    async with endpoint.channel(endpoint.key) as ch:   # positive control: the same calls with the key
        stub = pb_grpc.SchedulerStub(ch)
        await stub.ListWorkflows(pb.ListWorkflowsRequest())
        assert (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())).status == \
            health_pb2.HealthCheckResponse.SERVING
        # A watch on a ticket that does not exist.
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for _ in stub.WatchTicket(pb.WatchTicketRequest(id="t-does-not-exist", follow=True)):
                pass
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND and "list tickets" in exc.value.details()
        # An oversized request (over the 32 MiB the server reads).
        big = "x" * (grpcutil.MAX_MESSAGE + 1)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.CreateTicket(pb.CreateTicketRequest(workspace="ws", workflow="quick", title="t", body=big,
                                                           principal="test"))
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Still served after all of that.
        assert [w.name for w in (await stub.ListWorkspaces(pb.ListWorkspacesRequest())).workspaces] == ["ws"]
    handled = endpoint.handled()
    assert handled[("/afe.scheduler.v1.Scheduler/ListWorkflows", "PERMISSION_DENIED")] == 4
    assert handled[("/afe.scheduler.v1.Scheduler/WatchTicket", "PERMISSION_DENIED")] == 4
    assert handled[("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "PERMISSION_DENIED")] == 4
    assert handled[("/grpc.health.v1.Health/Check", "PERMISSION_DENIED")] == 4
    assert handled[("/afe.scheduler.v1.Scheduler/WatchTicket", "NOT_FOUND")] == 1
    assert handled[("/afe.scheduler.v1.Scheduler/ListWorkflows", "OK")] == 1
    for method, code in handled:     # R25: every label value from its closed domain
        assert method in metrics.GRPC_METHODS and code in metrics.GRPC_CODES
    assert "t-does-not-exist" not in generate_latest(endpoint.registry).decode()


async def test_a_reader_that_stops_reading_does_not_hold_up_other_callers(endpoint):
    async with endpoint.channel(endpoint.key) as ch, endpoint.channel(endpoint.key) as other:
        stub, stub2 = pb_grpc.SchedulerStub(ch), pb_grpc.SchedulerStub(other)
        t = await stub.CreateTicket(pb.CreateTicketRequest(workspace="ws", workflow="chatty", title="chatty",
                                                           principal="test"))
        stalled = stub.WatchTicket(pb.WatchTicketRequest(id=t.id, from_seq=1, follow=True))
        await stalled.initial_metadata()          # connected; from here on it reads nothing
        # Meanwhile every other caller is served and the ticket runs to its end (48 MB of events).
        done = await wait_for_state(stub2, t.id, {"succeeded", "failed"})
        assert pb.TicketState.Name(done.state) == "TICKET_STATE_SUCCEEDED", done
        assert len((await stub2.ListTickets(pb.ListTicketsRequest())).tickets) == 1
        stalled.cancel()
        # A new watch from the start gets every event once.
        seqs = [ev.seq async for ev in stub2.WatchTicket(pb.WatchTicketRequest(id=t.id, from_seq=1, follow=True))]
        assert seqs == list(range(1, done.last_seq + 1))


async def _until(check, what: str, limit_s: float = 120) -> None:
    """Poll until `check()`; the limit only turns a hang into a readable failure."""
    end = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < end, f"never happened: {what}"
        await asyncio.sleep(0.05)


async def test_a_reader_that_stops_reading_is_dropped_with_resource_exhausted(endpoint, caplog):
    watch = "/afe.scheduler.v1.Scheduler/WatchTicket"
    async with endpoint.channel(endpoint.key) as ch, endpoint.channel(endpoint.key) as other:
        stub, stub2 = pb_grpc.SchedulerStub(ch), pb_grpc.SchedulerStub(other)
        t = await stub.CreateTicket(pb.CreateTicketRequest(workspace="ws", workflow="chatty", title="chatty",
                                                           principal="test"))
        stalled = stub.WatchTicket(pb.WatchTicketRequest(id=t.id, from_seq=1, follow=True))
        await stalled.initial_metadata()          # connected; from here on it reads nothing
        watchers = endpoint.app.engine.events._watchers
        await _until(lambda: t.id in watchers, "the watch subscribed")
        # 48 MB of events is far more than the transport holds for one stream: its window fills, the
        # next send waits, and SEND_TIMEOUT later the scheduler drops the watch, counted once.
        await _until(lambda: endpoint.dropped().get(watch) == 1, "the stalled watch was dropped")
        # The scheduler let go of it at once (the caller still has not read a thing) ...
        assert t.id not in watchers
        # ... and served everyone else meanwhile (another connection; the ticket runs to its end).
        done = await wait_for_state(stub2, t.id, {"succeeded", "failed"})
        assert pb.TicketState.Name(done.state) == "TICKET_STATE_SUCCEEDED", done
        # The stalled caller, reading at last, gets what the transport held, then RESOURCE_EXHAUSTED
        # from afe itself (not a transport status) with what to do next.
        got: list[pb.Event] = []
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for ev in stalled:
                got.append(ev)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "dropped" in exc.value.details() and "from_seq" in exc.value.details()
        assert isinstance(grpcutil.error_from_rpc(exc.value), errors.ResourceExhausted)
        assert got and got[-1].seq < done.last_seq
        # Resuming from the next seq misses and repeats nothing.
        rest = [ev async for ev in stub2.WatchTicket(
            pb.WatchTicketRequest(id=t.id, from_seq=got[-1].seq + 1, follow=True))]
        assert [e.seq for e in got + rest] == list(range(1, done.last_seq + 1))
    handled = endpoint.handled()
    assert handled[(watch, "RESOURCE_EXHAUSTED")] == 1 and handled[(watch, "OK")] == 1
    assert endpoint.dropped() == {watch: 1}
    for method, code in handled:     # R25: every label value from its closed domain
        assert method in metrics.GRPC_METHODS and code in metrics.GRPC_CODES
    assert t.id not in generate_latest(endpoint.registry).decode()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_a_slow_reader_that_keeps_reading_is_not_dropped(endpoint):
    """Positive control for the drop: a reader that pauses (for less than the bound each time, more
    than the bound in all) while the scheduler has far more for it than the transport holds."""
    watch = "/afe.scheduler.v1.Scheduler/WatchTicket"
    async with endpoint.channel(endpoint.key) as ch:
        stub = pb_grpc.SchedulerStub(ch)
        t = await stub.CreateTicket(pb.CreateTicketRequest(workspace="ws", workflow="chatty", title="chatty",
                                                           principal="test"))
        done = await wait_for_state(stub, t.id, {"succeeded", "failed"})
        assert pb.TicketState.Name(done.state) == "TICKET_STATE_SUCCEEDED", done
        seqs: list[int] = []
        size = since_pause = pauses = 0
        async for ev in stub.WatchTicket(pb.WatchTicketRequest(id=t.id, from_seq=1, follow=True)):
            seqs.append(ev.seq)
            size += ev.ByteSize()
            since_pause += ev.ByteSize()
            if since_pause >= PAUSE_EVERY:
                since_pause, pauses = 0, pauses + 1
                await asyncio.sleep(PAUSE)
    assert seqs == list(range(1, done.last_seq + 1))
    # Not vacuous: the history is far more than the transport holds, so at every pause the
    # scheduler's send waited on this reader; the pauses add up to more than the bound.
    assert size > 40_000_000 and pauses * PAUSE > SEND_TIMEOUT
    assert endpoint.handled()[(watch, "OK")] == 1
    assert endpoint.dropped() == {}


async def test_a_live_watch_resumed_after_a_disconnect_misses_and_repeats_nothing(endpoint):
    """Disconnect in the middle of a live ticket, reconnect from the next seq, twice."""
    async with endpoint.channel(endpoint.key) as ch:
        stub = pb_grpc.SchedulerStub(ch)
        t = await stub.CreateTicket(pb.CreateTicketRequest(workspace="ws", workflow="chatty", title="resume",
                                                           principal="test"))
        seen: list[pb.Event] = []
        cut_after = (3, 40)
        for n in cut_after:
            call = stub.WatchTicket(pb.WatchTicketRequest(id=t.id, from_seq=(seen[-1].seq + 1 if seen else 1),
                                                         follow=True))
            taken = 0
            async for ev in call:
                seen.append(ev)
                taken += 1
                if taken == n:
                    break
            call.cancel()                          # the client goes away mid-stream
        async for ev in stub.WatchTicket(pb.WatchTicketRequest(id=t.id, from_seq=seen[-1].seq + 1, follow=True)):
            seen.append(ev)
        final = await stub.GetTicket(pb.GetTicketRequest(id=t.id))
    assert [e.seq for e in seen] == list(range(1, final.last_seq + 1))
    assert seen[-1].type == "ticket.finished"


def _rotate(endpoint, *extra: str) -> subprocess.CompletedProcess:
    layout = endpoint.sys.layout
    return subprocess.run([sys.executable, "-m", "services.cli.main", "token", "rotate", "--automation",
                           "--data", str(layout.data_dir), "--run", str(layout.run_dir), *extra],
                          cwd=REPO_ROOT, capture_output=True, text=True, check=False, timeout=60)


async def test_afe_token_rotate_automation_replaces_the_key_on_the_running_scheduler(endpoint):
    old = endpoint.key
    async with endpoint.channel(old) as ch:      # control: the old key works before the rotation
        await pb_grpc.SchedulerStub(ch).ListWorkflows(pb.ListWorkflowsRequest())
    out = await asyncio.to_thread(_rotate, endpoint, "--print")
    assert out.returncode == 0, out.stderr
    new = bytes.fromhex(out.stdout.strip())
    assert endpoint.sys.layout.automation_key.read_text().strip() == new.hex()
    assert (os.stat(endpoint.sys.layout.automation_key).st_mode & 0o777) == 0o600
    deadline = time.monotonic() + 30
    async with endpoint.channel(old) as ch:
        while await _code(pb_grpc.SchedulerStub(ch).ListWorkflows(pb.ListWorkflowsRequest())) \
                != grpc.StatusCode.PERMISSION_DENIED:
            assert time.monotonic() < deadline, "the old automation key is still accepted"
            await asyncio.sleep(0.1)
    async with endpoint.channel(new) as ch:
        await pb_grpc.SchedulerStub(ch).ListWorkflows(pb.ListWorkflowsRequest())


def test_rotation_needs_a_running_afe_and_says_so(short_tmp):
    layout = Layout(short_tmp / "data", short_tmp / "run")
    out = subprocess.run([sys.executable, "-m", "services.cli.main", "token", "rotate", "--automation",
                          "--data", str(layout.data_dir), "--run", str(layout.run_dir)],
                         cwd=REPO_ROOT, capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 1 and "only while `afe up` runs" in out.stderr and "Traceback" not in out.stderr


async def test_a_key_file_that_is_not_private_or_not_a_key_is_ignored(endpoint):
    kf = endpoint.app.automation_key
    path = endpoint.sys.layout.automation_key
    other = new_secret()
    for mode, text in ((0o644, other.hex()), (0o600, "not hex"), (0o600, other.hex()[:20])):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        path.write_text(text + "\n")
        os.chmod(path, mode)
        assert kf.load() is False
        assert kf.accepted.get("automation") == endpoint.key
    os.chmod(path, 0o600)
    path.write_text(other.hex() + "\n")          # control: a private, well-formed file is adopted
    assert kf.load() is True and kf.accepted.get("automation") == other
