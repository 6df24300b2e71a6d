"""The issue's own trial, as an operator runs it: two scheduler processes on a
real PostgreSQL, a node printing 100 lines 80 ms apart in its sandbox, live
watchers on both schedulers, and the database restarted (`pg_ctl restart -m
fast`, `-m immediate`, or kill -9 of its postmaster and a start) after
line 20 was seen. Every line reaches the event stream exactly once, in
order, with gap-free seqs, matching the node's stored output, and the
ticket ends with one pull request.

Positive control: the scheduler's log shows its writes did meet the restart
(the statement that failed and was tried again); the same failure under
today's event log loses lines behind whole-looking seqs
(test_event_log_outages.py::test_positive_control_todays_drop_and_renumber_loses_lines_and_hides_the_gap).
"""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.layout import Layout
from tests.scheduler.conftest import (
    all_events,
    forge_records,
    payload,
    second_scheduler,
    state_name,
    wait_for_event,
    wait_for_state,
    write_config,
)
from tests.support import postgres
from tests.support.system import afe_system

LINES = 100
STREAM = f"""\
kind: Workflow
name: stream
workspace: ws
nodes:
  - id: edit
    run: "echo streamed >> NOTES.md && for i in $(seq 1 {LINES}); do echo line-$i; sleep 0.08; done"
  - id: pr
    uses: builtin:open_pr
    needs: [edit]
  - id: merge
    uses: builtin:merge
    needs: [pr]
"""
RETRIED = re.compile(r"store: (admin shutdown|connection lost|starting up) on ")


def _lines(events) -> list[str]:
    text = "".join(payload(e)["text"] for e in events if e.type == "node.output" and payload(e).get("node") == "edit")
    return [line for line in text.splitlines() if line.startswith("line-")]


async def _follow(stub, ticket_id: str, into: list) -> None:
    """Every event, live. A watch that starts while the database is down is refused
    UNAVAILABLE (starting one reads the store): the client asks again from the seq after
    its last, as afe's clients do. An open watch (one that has sent an event) must never
    end UNAVAILABLE: that fails here."""
    while True:
        got = 0
        try:
            async for ev in stub.WatchTicket(pb.WatchTicketRequest(
                    id=ticket_id, from_seq=into[-1].seq + 1 if into else 1, follow=True)):
                into.append(ev)
                got += 1
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or got:
                raise
            await asyncio.sleep(0.5)


@pytest.mark.docker
@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["fast", "immediate", "kill9"])
async def test_two_schedulers_lose_no_output_line_through_a_database_restart(short_tmp, durable_pg, mode):
    url = durable_pg.app_url(durable_pg.fresh_database())
    cfg = write_config(short_tmp, STREAM)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout, subprocess=True, database_url=url) as a:
        t = await a.stub.CreateTicket(pb.CreateTicketRequest(workflow="stream", title="lines", principal="tester"))
        b = await second_scheduler(a, short_tmp)
        seen_a: list = []
        seen_b: list = []
        watchers = [asyncio.create_task(_follow(a.stub, t.id, seen_a)),
                    asyncio.create_task(_follow(b.stub, t.id, seen_b))]
        try:
            await wait_for_event(b.stub, t.id, lambda e: e.type == "node.output" and "line-20" in payload(e)["text"])
            await asyncio.to_thread(postgres.restart_server, durable_pg, mode)

            t = await wait_for_state(b.stub, t.id, {"waiting_approval", "failed"})
            assert state_name(t) == "waiting_approval", t.error
            await b.stub.ApproveTicket(pb.ApproveTicketRequest(id=t.id, principal="alice", sha=t.awaiting_sha))
            t = await wait_for_state(b.stub, t.id, {"succeeded", "failed"})
            assert state_name(t) == "succeeded", t.error
            await asyncio.wait_for(asyncio.gather(*watchers), 60)   # both streams end with ticket.finished

            events = await all_events(b.stub, t.id)
            assert [e.seq for e in events] == list(range(1, len(events) + 1))          # gap-free
            assert _lines(events) == [f"line-{i}" for i in range(1, LINES + 1)]        # once each, in order
            assert "events.lost" not in {e.type for e in events}
            edit = next(n for n in t.nodes if n.id == "edit")
            assert [x for x in edit.output.splitlines() if x.startswith("line-")] == _lines(events)
            for seen in (seen_a, seen_b):                                              # the live watchers too
                assert [(e.seq, e.type, e.payload_json) for e in seen] == \
                    [(e.seq, e.type, e.payload_json) for e in events]
            assert len(forge_records(layout.data_dir, t.id)) == 1                      # one pull request
            logs = a.log_path.read_text() + b.log_path.read_text()
            assert RETRIED.search(logs), "the restart met no write of either scheduler"
        finally:
            for w in watchers:
                w.cancel()
            await b.stop_scheduler()
