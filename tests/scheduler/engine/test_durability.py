"""kill -9 of the scheduler (a real subprocess) while a node runs and while
the ticket waits for approval; each restart resumes the ticket, which ends
merged with exactly one PR and one merge."""

from __future__ import annotations

import pytest

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

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

WORKFLOW = """\
kind: Workflow
name: slow-fix
workspace: ws
nodes:
  - id: edit
    run: "echo fixed >> NOTES.md && echo edit-started && sleep 3 && echo edit-done"
  - id: pr
    uses: builtin:open_pr
    needs: [edit]
  - id: merge
    uses: builtin:merge
    needs: [pr]
"""


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
async def test_kill_9_while_running_and_while_waiting_then_finishes_once(short_tmp, backend, request):
    cfg = write_config(short_tmp, WORKFLOW)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    bare = cfg / "repos" / "calc.git"
    base_before = git(bare, "rev-parse", "main").strip()
    url = request.getfixturevalue("pg_url") if backend == "postgresql" else ""
    async with afe_system(cfg, layout, subprocess=True, database_url=url) as sys_:
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="slow-fix", title="notes",
                                                                principal="tester"))
        await wait_for_event(sys_.stub, t.id, lambda e: e.type == "node.output"
                             and "edit-started" in payload(e)["text"])
        await sys_.kill_scheduler()                       # the `edit` node is running
        await sys_.start_scheduler()

        t = await wait_for_state(sys_.stub, t.id, {"waiting_approval", "failed"})
        assert state_name(t) == "waiting_approval", t.error
        edit = next(n for n in t.nodes if n.id == "edit")
        assert edit.attempt == 2 and "edit-done" in edit.output    # re-run after the kill
        sha = t.awaiting_sha

        await sys_.kill_scheduler()                       # waiting for a person
        await sys_.start_scheduler()
        t = await wait_for_state(sys_.stub, t.id, {"waiting_approval"})
        assert t.awaiting_sha == sha

        await sys_.stub.ApproveTicket(pb.ApproveTicketRequest(id=t.id, principal="alice", sha=sha))
        t = await wait_for_state(sys_.stub, t.id, {"succeeded", "failed"})
        assert state_name(t) == "succeeded", t.error

        records = forge_records(layout.data_dir, t.id)
        assert len(records) == 1 and records[0]["state"] == "merged"      # exactly one PR
        merges = git(bare, "rev-list", "--merges", f"{base_before}..main").split()
        assert merges == [t.pr.merge_sha]                                  # exactly one merge

        events = await all_events(sys_.stub, t.id)
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        types = [e.type for e in events]
        assert types.count("ticket.resumed") == 2
        assert any(e.type == "node.resumed" and payload(e)["node"] == "edit" for e in events)
        assert types.count("merge.done") == 1 and types[-1] == "ticket.finished"
    assert layout.store_file.exists() == (backend == "sqlite")   # the store was where the URL said


async def test_restart_after_merge_does_not_merge_again(short_tmp):
    """A crash after the merge was recorded: the ticket is terminal and stays merged once."""
    cfg = write_config(short_tmp, WORKFLOW.replace("sleep 3 && ", ""))
    layout = Layout(short_tmp / "data", short_tmp / "run")
    bare = cfg / "repos" / "calc.git"
    base_before = git(bare, "rev-parse", "main").strip()
    async with afe_system(cfg, layout, subprocess=True) as sys_:
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="slow-fix", title="notes"))
        t = await wait_for_state(sys_.stub, t.id, {"waiting_approval", "failed"})
        await sys_.stub.ApproveTicket(pb.ApproveTicketRequest(id=t.id, principal="alice"))
        await wait_for_event(sys_.stub, t.id, lambda e: e.type == "merge.done")
        await sys_.kill_scheduler()
        await sys_.start_scheduler()
        t = await wait_for_state(sys_.stub, t.id, {"succeeded", "failed"})
        assert state_name(t) == "succeeded", t.error
        assert git(bare, "rev-list", "--merges", f"{base_before}..main").split() == [t.pr.merge_sha]
        assert len(forge_records(layout.data_dir, t.id)) == 1


async def test_graceful_stop_is_not_a_cancel_and_the_ticket_resumes(short_tmp):
    cfg = write_config(short_tmp, WORKFLOW)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout) as sys_:
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="slow-fix", title="notes"))
        await wait_for_event(sys_.stub, t.id, lambda e: e.type == "node.output"
                             and "edit-started" in payload(e)["text"])
        await sys_.stop_scheduler()                      # SIGTERM-style stop of the in-process scheduler
        await sys_.start_scheduler()
        t = await wait_for_state(sys_.stub, t.id, {"waiting_approval", "failed", "cancelled"})
        assert state_name(t) == "waiting_approval", t.error
        assert next(n for n in t.nodes if n.id == "edit").attempt == 2
        events = await all_events(sys_.stub, t.id)
        assert not any(e.type == "node.finished" and payload(e).get("state") == "cancelled" for e in events)
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        await sys_.stub.CancelTicket(pb.CancelTicketRequest(id=t.id, principal="tester"))
