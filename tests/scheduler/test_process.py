"""The scheduler process: AFE_DATABASE_URL read once and never repeated
(R29, R30), readiness names its dependencies, and only the gateway and local
automation may call it."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services._gen.afe.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from services.common.config.database_url import read_database_url, store_path
from services.common.errors import ConfigError
from services.common.layout import Layout
from services.common.rpc import grpcutil
from services.common.secrecy.redact import Redactor
from tests.support.system import afe_system

from .conftest import write_config

pytestmark = [pytest.mark.docker, pytest.mark.timeout(120)]

PASSWORD = "hunter2-Correct-Horse"
WORKFLOW = """\
kind: Workflow
name: quick
workspace: ws
nodes:
  - {id: one, run: "true"}
"""


async def test_r29_database_url_is_used_and_never_repeated(short_tmp):
    cfg = write_config(short_tmp, WORKFLOW)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    db = short_tmp / "elsewhere" / "sched.db"
    url = f"sqlite://afe:{PASSWORD}@/{db}"
    async with afe_system(cfg, layout, subprocess=True, scheduler_env={"AFE_DATABASE_URL": url}) as sys_:
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="quick", title="x"))
        assert db.exists() and not layout.store_file.exists()
        environ = Path(f"/proc/{sys_.proc.pid}/environ").read_bytes()
        assert PASSWORD.encode() not in environ and url.encode() not in environ   # value scrubbed (R30)
        port = sys_.ready["ops_port"]
        # (in a thread: the brokers answering the probes run on this event loop)
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10).read().decode())
        assert json.loads(body) == {"status": "ok"}
        assert t.id
    log = sys_.log_path.read_text()
    assert "scheduler ready" in log           # positive control: the log is the process's log
    assert PASSWORD not in log and url not in log


async def test_r29_postgresql_url_is_used_and_never_repeated(short_tmp, pg_url):
    import psycopg

    password = urllib.parse.urlsplit(pg_url).password
    assert password and password in pg_url                 # positive control: the URL carries one
    cfg = write_config(short_tmp, WORKFLOW)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout, subprocess=True, scheduler_env={"AFE_DATABASE_URL": pg_url}) as sys_:
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="quick", title="on postgres"))
        environ = Path(f"/proc/{sys_.proc.pid}/environ").read_bytes()
        assert password.encode() not in environ                # value scrubbed (R30)
    with psycopg.connect(pg_url) as db:
        assert db.execute("SELECT title FROM tickets WHERE id=%s", (t.id,)).fetchone() == ("on postgres",)
    assert not layout.store_file.exists()
    log = sys_.log_path.read_text()
    assert "scheduler ready" in log and password not in log and pg_url not in log


def _readyz(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def test_readyz_names_the_store_while_postgresql_is_down_and_the_scheduler_goes_on_after(short_tmp, durable_pg):
    from tests.support import postgres

    url = durable_pg.app_url(durable_pg.fresh_database())
    cfg = write_config(short_tmp, WORKFLOW)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout, subprocess=True, database_url=url) as sys_:
        port = sys_.ready["ops_port"]
        assert await asyncio.to_thread(_readyz, port) == (200, {"status": "ok"})
        await asyncio.to_thread(postgres.stop_only, durable_pg)
        try:
            status, body = await asyncio.to_thread(_readyz, port)
            assert status == 503 and body["failing"] == ["store"]          # named, without its error text
        finally:
            await asyncio.to_thread(postgres.start_again, durable_pg)
        assert await asyncio.to_thread(_readyz, port) == (200, {"status": "ok"})
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="quick", title="after the outage"))
        for _ in range(200):
            t = await sys_.stub.GetTicket(pb.GetTicketRequest(id=t.id))
            if t.state == pb.TICKET_STATE_SUCCEEDED:
                break
            await asyncio.sleep(0.1)
        assert t.state == pb.TICKET_STATE_SUCCEEDED, t.error
    log = sys_.log_path.read_text()
    assert urllib.parse.urlsplit(url).password not in log


async def test_r29_unreachable_postgresql_stops_the_scheduler_with_what_to_change(short_tmp):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"postgresql://afe:{PASSWORD}@127.0.0.1:{port}/afe"
    cfg = write_config(short_tmp, WORKFLOW)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    with pytest.raises(RuntimeError, match="exited before it was ready") as exc:
        async with afe_system(cfg, layout, subprocess=True, scheduler_env={"AFE_DATABASE_URL": url}):
            pass
    text = str(exc.value)
    assert f"cannot reach the PostgreSQL database afe on 127.0.0.1 port {port}" in text
    assert PASSWORD not in text and url not in text and "Traceback" not in text


def test_database_url_forms():
    layout = Layout.from_args("/srv/afe/data", "/srv/afe/run")
    r = Redactor()
    assert store_path(layout, r, {}) == layout.store_file
    assert str(store_path(layout, r, {"AFE_DATABASE_URL": "sqlite:///var/lib/afe.db"})) == "/var/lib/afe.db"
    assert store_path(layout, r, {"AFE_DATABASE_URL": "sqlite:db/x.db"}) == layout.data_dir / "db" / "x.db"
    store_path(layout, r, {"AFE_DATABASE_URL": f"sqlite://u:{PASSWORD}@/x.db"})
    assert PASSWORD not in r.redact(f"oops {PASSWORD}")
    r2 = Redactor()
    pg = read_database_url(layout, r2, {"AFE_DATABASE_URL": f"postgresql://u:{PASSWORD}@db:5433/afe"})
    assert (pg.backend, pg.where) == ("postgresql", "the PostgreSQL database afe on db port 5433")
    assert PASSWORD not in repr(pg) and PASSWORD not in r2.redact(f"oops {PASSWORD}")
    for bad in (f"mysql://u:{PASSWORD}@db/afe", f"postgresql://u:{PASSWORD}@db:notaport/afe",
                f"postgresql://u:{PASSWORD}@db/afe?nosuchparam=1"):
        with pytest.raises(ConfigError) as exc:
            read_database_url(layout, Redactor(), {"AFE_DATABASE_URL": bad})
        assert PASSWORD not in str(exc.value) and bad not in str(exc.value)


async def test_only_gateway_and_automation_may_call(short_tmp):
    cfg = write_config(short_tmp, WORKFLOW)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout) as sys_:
        sock = str(layout.socket("scheduler"))
        for secret, allowed in ((sys_.gateway_secret, True), (sys_.automation_secret, True),
                                (sys_.sandbox_secret, False), (None, False), (b"x" * 32, False)):
            async with grpcutil.open_channel(sock, secret) as ch:
                stub = pb_grpc.SchedulerStub(ch)
                if allowed:
                    await stub.ListWorkflows(pb.ListWorkflowsRequest())
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as exc:
                        await stub.ListWorkflows(pb.ListWorkflowsRequest())
                    assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
        wfs = await sys_.stub.ListWorkflows(pb.ListWorkflowsRequest())
        assert [w.name for w in wfs.workflows] == ["quick"] and wfs.workflows[0].nodes[0].kind == "run"
        wss = await sys_.stub.ListWorkspaces(pb.ListWorkspacesRequest())
        assert [w.name for w in wss.workspaces] == ["ws"] and wss.workspaces[0].forge == "local"
