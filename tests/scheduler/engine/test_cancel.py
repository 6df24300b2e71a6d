"""Cancel during a long `run` node: the process in the sandbox dies with the
sandbox, the sandbox, its egress proxy and its network are removed (R12),
and the ticket ends `cancelled`."""

from __future__ import annotations

import docker
import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.layout import Layout
from tests.scheduler.conftest import all_events, payload, state_name, wait_for_event, write_config
from tests.support.system import afe_system

pytestmark = [pytest.mark.docker, pytest.mark.timeout(240)]

WORKFLOW = """\
kind: Workflow
name: long
workspace: ws
nodes:
  - id: wait
    run: "echo started && exec sleep 300"
  - id: after
    run: "echo never"
    needs: [wait]
"""


async def _processes(sandbox, ticket_id: str) -> str:
    out = []
    async for ev in sandbox.Exec(spb.ExecRequest(ticket_id=ticket_id,
                                                 argv=["bash", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"])):
        if ev.WhichOneof("event") == "stdout":
            out.append(ev.stdout.decode())
    return "".join(out)


def _objects(client: docker.DockerClient, ticket_id: str) -> tuple[list, list]:
    flt = {"label": f"afe.ticket={ticket_id}"}
    return client.containers.list(all=True, filters=flt), client.networks.list(filters=flt)


async def test_cancel_during_long_run_kills_it_and_tears_down(short_tmp):
    cfg = write_config(short_tmp, WORKFLOW, sandbox_extra="  egress: [pypi.org]\n")
    layout = Layout(short_tmp / "data", short_tmp / "run")
    client = docker.from_env()
    try:
        async with afe_system(cfg, layout) as sys_:
            t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="long", title="sleepy"))
            await wait_for_event(sys_.stub, t.id, lambda e: e.type == "node.output"
                                 and "started" in payload(e)["text"])
            # Positive control: the command runs in the sandbox, which has a proxy and a network.
            assert "sleep 300" in await _processes(sys_.sandbox, t.id)
            containers, networks = _objects(client, t.id)
            assert len(containers) == 2 and len(networks) == 1
            ids = [c.id for c in containers]

            t = await sys_.stub.CancelTicket(pb.CancelTicketRequest(id=t.id, principal="bob"))
            assert state_name(t) == "cancelled" and "bob" in t.error
            states = {n.id: n.state for n in t.nodes}
            assert states == {"wait": pb.NODE_STATE_CANCELLED, "after": pb.NODE_STATE_PENDING}

            assert _objects(client, t.id) == ([], [])
            for cid in ids:
                with pytest.raises(docker.errors.NotFound):
                    client.containers.get(cid)
            live = await sys_.sandbox.ListSandboxes(spb.ListSandboxesRequest())
            assert t.id not in [s.ticket_id for s in live.sandboxes]
            assert not layout.workspace(t.id).exists()

            events = await all_events(sys_.stub, t.id)
            assert events[-1].type == "ticket.finished" and payload(events[-1])["state"] == "cancelled"
            assert any(e.type == "node.finished" and payload(e) == {"node": "wait", "state": "cancelled", "attempt": 1}
                       for e in events)
            # Cancelling again is harmless and changes nothing.
            again = await sys_.stub.CancelTicket(pb.CancelTicketRequest(id=t.id, principal="bob"))
            assert state_name(again) == "cancelled" and again.last_seq == t.last_seq
    finally:
        client.close()


async def test_cancel_of_a_queued_ticket_never_starts_it(short_tmp):
    cfg = write_config(short_tmp, WORKFLOW)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout, max_running=1) as sys_:
        first = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="long", title="first"))
        second = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="long", title="second"))
        assert state_name(second) == "queued"
        second = await sys_.stub.CancelTicket(pb.CancelTicketRequest(id=second.id, principal="bob"))
        assert state_name(second) == "cancelled"
        types = [e.type for e in await all_events(sys_.stub, second.id)]
        assert types == ["ticket.created", "ticket.finished"]
        await sys_.stub.CancelTicket(pb.CancelTicketRequest(id=first.id, principal="bob"))
