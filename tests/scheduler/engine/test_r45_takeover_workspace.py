"""A takeover repeats nothing, with the real brokers (R45, docs/SCALE.md "A
takeover is a new attempt"): two scheduler processes on one PostgreSQL
database and one pair of brokers; the one driving the ticket is killed
(`kill -9`) after its node appended a line to NOTES.md and while the node
still runs. The other takes the ticket over; its attempt 2 starts from the
workspace of the last completed node (RestoreWorkspace: here the branch
head, as no node completed), not from attempt 1's files, so the merged
NOTES.md holds the line once, in one commit of one pull request.

Positive control (tests/credentials/workspaces/test_workspace_checkpoint.py): without
the restore the re-run commits the interrupted attempt's line as well.
"""

from __future__ import annotations

import time

import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.layout import Layout
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
from tests.support.system import afe_system

WORKFLOW = """\
kind: Workflow
name: notes
workspace: ws
nodes:
  - id: edit
    run: "echo taken-over-once >> NOTES.md && echo edit-started && sleep 10 && echo edit-done"
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
async def test_r45_a_takeover_reruns_the_node_from_the_last_completed_nodes_workspace(short_tmp, pg_url):
    cfg = write_config(short_tmp, WORKFLOW)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    bare = cfg / "repos" / "calc.git"
    base = git(bare, "rev-parse", "main").strip()
    async with afe_system(cfg, layout, subprocess=True, database_url=pg_url,
                          scheduler_args=["--lease-seconds", str(LEASE_S)]) as a:
        t = await a.stub.CreateTicket(pb.CreateTicketRequest(workflow="notes", title="notes", principal="tester"))
        b = await second_scheduler(a, short_tmp)
        try:
            await wait_for_event(b.stub, t.id, lambda e: e.type == "node.output"
                                 and "edit-started" in payload(e)["text"])
            killed = time.monotonic()
            await a.kill_scheduler()                      # attempt 1 appended its line, then died mid-node
            t = await wait_for_state(b.stub, t.id, {"waiting_approval", "failed"})
            assert state_name(t) == "waiting_approval", t.error
            await b.stub.ApproveTicket(pb.ApproveTicketRequest(id=t.id, principal="alice", sha=t.awaiting_sha))
            t = await wait_for_state(b.stub, t.id, {"succeeded", "failed"})
            assert state_name(t) == "succeeded", t.error
            print(f"takeover to the end: {time.monotonic() - killed:.1f} s")

            events = await all_events(b.stub, t.id)
            again = [payload(e) for e in events if e.type == "node.attempt"]
            assert [(p["node"], p["attempt"], p["reason"]) for p in again] == [("edit", 2, "takeover")]
            restored = [payload(e) for e in events if e.type == "workspace.restored"]
            assert restored == [{"after": "", "attempt": 2, "restored": True, "sha": base}], restored
            assert [payload(e)["after"] for e in events if e.type == "workspace.checkpoint"] == ["edit"]

            notes = git(bare, "show", "main:NOTES.md")
            assert notes.count("taken-over-once") == 1, notes        # attempt 1's line did not survive
            assert len(forge_records(layout.data_dir, t.id)) == 1
            commits = git(bare, "rev-list", "--no-merges", f"{base}..main").split()
            assert len(commits) == 1                                  # one commit, made by attempt 2's PR node
        finally:
            await b.stop_scheduler()
