"""The scheduler core: tickets, capacity, the per-ticket workflow run,
approvals, durability and teardown. No gRPC here; the servicer maps.

Life of a ticket: `create_ticket` stores it `queued` with pending node runs;
`_kick` (the dispatcher) starts queued tickets in creation order while the
global and the per-workspace limits allow; `_launch` -> `_run_ticket` runs
an `executor.TicketRun`, which walks the node graph; `_finish` tears the
sandbox and workspace down (teardown.py) and records the terminal state with
`ticket.finished` as the ticket's last event. On start every non-terminal
ticket resumes: nodes that were running run again, builtins are idempotent.

Every ticket state change goes through `executor.Transitions` (store, event,
metric); a run reaches the engine only through `executor.Host`.

Several schedulers on one PostgreSQL store (docs/SCALE.md): each live ticket
is driven by the scheduler that claimed it (`Store.claim_ticket`: the
dispatcher for a queued ticket, `start` and the takeover loop for a running
or waiting one whose owner's lease expired). `_lease_loop` renews the leases
of the tickets this scheduler drives and learns what others asked of them
(a cancel, an approval); a ticket found taken over stops at once without a
write or a side effect (`LeaseLost`, R37). On an unshared store (SQLite) the
scheduler owns every ticket and neither loop runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from pathlib import Path

from services.common import telemetry
from services.common.config import Config
from services.common.errors import AfeError, FailedPrecondition, InvalidArgument, NotFound
from services.common.logs import ticket_var
from services.common.metrics import scheduler_metrics, usage_metrics
from services.common.redact import Redactor

from . import egress_report
from .brokers import CredentialBroker, SandboxBroker
from .events import EventLog, EventRecord, now_ms
from .executor import TicketRun, Transitions
from .executor.brokercalls import BROKER_RETRY_S
from .executor.graph import descendants
from .executor.transitions import state_event
from .pool import DEFAULT_CAP, SandboxPool
from .store import (
    CANCELLED,
    FAILED,
    LIVE,
    N_PENDING,
    N_SUCCEEDED,
    QUEUED,
    RUNNING,
    TERMINAL,
    WAITING_APPROVAL,
    ApprovalRecord,
    LeaseLost,
    NodeRunRecord,
    PullRequestRecord,
    Store,
    TicketRecord,
)
from .teardown import Teardowns
from .tickets import new_ticket_id, validate

log = logging.getLogger(__name__)

DIFF_MAX_BYTES = 1024 * 1024
REOPENABLE = (FAILED, CANCELLED)   # states `retry` and `update_branch` re-open
LEASE_S = 10.0                     # a live ticket's lease; renewed every third of it (docs/SCALE.md)
HELD = (RUNNING, WAITING_APPROVAL)  # states a scheduler drives a ticket in (takeover takes them over)


def scheduler_id() -> str:
    """A new id for this scheduler process (host, pid, random): the owner of its leases."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass
class TicketView:
    ticket: TicketRecord
    nodes: list[NodeRunRecord]
    pr: PullRequestRecord | None
    approval: ApprovalRecord | None
    last_seq: int


class Engine:
    def __init__(self, config: Config, store: Store, sandbox: SandboxBroker, credentials: CredentialBroker,
                 redactor: Redactor, *, max_running: int = 4, registry=None,
                 recovery_interval: float = 2.0, pool_dir: Path | None = None,
                 pool_cap: int = DEFAULT_CAP, owner: str = "", lease_s: float = LEASE_S) -> None:
        self.config = config
        self.store = store
        # Leases (docs/SCALE.md): who this scheduler is, how long its tickets' leases last. A ticket
        # taken over by another scheduler is in `_lost`; `fencing` False skips the check before a side
        # effect (tests' positive control of R37 only).
        self.owner = owner or scheduler_id()
        store.owner = self.owner
        self.lease_s = lease_s
        self.fencing = True
        self._lost: set[str] = set()
        self.sandbox = sandbox
        self.credentials = credentials
        self.redactor = redactor
        self.max_running = max(1, max_running)
        self.events = EventLog(store, redactor)
        self.metrics = scheduler_metrics(registry) if registry is not None else None
        self.usage = usage_metrics(registry, config.models) if registry is not None else None
        self.transitions = Transitions(store, self.events, self.metrics)
        self.broker_retry_s = BROKER_RETRY_S   # how long runs wait for a broker that went away (R37)
        self._tasks: dict[str, asyncio.Task] = {}
        self._traceparents: dict[str, str | None] = {}   # ticket -> trace of its CreateTicket call
        self._running: set[str] = set()        # tickets counted against capacity
        self._cancelling: dict[str, str] = {}  # ticket -> principal who cancelled
        self._finishing: set[str] = set()      # tickets tearing down / recording their end
        self._reopening: set[str] = set()      # tickets in Engine.reopen
        self._waiters: dict[str, asyncio.Future] = {}
        self._background: set[asyncio.Task] = set()
        self._started = False
        self._stopping = False
        # Every `recovery_interval` s the sandbox broker is asked who it is: a new
        # boot id (it restarted) means reconcile now; failed teardowns are retried
        # with back-off until done (R12). 0 turns both off (tests' positive control).
        self.recovery_interval = recovery_interval
        self.teardowns = Teardowns(store, sandbox, credentials, recovery_interval, self._finishing.__contains__)
        # Warm sandboxes (pool.py): `pool_dir` None = none; their reserved ids are live for reconcile.
        self.pool = SandboxPool(config, sandbox, credentials, pool_dir, cap=pool_cap,
                                is_ticket=lambda tid: store.get_ticket(tid) is not None)
        self.teardowns.reserved = self.pool.ids

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        """Resume every non-terminal ticket, reconcile sandboxes, tear down leftovers."""
        self._started = True
        await self.teardowns.reconcile()
        await self.pool.recover()
        live = self.store.tickets_in_states(LIVE)
        if self.recovery_interval > 0:
            self._spawn(self.teardowns.retry_loop())
            self._spawn(self.teardowns.watch_broker())
        else:
            for t in self.store.terminal_not_torn_down():
                self._spawn(self.teardowns.teardown_only(t))
        for t in live:
            if t.state in HELD and self._claim(t.id, HELD):
                self._resume(t)
        if self.store.shared:
            self._spawn(self._lease_loop())
            self._spawn(self._takeover_loop())
        self._kick()
        self.transitions.set_gauges()
        self.pool.start()

    async def stop(self) -> None:
        """Stop running work WITHOUT changing ticket states: they resume on the next start
        (or at once in another scheduler on the same store: their leases are given up)."""
        self._stopping = True
        tasks = list(self._tasks.values()) + list(self._background)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.store.shared:
            for tid in list(self.store.fences):
                with contextlib.suppress(Exception):
                    self.store.release_ticket(tid)
        await self.pool.close()
        if self.recovery_interval > 0:
            await self.teardowns.final()
        self.events.flush()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- API ---------------------------------------------------------------

    def create_ticket(self, workspace: str, workflow: str, title: str, body: str,
                      inputs: dict[str, str], principal: str, *, origin: dict | None = None) -> TicketView:
        """`origin` (github_intake.py) says where the ticket came from and which of its
        texts are untrusted (R36); it changes nothing of the workflow that runs."""
        nt = validate(self.config, workspace, workflow, title, body, inputs, principal)
        now = now_ms()
        # a warm sandbox of this profile, made for a reserved id, becomes this ticket's (pool.py, R12)
        reserved = self.pool.claim(nt.workspace, nt.workflow)
        t = TicketRecord(id=reserved or new_ticket_id(), workspace=nt.workspace.name, workflow=nt.workflow.name,
                         title=nt.title, body=nt.body, inputs=nt.inputs, state=QUEUED,
                         created_at_ms=now, updated_at_ms=now, principal=nt.principal, origin=dict(origin or {}))
        self._traceparents[t.id] = telemetry.current_traceparent()
        nodes = [NodeRunRecord(ticket_id=t.id, node_id=n.id, kind=n.label, needs=n.needs)
                 for n in nt.workflow.nodes]
        try:
            self.transitions.create(t, nodes, {
                "workspace": t.workspace, "workflow": t.workflow, "title": t.title, "principal": t.principal,
                "nodes": [n.node_id for n in nodes],
                **({"origin": {k: t.origin.get(k, "") for k in ("source", "event", "url", "author", "trigger")}}
                   if t.origin else {})})
        except BaseException:
            if reserved:
                self.pool.unclaim(reserved, t.workspace)
            raise
        if reserved:
            self.pool.claimed(reserved)
        log.info("ticket %s created (workflow %s)", t.id, t.workflow)
        self._kick()
        return self.view(t.id)

    def view(self, ticket_id: str) -> TicketView:
        t = self.store.get_ticket(ticket_id)
        if t is None:
            raise NotFound(f"no ticket {ticket_id!r}; list tickets to see their ids")
        self.events.flush()
        return TicketView(t, self.store.node_runs(t.id), self.store.get_pr(t.id),
                          self.store.latest_approval(t.id), self.store.last_seq(t.id))

    def pull_request(self, workspace: str, number: str) -> TicketView:
        """The ticket whose pull request in `workspace` is `number` (the UI's page of a
        local-forge pull request)."""
        if workspace not in self.config.workspaces:
            raise NotFound(f"no workspace {workspace!r}; list workspaces to see their names")
        tid = self.store.ticket_for_pr(workspace, number) if number else None
        if tid is None:
            raise NotFound(f"workspace {workspace!r} has no pull request {number!r} that afe opened")
        return self.view(tid)

    def list_tickets(self, states: list[str], workspace: str, page_size: int,
                     page_token: str) -> tuple[list[TicketView], str]:
        size = page_size or 50
        if size < 0 or size > 500:
            raise InvalidArgument("page_size must be between 1 and 500")
        before = None
        if page_token:
            try:
                before = int(page_token, 16)
            except ValueError:
                raise InvalidArgument("page_token is not one this server gave out") from None
        rows = self.store.list_tickets(states or None, workspace or None, size + 1, before)
        more = len(rows) > size
        rows = rows[:size]
        token = format(rows[-1].rowid, "x") if more and rows else ""
        return [self.view(t.id) for t in rows], token

    async def cancel(self, ticket_id: str, principal: str) -> TicketView:
        t = self.view(ticket_id).ticket
        if t.state in TERMINAL:
            return self.view(ticket_id)
        who = principal or "unknown"
        task = self._tasks.get(ticket_id)
        if task is None and not self._claim(t.id, (t.state,)):
            return await self._cancel_elsewhere(t.id, who)
        if t.state == QUEUED and task is None:
            self.store.update_ticket(t.id, torn_down=True)
            await self._finish(t, CANCELLED, f"cancelled by {who}")
            return self.view(ticket_id)
        self._cancelling[ticket_id] = who
        if task is not None:
            if ticket_id not in self._finishing:
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self._cancelling.pop(ticket_id, None)
        else:
            await self._finish(t, CANCELLED, f"cancelled by {who}")
        return self.view(ticket_id)

    async def approve(self, ticket_id: str, principal: str, sha: str) -> TicketView:
        t = self.view(ticket_id).ticket
        if not principal:
            raise InvalidArgument("an approval needs the principal (who approves)")
        if t.state != WAITING_APPROVAL:
            raise FailedPrecondition(f"ticket {ticket_id} is {t.state}, not waiting for approval")
        if sha and sha != t.awaiting_sha:
            raise FailedPrecondition(
                f"the pull request head is {t.awaiting_sha or 'unknown'} now, not {sha}; review it again "
                f"and approve the current head")
        rec = ApprovalRecord(ticket_id, principal, t.awaiting_sha, True, now_ms())
        self.events.flush()
        self.store.add_approval(rec)
        self.transitions.move(t.id, RUNNING, ("approval.granted", {"principal": principal, "sha": rec.sha}),
                              state_event(RUNNING), awaiting_sha="")
        self._running.add(t.id)
        self._wake(t.id, rec)
        return self.view(ticket_id)

    async def reject(self, ticket_id: str, principal: str, reason: str) -> TicketView:
        t = self.view(ticket_id).ticket
        if not principal:
            raise InvalidArgument("a rejection needs the principal (who rejects)")
        if t.state != WAITING_APPROVAL:
            raise FailedPrecondition(f"ticket {ticket_id} is {t.state}, not waiting for approval")
        rec = ApprovalRecord(ticket_id, principal, t.awaiting_sha, False, now_ms(), reason or "")
        self.events.flush()
        self.store.add_approval(rec)
        self.transitions.move(t.id, RUNNING, ("approval.rejected", {"principal": principal, "sha": rec.sha,
                                                                    "reason": reason or ""}),
                              counted=False, awaiting_sha="")
        self._running.add(t.id)
        task = self._tasks.get(ticket_id)
        self._wake(t.id, rec)
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        return self.view(ticket_id)

    async def reopen(self, ticket_id: str, principal: str, reason: str, *, payload: dict | None = None,
                     on_reopen: Callable[[TicketRecord, int], None] | None = None,
                     nodes: set[str] | None = None) -> TicketView:
        """Run a ticket that waits for approval or has ended again, on its own
        branch and pull request: every node back to pending, the ticket
        `queued` with `ticket.reopened`, and `reopened_at_ms` now, so no approval
        given before counts for what the re-run pushes (R16). The one re-open
        transition; `afe ticket followup` and review iteration (followups.py)
        use it. `on_reopen(ticket, at_ms)` runs once the re-open is allowed,
        before the ticket is queued (e.g. to record the follow-up's text).

        A ticket re-opened but not started yet takes more `on_reopen` calls
        without a second re-open (a review and its comments arrive together).
        Refused: a running ticket, a merged pull request, a teardown still
        under way, a workflow or workspace no longer configured.

        `nodes` (a retry, an update of the branch): only these nodes go back to
        pending; the others keep their state and output."""
        t = self.view(ticket_id).ticket
        if not principal:
            raise InvalidArgument("a re-open needs the principal (who asks for it)")
        if t.state == QUEUED and t.reopened_at_ms and ticket_id not in self._tasks:
            if on_reopen is not None:
                on_reopen(t, t.reopened_at_ms)
            return self.view(ticket_id)
        if (t.state not in TERMINAL and t.state != WAITING_APPROVAL) or ticket_id in self._reopening:
            raise FailedPrecondition(f"ticket {ticket_id} is {t.state}; ask again once it waits for approval or "
                                     "has ended")
        pr = self.store.get_pr(ticket_id)
        if pr is not None and pr.state == "merged":
            raise FailedPrecondition(f"ticket {ticket_id}'s pull request {pr.number} is merged; create a new "
                                     "ticket for more changes")
        if t.state in TERMINAL and not t.torn_down:
            raise FailedPrecondition(f"ticket {ticket_id} is still being torn down; try again in a moment")
        if t.workflow not in self.config.workflows or t.workspace not in self.config.workspaces:
            raise FailedPrecondition(f"ticket {ticket_id}'s workflow {t.workflow!r} or workspace {t.workspace!r} "
                                     "is no longer configured; create a new ticket")
        self._reopening.add(ticket_id)
        try:
            task = self._tasks.get(ticket_id)
            if task is not None:      # parked in waiting_approval: stop the run without ending the ticket
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            at = now_ms()
            if on_reopen is not None:
                on_reopen(t, at)
            for n in self.store.node_runs(ticket_id):
                if nodes is not None and n.node_id not in nodes:
                    continue          # `nodes` (a retry): the others keep their state and output
                self.store.update_node(ticket_id, n.node_id, state=N_PENDING, error="", output="",
                                       started_at_ms=0, finished_at_ms=0, rounds=0, feedback="")
            self.events.flush()
            self.transitions.move(ticket_id, QUEUED,
                                  ("ticket.reopened", {"principal": principal, "reason": reason,
                                                       "was": t.state, **(payload or {})}),
                                  state_event(QUEUED), error="", awaiting_sha="", torn_down=False,
                                  reopened_at_ms=at)
            log.info("ticket %s re-opened by %s (%s)", ticket_id, principal, reason)
        finally:
            self._reopening.discard(ticket_id)
        self._kick()
        self.transitions.set_gauges()
        return self.view(ticket_id)

    def _wake(self, ticket_id: str, rec: ApprovalRecord) -> None:
        fut = self._waiters.get(ticket_id)
        if fut is not None and not fut.done():
            fut.set_result(rec)
        elif ticket_id not in self._tasks:
            t = self.store.get_ticket(ticket_id)
            if t is not None and self._claim(t.id, HELD):
                self._launch(t, resumed=True)
            else:   # another scheduler drives it: its heartbeat sees the decision (_lease_loop)
                self._running.discard(ticket_id)

    async def watch(self, ticket_id: str, from_seq: int, follow: bool) -> AsyncGenerator[EventRecord, None]:
        self.view(ticket_id)

        def terminal() -> bool:
            t = self.store.get_ticket(ticket_id)
            return t is None or t.state in TERMINAL

        async with contextlib.aclosing(self.events.watch(ticket_id, from_seq, follow, terminal)) as events:
            async for ev in events:
                yield ev

    async def diff(self, ticket_id: str) -> tuple[str, bool, bool]:
        """(diff, truncated, recorded): the live workspace's diff, or, once the
        ticket ended, the one stored when it ended (its workspace is gone)."""
        t = self.view(ticket_id).ticket
        if t.state in TERMINAL:
            rec = self.store.final_diff(t.id)
            if rec is not None:
                return rec[0], rec[1], True
        if t.torn_down or t.state == QUEUED:
            raise FailedPrecondition(f"ticket {ticket_id} is {t.state} and has no workspace"
                                     + (" and no stored diff (it ended before it changed anything)"
                                        if t.state in TERMINAL else " yet; try again once it runs"))
        r = await self.credentials.diff(t.id, t.workspace, DIFF_MAX_BYTES)
        return r.diff, r.truncated, False

    # ---- recovery: re-open an ended ticket ------------------------------------

    def _again(self, t: TicketRecord, from_node: str | None) -> list[str]:
        """The nodes a retry runs again: `from_node` and every node after it, or,
        without it, every node that did not succeed and every node after those."""
        wf = self.config.workflows.get(t.workflow)
        if wf is None:
            raise FailedPrecondition(f"workflow {t.workflow!r} is no longer configured; create a new ticket")
        runs = {r.node_id: r for r in self.store.node_runs(t.id)}
        if from_node:
            if from_node not in runs:
                raise InvalidArgument(f"ticket {t.id} has no node {from_node!r}; its nodes: "
                                      + ", ".join(n.id for n in wf.nodes))
            start = {from_node}
        else:
            start = {nid for nid, r in runs.items() if r.state != N_SUCCEEDED}
            if not start:
                raise FailedPrecondition(f"every node of ticket {t.id} succeeded; name the node to run again "
                                         "from (--from NODE)")
        again = descendants(wf.nodes, start)
        return [n.id for n in wf.nodes if n.id in again]

    async def retry(self, ticket_id: str, from_node: str, principal: str) -> TicketView:
        """`afe ticket retry ID [--from NODE]`: re-run a failed or cancelled
        ticket on its own branch and pull request (`reopen`); the nodes before
        keep their state and output, the workspace comes back from the
        ticket's branch and its kept last state (PrepareWorkspace)."""
        if not principal:
            raise InvalidArgument("a retry needs the principal (who retries)")
        t = self.view(ticket_id).ticket
        if t.state not in REOPENABLE:
            raise FailedPrecondition(f"ticket {ticket_id} is {t.state}; only a failed or cancelled ticket can be "
                                     "retried")
        again = self._again(t, from_node or None)
        return await self.reopen(ticket_id, principal, "retry", nodes=set(again),
                                 payload={"from": from_node or "", "nodes": again})

    async def update_branch(self, ticket_id: str, principal: str) -> TicketView:
        """A pull request that conflicts with its base: merge the base into the
        ticket's branch on the host and re-open the ticket from its merge node,
        which waits for a person's approval of the new head (R16)."""
        if not principal:
            raise InvalidArgument("updating the branch needs the principal (who asks)")
        v = self.view(ticket_id)
        t = v.ticket
        if t.state not in REOPENABLE:
            raise FailedPrecondition(f"ticket {ticket_id} is {t.state}; update the branch of a failed or "
                                     "cancelled ticket (cancel it first)")
        if v.pr is None or v.pr.state == "merged":
            raise FailedPrecondition(f"ticket {ticket_id} has " + ("no pull request; retry it instead"
                                                                   if v.pr is None else "a merged pull request"))
        wf = self.config.workflows.get(t.workflow)
        merge = next((n.id for n in wf.nodes if n.label == "builtin:merge"), None) if wf else None
        r = await self.credentials.update_branch(t.id, t.workspace)
        if r.conflicts:
            shown = ", ".join(list(r.conflicts)[:20]) + (" ..." if len(r.conflicts) > 20 else "")
            self.events.append(t.id, "branch.conflict", {"principal": principal, "paths": list(r.conflicts)[:100]})
            self.events.flush()
            raise FailedPrecondition(f"merging {v.pr.base_branch or 'the base branch'} into {v.pr.head_branch} "
                                     f"conflicts in: {shown}; resolve them on that branch (or retry the ticket "
                                     "with --from the node that writes the change) and approve again")
        if r.changed:
            v.pr.head_sha = r.head_sha
            self.store.put_pr(v.pr)
        again = self._again(t, merge)
        return await self.reopen(ticket_id, principal, "update branch", nodes=set(again),
                                 payload={"from": merge or "", "nodes": again, "head_sha": r.head_sha,
                                          "branch_updated": bool(r.changed)})

    # ---- capacity ------------------------------------------------------------

    def running_count(self, workspace: str | None = None) -> int:
        if workspace is None:
            return len(self._running)
        n = 0
        for tid in self._running:
            t = self.store.get_ticket(tid)
            if t is not None and t.workspace == workspace:
                n += 1
        return n

    def _kick(self) -> None:
        """Start queued tickets, oldest first, while the limits allow."""
        if not self._started or self._stopping:
            return
        if len(self._running) >= self.max_running:
            return
        per_ws: dict[str, int] = {}
        for tid in self._running:
            t = self.store.get_ticket(tid)
            if t is not None:
                per_ws[t.workspace] = per_ws.get(t.workspace, 0) + 1
        for t in self.store.tickets_in_states((QUEUED,)):
            if len(self._running) >= self.max_running:
                break
            if t.id in self._tasks:
                continue
            ws = self.config.workspaces.get(t.workspace)
            limit = ws.max_running if ws else 0
            if limit and per_ws.get(t.workspace, 0) >= limit:
                continue
            if not self._claim(t.id, (QUEUED,)):
                continue       # another scheduler took it
            per_ws[t.workspace] = per_ws.get(t.workspace, 0) + 1
            self._running.add(t.id)
            self.transitions.move(t.id, RUNNING, state_event(RUNNING))
            t.state = RUNNING
            self._launch(t, resumed=False)
        self.transitions.set_gauges()

    def _launch(self, t: TicketRecord, resumed: bool) -> None:
        if t.workflow not in self.config.workflows or t.workspace not in self.config.workspaces:
            # The config changed under a live ticket: end it with the reason.
            what = (f"workflow {t.workflow!r}" if t.workflow not in self.config.workflows
                    else f"workspace {t.workspace!r}")
            task = asyncio.create_task(self._finish(t, FAILED, f"{what} is no longer configured"))
        else:
            task = asyncio.create_task(self._run_ticket(TicketRun(self, t, resumed=resumed)),
                                       name=f"ticket-{t.id}")
        self._tasks[t.id] = task

        def forget(done: asyncio.Task, tid: str = t.id) -> None:
            if self._tasks.get(tid) is done:
                del self._tasks[tid]

        task.add_done_callback(forget)

    async def _traced(self, run: TicketRun) -> tuple[str, str]:
        """Run a ticket in a span continuing the trace of the call that created it
        (a new trace when it resumes after a restart)."""
        with telemetry.span("ticket.run", parent=self._traceparents.pop(run.ticket.id, None), root=True,
                            attributes={"afe.ticket": run.ticket.id}):
            return await run.execute()

    async def _run_ticket(self, run: TicketRun) -> None:
        t = run.ticket
        ticket_var.set(t.id)
        try:
            state, error = await self._traced(run)
        except LeaseLost as exc:
            self._forget(t.id, exc.message)
            return
        except asyncio.CancelledError:
            if t.id in self._lost:
                self._forget(t.id, "its lease was lost")
                raise
            who = self._cancelling.get(t.id)
            if who is not None and not self._stopping:
                await asyncio.shield(self._finish_quietly(t, CANCELLED, f"cancelled by {who}"))
            raise
        except Exception as exc:  # the run could not even start a node
            if isinstance(exc, AfeError):
                error = exc.message
            else:
                log.error("ticket %s: internal error", t.id, exc_info=exc)
                error = "internal error (details are in the scheduler log)"
            state = FAILED
        # From here on a cancel waits for the end instead of interrupting it.
        self._finishing.add(t.id)
        try:
            await asyncio.shield(self._finish(t, state, error))
        except LeaseLost as exc:
            self._forget(t.id, exc.message)
        finally:
            self._finishing.discard(t.id)

    async def _record_diff(self, t: TicketRecord) -> None:
        """The ticket's diff against its base, stored before its workspace goes,
        so it is shown after the ticket ended (also when it failed or was cancelled)."""
        if t.workspace not in self.config.workspaces:
            return
        try:
            r = await self.credentials.diff(t.id, t.workspace, DIFF_MAX_BYTES)
        except AfeError as exc:   # no workspace (ended before it was prepared) or the broker is away
            log.info("ticket %s: no diff to keep: %s", t.id, exc.message)
            return
        self.store.put_final_diff(t.id, self.redactor.redact(r.diff), r.truncated, now_ms())

    async def _record_denied_egress(self, t: TicketRecord) -> None:
        """The hosts the ticket's egress proxy refused, as an event before its sandbox
        goes (the final GitHub comment lists them, egress_report.py)."""
        try:
            r = await self.sandbox.denied_egress(t.id)
        except AfeError:      # no sandbox (none needed, or ended before one was made) or the broker is away
            return
        if r.hosts:
            self.events.append(t.id, egress_report.EVENT, egress_report.payload(r))
            self.events.flush()

    async def _finish_quietly(self, t: TicketRecord, state: str, error: str) -> None:
        try:
            await self._finish(t, state, error)
        except Exception:
            log.exception("ticket %s: could not finish", t.id)

    async def _finish(self, t: TicketRecord, state: str, error: str) -> None:
        """Record the final diff, tear down, then record the terminal state and the final event."""
        if not self._holds(t.id):     # taken over: the new owner ends it, tears down (R37)
            self._forget(t.id, "its lease was lost before it ended")
            return
        await self._record_diff(t)
        await self._record_denied_egress(t)
        torn = await self.teardowns.teardown(t)
        if not torn:
            self.teardowns.wake()
        self.transitions.move(t.id, state, ("ticket.finished", {"state": state, "error": error or ""}),
                              error=self.redactor.redact(error or ""), awaiting_sha="", torn_down=torn)
        self.events.flush()
        self.store.release_ticket(t.id)
        self._running.discard(t.id)
        self._cancelling.pop(t.id, None)
        log.info("ticket %s %s", t.id, state)
        self._kick()
        self.transitions.set_gauges()

    # ---- leases: several schedulers on one store (docs/SCALE.md) ---------------------

    @property
    def lease_ms(self) -> int:
        return int(self.lease_s * 1000)

    def _claim(self, ticket_id: str, states: tuple[str, ...]) -> bool:
        """Take the ticket for this scheduler (a new fence) when it is in `states`
        and free; True when this scheduler drives it now."""
        if ticket_id in self._tasks:
            return True
        fence = self.store.claim_ticket(ticket_id, states, self.lease_ms)
        if fence is None:
            return False
        self._lost.discard(ticket_id)
        return True

    def _holds(self, ticket_id: str) -> bool:
        fence = self.store.fences.get(ticket_id) if self.store.shared else 0
        if fence is None or ticket_id in self._lost:
            return False
        return not self.store.shared or self.store.holds(ticket_id, fence)

    def check_lease(self, ticket_id: str) -> None:
        """Right before a side effect (a push, a pull request, a merge, a comment):
        this scheduler still holds the ticket with its fence, by the database's
        clock, or `LeaseLost` (R37)."""
        if self.fencing and not self._holds(ticket_id):
            self._lost.add(ticket_id)
            raise LeaseLost(ticket_id)

    def lease_lost(self, ticket_id: str) -> bool:
        return ticket_id in self._lost

    def _resume(self, t: TicketRecord) -> None:
        if t.state == RUNNING:
            self._running.add(t.id)
        self._launch(t, resumed=True)

    def _forget(self, ticket_id: str, why: str) -> None:
        """Stop driving a ticket another scheduler took over: no write, no teardown."""
        log.warning("ticket %s: stopped here: %s; the scheduler that took it over goes on", ticket_id, why)
        self._lost.add(ticket_id)
        self.store.fences.pop(ticket_id, None)
        self._running.discard(ticket_id)
        self._cancelling.pop(ticket_id, None)
        self._kick()

    async def _cancel_elsewhere(self, ticket_id: str, who: str) -> TicketView:
        """A cancel of a ticket another scheduler drives: ask it (its heartbeat sees the
        request) and wait for the end, at most a lease and a half."""
        self.store.request_cancel(ticket_id, who)
        end = time.monotonic() + self.lease_s * 1.5 + 5
        while time.monotonic() < end:
            t = self.store.get_ticket(ticket_id)
            if t is None or t.state in TERMINAL:
                break
            await asyncio.sleep(0.2)
        return self.view(ticket_id)

    async def _lease_loop(self) -> None:
        """Renew the leases of the tickets this scheduler drives, every third of a
        lease; stop the ones another scheduler took over; act on what was asked
        of them through another scheduler (a cancel, an approval)."""
        while not self._stopping:
            await asyncio.sleep(self.lease_s / 3)
            held = list(self.store.fences)
            if not held:
                continue
            try:
                leases = {lease.ticket_id: lease for lease in self.store.renew_leases(held, self.lease_ms)}
            except Exception as exc:  # noqa: BLE001 - the database is away: the leases run out unless it is back
                log.warning("scheduler: could not renew its tickets' leases: %s",
                            getattr(exc, "message", type(exc).__name__))
                if self.metrics is not None:
                    self.metrics.lease_renew_failures.labels(reason="error").inc()
                continue
            for tid in held:
                lease = leases.get(tid)
                if lease is None:
                    if tid not in self.store.fences:
                        continue          # released meanwhile (the ticket ended)
                    if self.metrics is not None:
                        self.metrics.lease_renew_failures.labels(reason="lost").inc()
                    self._lost.add(tid)
                    self.store.fences.pop(tid, None)
                    task = self._tasks.get(tid)
                    if task is not None and tid not in self._finishing:
                        task.cancel()
                    continue
                if lease.cancel_by and tid in self._tasks and tid not in self._cancelling:
                    self._spawn(self.cancel(tid, lease.cancel_by))
                elif lease.state == RUNNING and tid in self._waiters:
                    rec = self.store.latest_approval(tid)
                    if rec is not None:
                        self._running.add(tid)
                        self._wake(tid, rec)

    async def _takeover_loop(self) -> None:
        """Claim the live tickets whose owner's lease expired (it died or hangs) and
        resume them here; start queued tickets filed through other schedulers."""
        interval = max(0.2, self.lease_s / 5)
        while not self._stopping:
            await asyncio.sleep(interval)
            try:
                for tid in self.store.expired_tickets(HELD):
                    if self._stopping or tid in self._tasks:
                        continue
                    if len(self._running) >= self.max_running:
                        break
                    t = self.store.get_ticket(tid)
                    if t is None or not self._claim(tid, HELD):
                        continue
                    t = self.store.get_ticket(tid) or t
                    log.info("ticket %s: taken over (%s; its scheduler's lease expired)", tid, t.state)
                    if self.metrics is not None:
                        self.metrics.lease_takeovers.labels(from_state=t.state).inc()
                    self.events.append(tid, "ticket.takeover", {"scheduler": self.owner, "state": t.state})
                    self._resume(t)
                self._kick()
            except Exception as exc:  # noqa: BLE001 - the next scan tries again
                log.warning("scheduler: the takeover scan failed: %s", getattr(exc, "message", type(exc).__name__))

    # ---- what a run may use (executor.Host) ---------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stopping

    def node_metric(self, kind: str, outcome: str, seconds: float) -> None:
        if self.metrics is not None:
            k = kind.split(":")[0]
            self.metrics.node_duration.labels(kind=k, outcome=outcome).observe(seconds)

    def usage_metric(self, model: str, input_tokens: int, output_tokens: int, cost_usd: float | None) -> None:
        """Count a model call's tokens and estimated cost; `model` is a Model manifest name."""
        if self.usage is None or model not in self.config.models:
            return
        self.usage.tokens.labels(model=model, direction="input").inc(max(0, input_tokens))
        self.usage.tokens.labels(model=model, direction="output").inc(max(0, output_tokens))
        if cost_usd:
            self.usage.cost.labels(model=model).inc(cost_usd)

    async def wait_for_decision(self, ticket_id: str) -> ApprovalRecord:
        fut: asyncio.Future[ApprovalRecord] = asyncio.get_running_loop().create_future()
        self._waiters[ticket_id] = fut
        try:
            self._running.discard(ticket_id)   # a waiting ticket holds no capacity
            self._kick()
            return await fut
        finally:
            if self._waiters.get(ticket_id) is fut:
                del self._waiters[ticket_id]
