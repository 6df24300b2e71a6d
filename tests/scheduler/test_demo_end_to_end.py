"""The demo is the main job: ticket -> model fix -> tests in the sandbox ->
PR on the local forge -> waiting_approval -> approve -> merged into the
base branch, with the full event history. Real brokers, Docker and git."""

from __future__ import annotations

import json

import docker
import grpc
import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common import demo
from services.common.layout import Layout
from tests.support.system import afe_system

from .conftest import all_events, forge_records, git, payload, state_name, wait_for_state

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]


async def test_demo_ticket_to_merged_commit_with_full_history(short_tmp):
    cfg = demo.materialize(short_tmp / "cfg")
    layout = Layout(short_tmp / "data", short_tmp / "run")
    bare = cfg / "repos" / "calc.git"
    base_before = git(bare, "rev-parse", "main").strip()
    async with afe_system(cfg, layout) as sys_:
        stub = sys_.stub
        t = await stub.CreateTicket(pb.CreateTicketRequest(
            workflow="demo-fix", title="Fix add()", body="`add` subtracts.", principal="tester"))
        assert t.workspace == "demo" and [n.id for n in t.nodes] == ["fix", "test", "pr", "merge"]
        t = await wait_for_state(stub, t.id, {"waiting_approval", "failed"})
        assert state_name(t) == "waiting_approval", t.error
        assert t.pr.number and t.pr.head_sha and t.awaiting_sha == t.pr.head_sha
        assert t.pr.head_branch == f"afe/{t.id}"

        # The diff the approver sees is the model's fix.
        diff = await stub.GetTicketDiff(pb.GetTicketRequest(id=t.id))
        assert "-    return a - b" in diff.diff and "+    return a + b" in diff.diff

        # The sandbox lives until the ticket is terminal.
        live = await sys_.sandbox.ListSandboxes(spb.ListSandboxesRequest())
        assert t.id in [s.ticket_id for s in live.sandboxes]

        # Approving a different SHA is refused (R16); nothing is merged.
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.ApproveTicket(pb.ApproveTicketRequest(id=t.id, principal="alice", sha="0" * 40))
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert git(bare, "rev-parse", "main").strip() == base_before

        await stub.ApproveTicket(pb.ApproveTicketRequest(id=t.id, principal="alice", sha=t.awaiting_sha))
        t = await wait_for_state(stub, t.id, {"succeeded", "failed"})
        assert state_name(t) == "succeeded", t.error
        assert t.pr.state == "merged" and t.approval.principal == "alice" and t.approval.granted

        # The merge commit is on the local forge's base branch and carries the fix.
        head = git(bare, "rev-parse", "main").strip()
        assert head == t.pr.merge_sha
        assert t.pr.head_sha in git(bare, "rev-list", "--parents", "-n", "1", "main")
        assert "return a + b" in git(bare, "show", "main:calc.py")
        assert len(forge_records(layout.data_dir, t.id)) == 1

        events = await all_events(stub, t.id)
        seqs = [e.seq for e in events]
        assert seqs == list(range(1, len(events) + 1)) and seqs[-1] == t.last_seq
        types = [e.type for e in events]
        for expected in ("ticket.created", "node.started", "sandbox.ready", "node.message", "node.tool_call",
                         "node.output", "node.finished", "pr.opened", "approval.requested",
                         "approval.granted", "merge.done", "ticket.finished"):
            assert expected in types, expected
        assert types[-1] == "ticket.finished" and payload(events[-1])["state"] == "succeeded"
        order = [types.index(x) for x in ("ticket.created", "sandbox.ready", "pr.opened",
                                          "approval.requested", "approval.granted", "merge.done")]
        assert order == sorted(order)
        calls = [payload(e)["name"] for e in events if e.type == "node.tool_call"]
        assert calls == ["list_dir", "read_file", "write_file", "run"]
        granted = payload(next(e for e in events if e.type == "approval.granted"))
        assert granted == {"principal": "alice", "sha": t.pr.head_sha}
        for e in events:
            assert isinstance(json.loads(e.payload_json), dict)

        # Resuming from the middle gives exactly the tail: no gap, no duplicate.
        tail = [e async for e in stub.WatchTicket(pb.WatchTicketRequest(id=t.id, from_seq=10, follow=True))]
        assert [e.seq for e in tail] == seqs[9:]

        # Teardown (R12): sandbox gone, workspace released.
        live = await sys_.sandbox.ListSandboxes(spb.ListSandboxesRequest())
        assert t.id not in [s.ticket_id for s in live.sandboxes]
        client = docker.from_env()
        try:
            assert client.containers.list(all=True, filters={"label": f"afe.ticket={t.id}"}) == []
        finally:
            client.close()
        assert not layout.workspace(t.id).exists()
