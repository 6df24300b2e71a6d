"""Capacity: a global limit and a per-workspace limit on running tickets;
excess tickets stay `queued` and start in creation order."""

from __future__ import annotations

import asyncio

import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.layout import Layout
from tests.scheduler.conftest import all_events, payload, state_name, wait_for_state, write_config
from tests.support.system import afe_system

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

CONFIG = """\
kind: Workspace
name: narrow
repo: repos/calc.git
maxRunning: 1
---
kind: Workflow
name: nap
nodes:
  - {id: nap, run: "sleep 1"}
"""


async def _max_running(stub, ids: list[str], workspace: str) -> int:
    """Poll the API until every ticket is terminal; the highest RUNNING count seen."""
    seen = 0
    while True:
        r = await stub.ListTickets(pb.ListTicketsRequest(states=[pb.TICKET_STATE_RUNNING], workspace=workspace))
        seen = max(seen, len(r.tickets))
        states = [state_name(await stub.GetTicket(pb.GetTicketRequest(id=i))) for i in ids]
        if all(s in ("succeeded", "failed", "cancelled") for s in states):
            return seen
        await asyncio.sleep(0.05)


async def _intervals(stub, ids: list[str]) -> list[tuple[int, int, int]]:
    """(seq-independent) start/end times of each ticket's running phase, from its events."""
    out = []
    for i, tid in enumerate(ids):
        events = await all_events(stub, tid)
        start = next(e.at_ms for e in events if e.type == "ticket.state" and payload(e)["state"] == "running")
        end = next(e.at_ms for e in events if e.type == "ticket.finished")
        out.append((start, end, i))
    return out


def _peak(intervals: list[tuple[int, int, int]]) -> int:
    points = sorted([(s, 1) for s, _, _ in intervals] + [(e, -1) for _, e, _ in intervals],
                    key=lambda p: (p[0], p[1]))
    level = peak = 0
    for _, d in points:
        level += d
        peak = max(peak, level)
    return peak


async def test_global_limit_of_two_never_runs_more_than_two_and_starts_in_order(short_tmp):
    cfg = write_config(short_tmp, CONFIG)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout, max_running=2) as sys_:
        ids = []
        for i in range(5):
            t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="nap", workspace="ws", title=f"n{i}"))
            ids.append(t.id)
        queued = await sys_.stub.ListTickets(pb.ListTicketsRequest(states=[pb.TICKET_STATE_QUEUED]))
        assert len(queued.tickets) == 3                     # excess waits
        peak = await _max_running(sys_.stub, ids, "")
        assert 1 <= peak <= 2
        for tid in ids:
            assert state_name(await wait_for_state(sys_.stub, tid, {"succeeded", "failed"})) == "succeeded"
        iv = await _intervals(sys_.stub, ids)
        assert _peak(iv) <= 2
        starts = [s for s, _, _ in iv]
        assert starts == sorted(starts)                     # started in creation order


async def test_workspace_limit_of_one_serialises_its_tickets(short_tmp):
    cfg = write_config(short_tmp, CONFIG)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout, max_running=4) as sys_:
        narrow = [(await sys_.stub.CreateTicket(pb.CreateTicketRequest(
            workflow="nap", workspace="narrow", title=f"n{i}"))).id for i in range(3)]
        wide = (await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="nap", workspace="ws",
                                                                     title="w"))).id
        # The other workspace is not held back by the narrow one's queue.
        assert state_name(await sys_.stub.GetTicket(pb.GetTicketRequest(id=wide))) == "running"
        assert await _max_running(sys_.stub, narrow, "narrow") == 1
        iv = await _intervals(sys_.stub, narrow)
        assert _peak(iv) == 1
        assert [s for s, _, _ in iv] == sorted(s for s, _, _ in iv)
