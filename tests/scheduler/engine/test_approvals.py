"""Approvals: a rejection ends the ticket without a merge; the ticket's text
is data (never a command, config or egress change)."""

from __future__ import annotations

import grpc
import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.layout import Layout
from tests.scheduler.conftest import (
    all_events,
    forge_records,
    git,
    payload,
    state_name,
    wait_for_event,
    wait_for_state,
    write_config,
)
from tests.support.system import afe_system

pytestmark = [pytest.mark.docker, pytest.mark.timeout(240)]

CONFIG = """\
kind: Workflow
name: change
workspace: ws
inputs: [{name: note, default: ""}]
nodes:
  - id: edit
    run: "printf '%s' {{ticket.title}} > TITLE.txt && cat TITLE.txt"
  - {id: pr, uses: builtin:open_pr, needs: [edit], with: {title: "afe: {{ticket.title}}"}}
  - {id: merge, uses: builtin:merge, needs: [pr]}
"""


async def test_reject_ends_the_ticket_without_merging(short_tmp):
    cfg = write_config(short_tmp, CONFIG)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    bare = cfg / "repos" / "calc.git"
    base = git(bare, "rev-parse", "main").strip()
    async with afe_system(cfg, layout) as sys_:
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="change", title="A change"))
        t = await wait_for_state(sys_.stub, t.id, {"waiting_approval", "failed"})
        assert state_name(t) == "waiting_approval", t.error
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await sys_.stub.RejectTicket(pb.RejectTicketRequest(id=t.id, principal="", reason="no"))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        t = await sys_.stub.RejectTicket(pb.RejectTicketRequest(id=t.id, principal="carol", reason="not this way"))
        t = await wait_for_state(sys_.stub, t.id, {"failed", "succeeded"})
        assert state_name(t) == "failed" and "rejected by carol: not this way" in t.error
        assert t.approval.principal == "carol" and not t.approval.granted
        assert git(bare, "rev-parse", "main").strip() == base                 # nothing merged
        records = forge_records(layout.data_dir, t.id)
        assert len(records) == 1 and records[0]["state"] == "open"
        types = [e.type for e in await all_events(sys_.stub, t.id)]
        assert "approval.rejected" in types and "merge.done" not in types
        live = await sys_.sandbox.ListSandboxes(spb.ListSandboxesRequest())
        assert t.id not in [s.ticket_id for s in live.sandboxes]
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await sys_.stub.ApproveTicket(pb.ApproveTicketRequest(id=t.id, principal="carol"))
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_ticket_text_is_data_not_a_command(short_tmp):
    cfg = write_config(short_tmp, CONFIG)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout) as sys_:
        hostile = "x'; touch PWNED; echo '$(touch PWNED2)"
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="change", title=hostile,
                                                                body="{{nodes.edit.output}}",
                                                                inputs={"note": "{{ticket.title}}"}))
        t = await wait_for_state(sys_.stub, t.id, {"waiting_approval", "failed"})
        assert state_name(t) == "waiting_approval", t.error
        # The title reached the command as one argument of data (R36): written
        # byte for byte, never run; a template-looking input stays text.
        edit = next(n for n in t.nodes if n.id == "edit")
        assert edit.output == hostile
        listing = await sys_.sandbox.ListDir(spb.ListDirRequest(ticket_id=t.id, path="."))
        names = {e.name for e in listing.entries}
        assert "TITLE.txt" in names and not {"PWNED", "PWNED2"} & names
        # Where templates do apply (the PR title), the value is inserted as text, once.
        events = await all_events(sys_.stub, t.id)
        assert any(e.type == "pr.opened" for e in events)
        rec = forge_records(layout.data_dir, t.id)[0]
        assert rec["title"] == f"afe: {hostile}"
        assert "{{nodes.edit.output}}" in rec["body"]
        sandbox_ready = next(payload(e) for e in events if e.type == "sandbox.ready")
        assert sandbox_ready["egress"] == []
        await sys_.stub.CancelTicket(pb.CancelTicketRequest(id=t.id, principal="tester"))


async def test_cancel_while_waiting_for_approval(short_tmp):
    cfg = write_config(short_tmp, CONFIG)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    bare = cfg / "repos" / "calc.git"
    base = git(bare, "rev-parse", "main").strip()
    async with afe_system(cfg, layout) as sys_:
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="change", title="A change"))
        t = await wait_for_state(sys_.stub, t.id, {"waiting_approval", "failed"})
        assert state_name(t) == "waiting_approval", t.error
        t = await sys_.stub.CancelTicket(pb.CancelTicketRequest(id=t.id, principal="dave"))
        assert state_name(t) == "cancelled" and not t.awaiting_sha
        assert {n.id: n.state for n in t.nodes}["merge"] == pb.NODE_STATE_CANCELLED
        assert git(bare, "rev-parse", "main").strip() == base
        live = await sys_.sandbox.ListSandboxes(spb.ListSandboxesRequest())
        assert t.id not in [s.ticket_id for s in live.sandboxes]
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await sys_.stub.ApproveTicket(pb.ApproveTicketRequest(id=t.id, principal="dave"))
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
async def test_r16_a_head_that_moved_after_the_request_is_not_merged_with_the_old_approval(short_tmp, backend,
                                                                                          request):
    cfg = write_config(short_tmp, CONFIG)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    bare = cfg / "repos" / "calc.git"
    url = request.getfixturevalue("pg_url") if backend == "postgresql" else ""
    async with afe_system(cfg, layout, database_url=url) as sys_:
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="change", title="A change"))
        t = await wait_for_state(sys_.stub, t.id, {"waiting_approval", "failed"})
        assert state_name(t) == "waiting_approval", t.error
        old = t.awaiting_sha
        # Someone pushes to the PR branch after the approval was requested.
        tree = git(bare, "rev-parse", f"{old}^{{tree}}").strip()
        moved = git(bare, "-c", "user.name=x", "-c", "user.email=x@x", "commit-tree", tree, "-p", old,
                    "-m", "sneaky").strip()
        git(bare, "update-ref", f"refs/heads/afe/{t.id}", moved, old)

        # The person approves what they saw: the old head. It is not merged; a new request follows.
        await sys_.stub.ApproveTicket(pb.ApproveTicketRequest(id=t.id, principal="alice", sha=old))
        await wait_for_event(sys_.stub, t.id, lambda e: e.type == "approval.requested" and payload(e)["sha"] == moved)
        t = await sys_.stub.GetTicket(pb.GetTicketRequest(id=t.id))
        assert state_name(t) == "waiting_approval" and t.awaiting_sha == moved
        assert git(bare, "rev-list", "--merges", "main") == ""            # nothing merged yet

        await sys_.stub.ApproveTicket(pb.ApproveTicketRequest(id=t.id, principal="alice", sha=moved))
        t = await wait_for_state(sys_.stub, t.id, {"succeeded", "failed"})
        assert state_name(t) == "succeeded", t.error
        parents = git(bare, "rev-list", "--parents", "-n", "1", "main").split()
        assert parents[0] == t.pr.merge_sha and moved in parents[1:]
        requested = [payload(e)["sha"] for e in await all_events(sys_.stub, t.id) if e.type == "approval.requested"]
        assert requested == [old, moved]
    assert layout.store_file.exists() == (backend == "sqlite")   # the store was where the URL said
