"""`TicketRun`: one ticket's workflow run, from its stored node runs to its
outcome.

    state, error = await TicketRun(host, ticket, resumed).execute()

`execute` checks the stored node runs against the workflow, puts nodes that
were running when the scheduler stopped back to pending, and hands the graph
to `graph.run_graph`; `run_node` is one node's life: attempts, the node's
timeout, retries, and its state in the store, its events and its metric.
"""

from __future__ import annotations

import asyncio
import logging
import time

from services.common.config.model import Node
from services.common.errors import AfeError, DeadlineExceeded, FailedPrecondition, ResourceExhausted

from ..events.log import now_ms
from ..events.writes import LOST_EVENT
from ..sandboxes.spec import SANDBOX_KINDS
from ..store.base import (
    FAILED,
    N_CANCELLED,
    N_FAILED,
    N_PENDING,
    N_RUNNING,
    N_SKIPPED,
    N_SUCCEEDED,
    N_WAITING,
    SUCCEEDED,
    LeaseLost,
    NodeRunRecord,
    TicketRecord,
)
from ..store.worker import run_in_store
from .attempts import RESTART, Attempt, lost_reason, previous_scheduler
from .context import RunContext
from .graph import NodeFailed, descendants, run_graph
from .host import Host
from .nodes import NODE_KINDS
from .nodes.builtins import Rejected
from .nodes.run import CommandFailed

log = logging.getLogger(__name__)

OUTPUT_KEEP = 64 * 1024          # characters of a node's output kept in the store
WAITING_KINDS = ("builtin:merge", "builtin:approval")   # no timeout: they wait for a person
NOT_RETRIED = (ResourceExhausted, Rejected)


FEEDBACK_KEEP = 8 * 1024         # characters of a failure given back to a node (on_failure)


def _keep_feedback(text: str) -> str:
    return text if len(text) <= FEEDBACK_KEEP else "[cut]...\n" + text[-FEEDBACK_KEEP:]


def _keep(text: str) -> str:
    if len(text) <= OUTPUT_KEEP:
        return text
    return f"[{len(text) - OUTPUT_KEEP} characters cut]...\n" + text[-OUTPUT_KEEP:]


class TicketRun:
    def __init__(self, host: Host, ticket: TicketRecord, resumed: bool, attempt: Attempt | None = None) -> None:
        """`attempt`: why this run is a new attempt of the nodes that were running when the last
        one stopped (attempts.py); None: a restart, when `resumed`."""
        self.host = host
        self.ticket = ticket
        self.resumed = resumed
        self.attempt = attempt if attempt is not None else Attempt(RESTART)
        self.ctx = RunContext(host, ticket)
        self.workflow = self.ctx.workflow
        # The stored attempt of each node, kept here as run_node stores it (no read of every
        # node run before each node); the node kinds read it from the context for their events.
        self.attempts: dict[str, int] = self.ctx.attempts

    async def execute(self) -> tuple[str, str]:
        """Run the ticket's graph; returns (terminal state, error)."""
        tid, store, ctx = self.ticket.id, self.host.store, self.ctx
        records = {r.node_id: r for r in store.tickets.node_runs(tid)}
        declared = [n.id for n in self.workflow.nodes]
        if sorted(declared) != sorted(records):
            raise FailedPrecondition(
                f"workflow {self.workflow.name!r} changed since this ticket was created (nodes "
                f"{', '.join(sorted(records))} became {', '.join(sorted(declared))}); create a new ticket")
        interrupted = [r for r in records.values() if r.state in (N_RUNNING, N_WAITING)]
        self._say_attempt(interrupted)
        if self.host.checkpoints and any(self.workflow.node(r.node_id).kind in SANDBOX_KINDS for r in interrupted):
            await ctx.restore(self._last_completed(records), max(r.attempt for r in interrupted) + 1)
        for r in records.values():
            if r.state in (N_RUNNING, N_WAITING):
                # It was running when its last run stopped: run it again, as a new attempt.
                store.tickets.update_node(tid, r.node_id, state=N_PENDING)
                ctx.emit("node.resumed", {"node": r.node_id, "was": r.state, "attempt": r.attempt})
                r.state = N_PENDING
            elif r.state == N_SUCCEEDED:
                ctx.outputs[r.node_id] = r.output
            if r.feedback and r.state == N_PENDING:
                ctx.feedback[r.node_id] = r.feedback
        if self.resumed:
            ctx.emit("ticket.resumed", {})
        states = {nid: r.state for nid, r in records.items()}
        self.attempts.update({nid: r.attempt for nid, r in records.items()})

        async def run(node: Node) -> None:
            ctx.outputs[node.id] = await self.run_node(node, self.attempts.get(node.id, 0))

        def skip(node_id: str, reason: str) -> None:
            store.tickets.update_node(tid, node_id, state=N_SKIPPED, error=reason)

        while True:
            failure = await run_graph(self.workflow.nodes, states, run, skip)
            if failure is None or not self._feedback_round(failure, states):
                break
        await ctx.settle_relay(None)     # what the model relay counted since the last node is the ticket's (R32)
        if failure is None:
            return SUCCEEDED, ""
        return FAILED, f"node {failure.node_id} failed: {failure.reason}"

    def _last_completed(self, records: dict[str, NodeRunRecord]) -> str:
        """The node that may have changed the workspace and completed last ("" when none did):
        the state a new attempt of an interrupted node starts from."""
        done = [r for r in records.values()
                if r.state == N_SUCCEEDED and self.workflow.node(r.node_id).kind in SANDBOX_KINDS]
        return max(done, key=lambda r: r.finished_at_ms).node_id if done else ""

    def _say_attempt(self, interrupted: list[NodeRunRecord]) -> None:
        """Before anything else of this run: the events of the interrupted attempt that were never
        stored (`events.lost`, when this scheduler counted them), and for each node that was running
        when it stopped, a `node.attempt` saying why it runs again and who ran it before."""
        a, ctx, tid = self.attempt, self.ctx, self.ticket.id
        if a.lost_events > 0:
            ctx.emit(LOST_EVENT, {"count": a.lost_events, "reason": lost_reason(a.reason),
                                  "attempt": max((r.attempt for r in interrupted), default=0),
                                  **({"previous_scheduler": a.previous_scheduler} if a.previous_scheduler else {})})
        if not interrupted:
            return
        before = a.previous_scheduler or previous_scheduler(self.host.store, tid)
        for r in interrupted:
            ctx.emit("node.attempt", {"node": r.node_id, "attempt": r.attempt + 1, "previous": r.attempt,
                                      "reason": a.reason, "previous_scheduler": before,
                                      "scheduler": self.host.owner})

    def _feedback_round(self, failure: NodeFailed, states: dict[str, str]) -> bool:
        """`on_failure: {retry_from: R, max: N}` of the failed node: give its
        failure to R and put R and every node after it back to pending, at
        most N rounds (counted in the store, so a restart does not reset
        them). False when the node has no on_failure or its rounds are spent."""
        tid, store, ctx = self.ticket.id, self.host.store, self.ctx
        node = self.workflow.node(failure.node_id)
        if not node.retry_from or failure.rejected:
            return False
        rec = next(r for r in store.tickets.node_runs(tid) if r.node_id == node.id)
        if rec.rounds >= node.retry_max:
            ctx.emit("node.feedback_spent", {"node": node.id, "to": node.retry_from, "rounds": rec.rounds,
                                             "max": node.retry_max})
            return False
        rounds = rec.rounds + 1
        text = self.host.redactor.redact(_keep_feedback(rec.error or failure.reason))
        # R and what follows it, and what the failure stopped (skipped, or cancelled alongside).
        stopped = {nid for nid, st in states.items() if st in (N_SKIPPED, N_CANCELLED)}
        again = descendants(self.workflow.nodes, {node.retry_from} | stopped)
        for n in self.workflow.nodes:
            if n.id in again:
                store.tickets.update_node(tid, n.id, state=N_PENDING, started_at_ms=0, finished_at_ms=0, output="",
                                  error="", **({"feedback": text} if n.id == node.retry_from else {}))
                states[n.id] = N_PENDING
                ctx.outputs.pop(n.id, None)
        store.tickets.update_node(tid, node.id, rounds=rounds)
        ctx.feedback[node.retry_from] = text
        ctx.emit("node.feedback", {"node": node.id, "to": node.retry_from, "round": rounds, "max": node.retry_max,
                                   "error": text[-4000:], "nodes": [n.id for n in self.workflow.nodes
                                                                    if n.id in again]})
        return True

    async def _node_state(self, node_id: str, **fields: object) -> None:
        """Store a node's state, awaited on the store's thread (store/worker.py): a
        node that starts or ends while the database is away waits for it (within
        the store's retries) instead of holding the loop or failing at once."""
        tid = self.ticket.id
        await run_in_store(self.host.store, lambda s: s.tickets.update_node(tid, node_id, **fields))

    async def run_node(self, node: Node, attempt: int) -> str:
        """Run `node` until it succeeds or its retries are spent (then `NodeFailed`)."""
        tid, store, host = self.ticket.id, self.host.store, self.host
        kind = node.label
        tries = 0
        while True:
            tries += 1
            attempt += 1
            started = time.monotonic()
            await self._node_state(node.id, state=N_RUNNING, attempt=attempt, started_at_ms=now_ms(),
                                   finished_at_ms=0, error="")
            self.attempts[node.id] = attempt
            self.ctx.emit("node.started", {"node": node.id, "kind": kind, "attempt": attempt,
                                           "scheduler": host.owner})
            outcome = "error"
            try:
                if node.kind in SANDBOX_KINDS:
                    await self.ctx.ensure_sandbox()  # preparation does not count against the node's timeout
                if kind in WAITING_KINDS:
                    out = await self._dispatch(node)
                else:
                    try:
                        async with asyncio.timeout(node.timeout_s):
                            out = await self._dispatch(node)
                    except TimeoutError:
                        outcome = "timeout"
                        raise DeadlineExceeded(
                            f"timed out after {node.timeout_s:g}s (the node's timeout)") from None
                out = out or ""
                if host.checkpoints and node.kind in SANDBOX_KINDS:
                    await self.ctx.checkpoint(node)     # before it counts as done: a takeover restores it
                await self._node_state(node.id, state=N_SUCCEEDED, finished_at_ms=now_ms(),
                                       output=host.redactor.redact(_keep(out)))
                self.ctx.emit("node.finished", {"node": node.id, "state": N_SUCCEEDED, "attempt": attempt,
                                                "output": out[-4000:]})
                host.node_metric(kind, "ok", time.monotonic() - started)
                return out
            except asyncio.CancelledError:
                if host.lease_lost(tid):    # another scheduler drives it now: write nothing (R37)
                    raise
                store.tickets.update_node(tid, node.id, state=N_CANCELLED, finished_at_ms=now_ms(), error="cancelled")
                if not host.stopping:
                    self.ctx.emit("node.finished", {"node": node.id, "state": N_CANCELLED, "attempt": attempt})
                    host.node_metric(kind, "cancelled", time.monotonic() - started)
                else:  # the scheduler is stopping: the node runs again on the next start
                    store.tickets.update_node(tid, node.id, state=N_RUNNING)
                raise
            except LeaseLost:
                raise
            except Exception as exc:
                if host.lease_lost(tid):
                    raise LeaseLost(tid) from None
                if isinstance(exc, AfeError):
                    reason = exc.message
                else:
                    log.error("node %s: internal error", node.id, exc_info=exc)
                    reason = "internal error (details are in the scheduler log)"
                reason = host.redactor.redact(reason)
                host.node_metric(kind, outcome, time.monotonic() - started)
                if tries <= node.retries and not isinstance(exc, NOT_RETRIED):
                    self.ctx.emit("node.retry", {"node": node.id, "attempt": attempt, "error": reason})
                    continue
                kept = exc.output if isinstance(exc, CommandFailed) else ""   # what a failed command printed
                await self._node_state(node.id, state=N_FAILED, finished_at_ms=now_ms(), error=reason,
                                       **({"output": host.redactor.redact(_keep(kept))} if kept else {}))
                self.ctx.emit("node.finished", {"node": node.id, "state": N_FAILED, "attempt": attempt,
                                                "error": reason})
                raise NodeFailed(node.id, reason, rejected=isinstance(exc, NOT_RETRIED)) from None

    async def _dispatch(self, node: Node) -> str:
        kind = NODE_KINDS.get(node.kind)
        if kind is None:
            raise FailedPrecondition(f"unknown node kind {node.kind!r}")
        return await kind(self.ctx, node)
