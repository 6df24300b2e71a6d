"""Several schedulers on one PostgreSQL database (docs/SCALE.md): ticket
leases, takeover, and the fence that stops a scheduler whose ticket was taken
over from writing or performing a side effect (R37)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import sqlalchemy as sa

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.layout import Layout
from services.scheduler.store import schema
from services.scheduler.store.base import (
    N_PENDING,
    N_RUNNING,
    QUEUED,
    RUNNING,
    EventRecord,
    LeaseLost,
    NodeRunRecord,
    TicketRecord,
)
from tests.scheduler.conftest import (
    all_events,
    forge_records,
    git,
    payload,
    second_scheduler,
    state_name,
    wait_for_event,
    wait_for_state,
    write_config,
)
from tests.support.postgres import open_store_url
from tests.support.system import afe_system

LONG = 600_000   # ms: a lease that does not run out during a test


def _ticket(tid: str) -> tuple[TicketRecord, list[NodeRunRecord], list[EventRecord]]:
    t = TicketRecord(id=tid, workspace="ws", workflow="wf", title="t", body="", inputs={}, state=QUEUED,
                     created_at_ms=1, updated_at_ms=1)
    return t, [NodeRunRecord(tid, "edit", "run")], [EventRecord(tid, 1, "ticket.created", "{}", 1)]


def _expire(store, tid: str) -> None:
    """What a scheduler that stopped renewing leaves behind: a lease in the past."""
    with store.db.transaction(write=True) as conn:
        conn.execute(sa.update(schema.tickets).where(schema.tickets.c.id == tid).values(lease_until_ms=0))


def test_claims_are_exclusive_and_a_takeover_refuses_the_old_owners_writes(pg_url, tmp_path):
    a, b = open_store_url(pg_url, tmp_path), open_store_url(pg_url, tmp_path)
    a.owner, b.owner = "sched-a", "sched-b"
    try:
        a.tickets.create(*_ticket("T1"))
        assert a.leases.claim("T1", (QUEUED,), LONG) == 1
        assert b.leases.claim("T1", (QUEUED,), LONG) is None          # held: nobody else gets it
        assert b.leases.expired((QUEUED, RUNNING)) == []
        a.tickets.update("T1", state=RUNNING)
        a.tickets.update_node("T1", "edit", state=N_RUNNING)                    # the owner writes
        a.events.append([EventRecord("T1", 2, "node.started", "{}", 2)])
        assert [x.ticket_id for x in a.leases.renew(["T1"], LONG)] == ["T1"]

        _expire(a, "T1")                                                # a stops renewing (killed, paused)
        assert b.leases.expired((RUNNING,)) == ["T1"]
        assert b.leases.claim("T1", (RUNNING,), LONG) == 2              # taken over: a new fence
        assert not a.leases.holds("T1", 1) and b.leases.holds("T1", 2)
        assert a.leases.renew(["T1"], LONG) == []                       # a's heartbeat finds it gone

        with pytest.raises(LeaseLost):
            a.tickets.update_node("T1", "edit", state=N_PENDING)
        with pytest.raises(LeaseLost):
            a.events.append([EventRecord("T1", 3, "node.finished", "{}", 3)])
        with pytest.raises(LeaseLost):
            a.tickets.update("T1", state="succeeded")
        assert a.tickets.node_runs("T1")[0].state == N_RUNNING and a.events.last_seq("T1") == 2   # nothing of a's was written
        b.tickets.update_node("T1", "edit", state=N_PENDING)                    # the new owner writes
        b.events.append([EventRecord("T1", 3, "ticket.takeover", "{}", 3)])

        # Positive control: the refusal is the fence check; a write not checked against it lands.
        a.leases.forget("T1")                                           # the fence entry dropped
        a.tickets.update_node("T1", "edit", state="succeeded")
        assert a.tickets.node_runs("T1")[0].state == "succeeded"

        b.leases.release("T1")
        assert a.leases.claim("T1", (RUNNING,), LONG) == 3              # released: free at once
    finally:
        a.close()
        b.close()


WORKFLOW = """\
kind: Workflow
name: fix
workspace: ws
nodes:
  - id: pr
    uses: builtin:open_pr
"""


@pytest.mark.parametrize("fencing", ["scheduler", "resource", ""],
                         ids=["fenced", "fenced-at-the-broker", "unfenced-positive-control"])
async def test_r37_a_scheduler_whose_ticket_was_taken_over_cannot_push_or_open_a_pr(short_tmp, pg_url, fencing):
    """The scheduler commits, then (paused, its heartbeat missed) its ticket is taken
    over by another scheduler, which commits with its new fence, before it pushes:
    the push and the pull request never happen. `fenced-at-the-broker`: the
    scheduler's own lease check passes (it was paused right after it), and the
    credential broker refuses the push's older fence. Without the fence
    (positive control) both happen."""
    cfg = write_config(short_tmp, WORKFLOW)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    bare = cfg / "repos" / "calc.git"
    other = open_store_url(pg_url, short_tmp)
    other.owner = "sched-b"
    async with afe_system(cfg, layout, database_url=pg_url) as sys_:
        engine = sys_.app.engine
        engine.fencing = bool(fencing)
        if fencing == "resource":
            engine.leases.check = lambda ticket_id: None    # the window between the check and the call
        real_commit = engine.credentials.commit
        taken: list[int] = []

        async def commit_then_taken_over(*args, **kwargs):
            r = await real_commit(*args, **kwargs)
            tid = args[0]
            _expire(other, tid)
            taken.append(other.leases.claim(tid, (RUNNING,), LONG) or 0)
            await real_commit(tid, args[1], "the new owner's commit", taken[-1])   # the new owner acts
            return r

        engine.credentials.commit = commit_then_taken_over
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="fix", title="notes", principal="tester"))
        for _ in range(600):                 # until this scheduler's run of the ticket has stopped
            if taken and not engine.running_here(t.id):
                break
            await asyncio.sleep(0.05)
        # Either way the ticket stays with the scheduler that took it over: running, not ended here
        # (with the fence check off the store still refuses the stale writes, only the side effects land).
        t2 = await sys_.stub.GetTicket(pb.GetTicketRequest(id=t.id))
        assert state_name(t2) == "running" and engine.lease_lost(t.id)
        assert taken and taken[0] >= 2
        branches = git(bare, "branch", "--list", f"afe/{t.id}").split()
        records = forge_records(layout.data_dir, t.id)
        if fencing:
            assert branches == [] and records == []          # no push, no pull request
            events = [e.type for e in await all_events(sys_.stub, t.id)]
            assert "push.done" not in events and "pr.opened" not in events
        else:
            assert branches == [f"afe/{t.id}"] and len(records) == 1   # the stale scheduler pushed and opened it
    other.close()


SLOW = """\
kind: Workflow
name: slow-fix
workspace: ws
nodes:
  - id: edit
    # The first run lasts long enough for the test to kill or pause its scheduler mid-node on a busy
    # machine (parallel test workers); the re-run after the takeover finds the marker the first left
    # in the sandbox (kept through the takeover) and is quick.
    run: "if [ -e /tmp/edit-ran ]; then d=1; else d=30; fi; touch /tmp/edit-ran;
      echo fixed >> NOTES.md && echo edit-started && sleep $d && echo edit-done"
  - id: pr
    uses: builtin:open_pr
    needs: [edit]
  - id: merge
    uses: builtin:merge
    needs: [pr]
"""
LEASE_S = 3


@pytest.mark.docker
@pytest.mark.timeout(300)
async def test_two_schedulers_one_killed_mid_node_the_other_finishes_with_one_pr(short_tmp, pg_url):
    cfg = write_config(short_tmp, SLOW)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    bare = cfg / "repos" / "calc.git"
    base_before = git(bare, "rev-parse", "main").strip()
    async with afe_system(cfg, layout, subprocess=True, database_url=pg_url,
                          scheduler_args=["--lease-seconds", str(LEASE_S)]) as a:
        t = await a.stub.CreateTicket(pb.CreateTicketRequest(workflow="slow-fix", title="notes", principal="tester"))
        b = await second_scheduler(a, short_tmp)     # started after: the first one claimed the ticket
        try:
            # A watcher on the other scheduler sees the events the first one writes, live.
            await wait_for_event(b.stub, t.id, lambda e: e.type == "node.output"
                                 and "edit-started" in payload(e)["text"])
            killed_ms = time.time_ns() // 1_000_000
            await a.kill_scheduler()                  # SIGKILL while `edit` runs

            t = await wait_for_state(b.stub, t.id, {"waiting_approval", "failed"})
            assert state_name(t) == "waiting_approval", t.error
            await b.stub.ApproveTicket(pb.ApproveTicketRequest(id=t.id, principal="alice", sha=t.awaiting_sha))
            t = await wait_for_state(b.stub, t.id, {"succeeded", "failed"})
            assert state_name(t) == "succeeded", t.error

            assert len(forge_records(layout.data_dir, t.id)) == 1                     # exactly one PR
            assert git(bare, "rev-list", "--merges", f"{base_before}..main").split() == [t.pr.merge_sha]
            events = await all_events(b.stub, t.id)
            assert [e.seq for e in events] == list(range(1, len(events) + 1))        # gap-free, one sequence
            takeover = [e for e in events if e.type == "ticket.takeover"]
            assert len(takeover) == 1 and payload(takeover[0])["state"] == "running"
            edit = next(n for n in t.nodes if n.id == "edit")
            assert edit.attempt == 2 and "edit-done" in edit.output                  # re-run by the other one
            took_s = (takeover[0].at_ms - killed_ms) / 1000
            print(f"takeover after kill -9: {took_s:.2f} s (lease {LEASE_S} s)")
            assert took_s <= 15                                                        # the bound
        finally:
            await b.stop_scheduler()


@pytest.mark.docker
@pytest.mark.timeout(300)
async def test_r37_a_scheduler_paused_past_its_lease_writes_and_pushes_nothing_when_it_wakes(short_tmp, pg_url):
    """SIGSTOP the scheduler that drives the ticket while a node runs; the other
    takes the ticket over and opens the PR; SIGCONT: the woken scheduler's run
    finds its fence gone and stops without a write, a push or a merge."""
    cfg = write_config(short_tmp, SLOW)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    bare = cfg / "repos" / "calc.git"
    base_before = git(bare, "rev-parse", "main").strip()
    async with afe_system(cfg, layout, subprocess=True, database_url=pg_url,
                          scheduler_args=["--lease-seconds", str(LEASE_S)]) as a:
        t = await a.stub.CreateTicket(pb.CreateTicketRequest(workflow="slow-fix", title="notes", principal="tester"))
        b = await second_scheduler(a, short_tmp)
        try:
            await wait_for_event(b.stub, t.id, lambda e: e.type == "node.output"
                                 and "edit-started" in payload(e)["text"])
            os.kill(a.proc.pid, signal.SIGSTOP)          # paused mid-node: it misses its heartbeats
            try:
                t = await wait_for_state(b.stub, t.id, {"waiting_approval", "failed"})
                assert state_name(t) == "waiting_approval", t.error
            finally:
                os.kill(a.proc.pid, signal.SIGCONT)
            stopped = "stopped here:"
            for _ in range(600):                          # the woken one finds out at its next write or check
                if stopped in a.log_path.read_text():
                    break
                await asyncio.sleep(0.05)
            assert stopped in a.log_path.read_text() and a.proc.poll() is None
            await b.stub.ApproveTicket(pb.ApproveTicketRequest(id=t.id, principal="alice", sha=t.awaiting_sha))
            t = await wait_for_state(b.stub, t.id, {"succeeded", "failed"})
            assert state_name(t) == "succeeded", t.error

            assert len(forge_records(layout.data_dir, t.id)) == 1
            assert git(bare, "rev-list", "--merges", f"{base_before}..main").split() == [t.pr.merge_sha]
            events = await all_events(b.stub, t.id)
            assert [e.seq for e in events] == list(range(1, len(events) + 1))
            types = [e.type for e in events]
            assert types.count("push.done") == 1 and types.count("pr.opened") == 1 and types.count("merge.done") == 1
            # Nothing of the paused scheduler's run after the takeover: `edit` finished once, by the new owner.
            finished = [payload(e)["node"] for e in events if e.type == "node.finished"]
            assert finished.count("edit") == 1
        finally:
            await b.stop_scheduler()
