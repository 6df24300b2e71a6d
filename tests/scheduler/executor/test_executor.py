"""The executor without Docker: graph order and fan-out, the failure rules,
retries, timeouts, cancel mid-node, resume after a restart, approvals and
broker retries, through the real Engine with fake brokers (fakes.py)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.config.model import Node
from services.common.errors import FailedPrecondition
from services.scheduler.executor.graph import ancestors, run_graph
from services.scheduler.store.base import (
    CANCELLED,
    FAILED,
    N_CANCELLED,
    N_FAILED,
    N_PENDING,
    N_SKIPPED,
    N_SUCCEEDED,
    N_WAITING,
    SUCCEEDED,
    WAITING_APPROVAL,
)

pytestmark = pytest.mark.timeout(10)

WORKFLOWS = """\
kind: Workflow
name: diamond
workspace: ws
nodes:
  - {id: left, run: "open left; wait right; echo L"}
  - {id: right, run: "open right; wait left; echo R"}
  - {id: join, run: "echo joined", needs: [left, right]}
---
kind: Workflow
name: broken
workspace: ws
nodes:
  - {id: bad, run: "wait independent-started; echo oops; exit 7"}
  - {id: dependent, run: "echo never", needs: [bad]}
  - {id: independent, run: "open independent-started; hang"}
  - {id: after, run: "echo never", needs: [independent]}
---
kind: Workflow
name: flaky
workspace: ws
nodes:
  - {id: flaky, run: "once flaky; echo second", retries: 1}
---
kind: Workflow
name: hopeless
workspace: ws
nodes:
  - {id: hopeless, run: "echo no; exit 4", retries: 2}
---
kind: Workflow
name: slow
workspace: ws
nodes:
  - {id: slow, run: "hang", timeout: 0.2}
  - {id: after, run: "echo never", needs: [slow]}
---
kind: Workflow
name: long
workspace: ws
nodes:
  - {id: first, run: "echo one"}
  - {id: second, run: "open second-started; wait release; echo two", needs: [first]}
---
kind: Workflow
name: review
workspace: ws
nodes:
  - {id: pr, uses: builtin:open_pr}
  - {id: merge, uses: builtin:merge, needs: [pr]}
"""


def _started(h, ticket_id: str) -> list[str]:
    return [p["node"] for _, p in h.events(ticket_id, "node.started")]


async def test_needs_order_the_nodes_and_independent_branches_run_at_once(harness):
    h = harness(WORKFLOWS)
    await h.start()
    tid = h.create("diamond")
    t = await h.until(tid)
    # Each branch waits for the other to have started: both succeed only when run at the same time.
    assert t.state == SUCCEEDED, t.error
    assert [c for _, c in h.sandbox.started][-1] == "echo joined"
    nodes = h.nodes(tid)
    assert {n.state for n in nodes.values()} == {N_SUCCEEDED}
    assert nodes["join"].started_at_ms >= max(nodes["left"].finished_at_ms, nodes["right"].finished_at_ms)
    assert nodes["left"].output == "L\n" and nodes["join"].output == "joined\n"
    assert h.sandbox.created == [tid] and h.sandbox.destroyed == [tid]   # one sandbox, torn down at the end
    assert h.events(tid)[-1] == ("ticket.finished", {"state": SUCCEEDED, "error": ""})


async def test_a_failing_node_cancels_running_siblings_and_skips_what_did_not_start(harness):
    h = harness(WORKFLOWS)
    await h.start()
    tid = h.create("broken")
    t = await h.until(tid)
    nodes = h.nodes(tid)
    assert t.state == FAILED and t.error.startswith("node bad failed: the command exited with code 7")
    assert nodes["bad"].state == N_FAILED and "oops" in nodes["bad"].error
    assert nodes["independent"].state == N_CANCELLED                     # stopped when bad failed
    assert (tid, "open independent-started; hang", "cancelled") in h.sandbox.ended
    assert nodes["dependent"].state == N_SKIPPED and nodes["dependent"].error == "node bad failed"
    assert nodes["after"].state == N_SKIPPED and nodes["after"].error == "node bad failed"
    assert "echo never" not in [c for _, c in h.sandbox.started]
    finished = {p["node"]: p["state"] for _, p in h.events(tid, "node.finished")}
    assert finished == {"bad": N_FAILED, "independent": N_CANCELLED}


async def test_a_failed_attempt_is_retried_and_spent_retries_fail_the_node(harness):
    h = harness(WORKFLOWS)
    await h.start()
    flaky, hopeless = h.create("flaky"), h.create("hopeless")
    assert (await h.until(flaky)).state == SUCCEEDED
    node = h.nodes(flaky)["flaky"]
    assert node.attempt == 2 and node.output == "second\n"
    retries = h.events(flaky, "node.retry")
    assert len(retries) == 1 and "code 3" in retries[0][1]["error"]

    t = await h.until(hopeless)
    assert t.state == FAILED and "code 4" in t.error
    assert h.nodes(hopeless)["hopeless"].attempt == 3
    assert _started(h, hopeless) == ["hopeless"] * 3 and len(h.events(hopeless, "node.retry")) == 2


async def test_a_node_over_its_timeout_fails_and_its_dependents_are_skipped(harness):
    h = harness(WORKFLOWS)
    await h.start()
    tid = h.create("slow")
    t = await h.until(tid)
    nodes = h.nodes(tid)
    assert t.state == FAILED
    assert nodes["slow"].state == N_FAILED and "timed out after 0.2s" in nodes["slow"].error
    assert (tid, "hang", "cancelled") in h.sandbox.ended                  # the command was stopped
    assert nodes["after"].state == N_SKIPPED


async def test_cancel_mid_node_stops_the_command_and_tears_down(harness):
    h = harness(WORKFLOWS)
    engine = await h.start()
    tid = h.create("long")
    await h.gate("second-started")
    view = await engine.cancel(tid, "alice")
    assert view.ticket.state == CANCELLED and view.ticket.error == "cancelled by alice"
    nodes = h.nodes(tid)
    assert nodes["first"].state == N_SUCCEEDED and nodes["second"].state == N_CANCELLED
    assert (tid, "open second-started; wait release; echo two", "cancelled") in h.sandbox.ended
    assert h.sandbox.destroyed == [tid] and view.ticket.torn_down
    assert h.events(tid)[-1] == ("ticket.finished", {"state": CANCELLED, "error": "cancelled by alice"})


async def test_a_restart_resumes_the_running_node_and_keeps_what_succeeded(harness):
    h = harness(WORKFLOWS)
    await h.start()
    tid = h.create("long")
    await h.gate("second-started")
    await h.stop()                                  # the store keeps the node running
    h.sandbox.open("release")
    await h.start()                                 # a new engine on the reopened store
    t = await h.until(tid)
    assert t.state == SUCCEEDED, t.error
    commands = [c for _, c in h.sandbox.started]
    assert commands.count("echo one") == 1                     # a succeeded node does not run again
    assert commands.count("open second-started; wait release; echo two") == 2
    nodes = h.nodes(tid)
    assert nodes["first"].output == "one\n" and nodes["second"].output == "two\n"
    assert nodes["second"].attempt == 2
    assert ("node.resumed", {"node": "second", "was": "running", "attempt": 1}) in h.events(tid)
    # the re-run is attempt 2 and says why and which scheduler ran attempt 1 (the engine before the restart)
    [(_, again)] = h.events(tid, "node.attempt")
    assert again["node"] == "second" and again["attempt"] == 2 and again["previous"] == 1
    assert again["reason"] == "restart" and again["previous_scheduler"]
    assert [p["attempt"] for _, p in h.events(tid, "node.output") if p["node"] == "second"] == [2]
    assert len(h.events(tid, "ticket.resumed")) == 1 and len(h.events(tid, "ticket.finished")) == 1


async def test_merge_waits_for_an_approval_of_the_head_and_merges_that_sha(harness):
    h = harness(WORKFLOWS)
    engine = await h.start()
    tid = h.create("review")
    t = await h.until(tid, (WAITING_APPROVAL,))
    assert t.awaiting_sha == "c" * 40 and engine.running_count() == 0   # a waiting ticket holds no capacity
    assert h.nodes(tid)["merge"].state == N_WAITING
    await engine.approve(tid, "bob", t.awaiting_sha)
    t = await h.until(tid)
    assert t.state == SUCCEEDED, t.error
    assert h.credentials.merged == [(tid, "c" * 40)]
    states = [p["state"] for _, p in h.events(tid, "ticket.state")]
    assert states == ["running", "waiting_approval", "running"]


async def test_a_waiting_ticket_resumes_waiting_after_a_restart_and_a_rejection_ends_it(harness):
    h = harness(WORKFLOWS)
    engine = await h.start()
    tid = h.create("review")
    await h.until(tid, (WAITING_APPROVAL,))
    engine = await h.restart()
    await h.until(tid, (WAITING_APPROVAL,))
    await asyncio.sleep(0)
    await engine.reject(tid, "bob", "not like this")
    t = await h.until(tid)
    assert t.state == FAILED and "rejected by bob: not like this" in t.error
    assert h.credentials.merged == [] and h.credentials.calls.count("open_pr") == 1
    assert len(h.events(tid, "approval.requested")) == 1      # asked once, not again after the restart


@pytest.mark.slow
async def test_a_builtin_step_waits_for_the_credential_broker_to_come_back(harness):
    h = harness(WORKFLOWS)
    await h.start()
    h.credentials.away = 2          # prepare fails twice, then the broker answers again
    tid = h.create("review")
    await h.until(tid, (WAITING_APPROVAL,))
    assert h.credentials.calls[:3] == ["prepare"] * 3
    h.credentials.away = 1          # the commit step meets a broker that went away
    # (nothing is pending now; the next step, signing the decision's run record (R42), retries once approved)
    await h.engine.approve(tid, "bob", "")
    t = await h.until(tid)
    assert t.state == SUCCEEDED, t.error
    retry = h.events(tid, "broker.retry")
    assert len(retry) == 1 and retry[0][1]["step"] == "sign"
    assert len(h.events(tid, "broker.recovered")) == 1


# ---- the graph alone ---------------------------------------------------------------

def _node(nid: str, *needs: str) -> Node:
    return Node(id=nid, kind="run", needs=tuple(needs), run="true")


async def test_a_cycle_is_refused_before_any_node_runs():
    nodes = [_node("a", "c"), _node("b", "a"), _node("c", "b"), _node("d")]
    ran: list[str] = []

    async def run(node: Node) -> None:
        ran.append(node.id)

    with pytest.raises(FailedPrecondition, match=r"dependency cycle \((a|b|c)( -> (a|b|c)){3}\)"):
        await run_graph(nodes, dict.fromkeys("abcd", N_PENDING), run, lambda *_: None)
    assert ran == []
    with pytest.raises(FailedPrecondition, match="needs 'zz', which is not a node"):
        await run_graph([_node("a", "zz")], {"a": N_PENDING}, run, lambda *_: None)


async def test_fan_out_and_fan_in_follow_needs():
    nodes = [_node("root"), _node("x", "root"), _node("y", "root"), _node("z", "root"), _node("sink", "x", "y", "z")]
    running: set[str] = set()
    seen_together: set[frozenset[str]] = set()
    order: list[str] = []
    barrier = asyncio.Barrier(3)

    async def run(node: Node) -> None:
        order.append(node.id)
        running.add(node.id)
        if node.id in "xyz":
            await barrier.wait()               # all three branches are running at once
            seen_together.add(frozenset(running))
        running.discard(node.id)

    states = dict.fromkeys((n.id for n in nodes), N_PENDING)
    assert await run_graph(nodes, states, run, lambda *_: None) is None
    assert order[0] == "root" and order[-1] == "sink" and sorted(order[1:4]) == ["x", "y", "z"]
    assert frozenset({"x", "y", "z"}) in seen_together
    assert set(states.values()) == {N_SUCCEEDED}
    assert ancestors(nodes)["sink"] == {"root", "x", "y", "z"}
