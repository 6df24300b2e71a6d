"""The scheduler core: tickets, capacity, the per-ticket workflow run,
approvals, durability and teardown. No gRPC here; the servicer maps.

Life of a ticket: `create_ticket` stores it `queued` with pending node runs;
the dispatcher (dispatch.py) starts queued tickets in creation order while
the global and the per-workspace limits allow and runs an
`executor.TicketRun`, which walks the node graph; its end tears the sandbox
and workspace down (teardown.py) and records the terminal state with
`ticket.finished` as the ticket's last event. On start every non-terminal
ticket resumes: nodes that were running run again as a new attempt,
builtins are idempotent.

Every ticket state change goes through `executor.Transitions` (store, event,
metric); a run reaches the engine only through `executor.Host`, which
`Engine` implements by handing each call to the part that owns it.

`Engine` is composed of objects that each own their state, made here and
given what they use: `Dispatcher` (dispatch.py: the run tasks, capacity,
each run's end), `Leases` (leases.py: fences, self-fencing and the lease and
takeover loops, R37/R45), `Handover` (handover.py: the count of events a
lost attempt could not store, carried to the next attempt), `Approvals`
(approvals.py: the runs waiting for a person's decision, R16), `Reopen`
(reopen.py: re-open, retry, update the branch) and `Records` (records.py:
the final diff, denied egress, metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Coroutine
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from services.common.config.model import Config
from services.common.errors import InvalidArgument, NotFound
from services.common.observability import telemetry
from services.common.observability.metrics import scheduler_metrics, usage_metrics
from services.common.secrecy.redact import Redactor

from ..events.log import EventLog, now_ms
from ..executor import Transitions, attempts
from ..executor.brokercalls import BROKER_RETRY_S
from ..sandboxes.brokers import CredentialBroker, SandboxBroker
from ..sandboxes.pool import DEFAULT_CAP, SandboxPool
from ..sandboxes.teardown import Teardowns
from ..store.base import (
    CANCELLED,
    LIVE,
    N_RUNNING,
    N_WAITING,
    QUEUED,
    RUNNING,
    TERMINAL,
    ApprovalRecord,
    EventRecord,
    Lease,
    NodeRunRecord,
    TicketRecord,
)
from ..store.store import Store
from . import leases as leases_mod
from .approvals import Approvals
from .dispatch import Dispatcher
from .handover import Handover
from .leases import HELD, LEASE_S, Leases, scheduler_id
from .records import DIFF_MAX_BYTES, Records
from .reopen import REOPENABLE, Reopen
from .tickets import new_ticket_id, validate
from .view import TicketView

__all__ = ["DIFF_MAX_BYTES", "HELD", "LEASE_S", "REOPENABLE", "Engine", "TicketView", "scheduler_id"]

log = logging.getLogger(__name__)


class Engine:
    """The scheduler core: the parts it is composed of (see the module's text), and the public
    calls of the servicer, the GitHub intake and the runs (`executor.Host`), each handed to its part."""

    def __init__(self, config: Config, store: Store, sandbox: SandboxBroker, credentials: CredentialBroker,
                 redactor: Redactor, *, max_running: int = 4, registry: CollectorRegistry | None = None,
                 recovery_interval: float = 2.0, pool_dir: Path | None = None,
                 pool_cap: int = DEFAULT_CAP, owner: str = "", lease_s: float = LEASE_S) -> None:
        self.config = config
        self.store = store
        self.sandbox = sandbox
        self.credentials = credentials
        self.redactor = redactor
        self.metrics = scheduler_metrics(registry) if registry is not None else None
        self.usage = usage_metrics(registry, config.models) if registry is not None else None
        self.events = EventLog(store, redactor, self.metrics)
        self.transitions = Transitions(store, self.events, self.metrics)
        self.broker_retry_s = BROKER_RETRY_S   # how long runs wait for a broker that went away (R37)
        self.keep_checkpoints = True
        self._background: set[asyncio.Task[object]] = set()
        # Leases (docs/SCALE.md): who this scheduler is, how long its tickets' leases last, and what it
        # does when it loses one (stop the run, count the events it can no longer store).
        self.leases = Leases(store, owner=owner or scheduler_id(), lease_s=lease_s, metrics=self.metrics,
                             on_lost=self._lost)
        self.records = Records(config, store, sandbox, credentials, redactor, self.events, self.metrics,
                               self.usage, self.view)
        # Every `recovery_interval` s the sandbox broker is asked who it is: a new
        # boot id (it restarted) means reconcile now; failed teardowns are retried
        # with back-off until done (R12). 0 turns both off (tests' positive control).
        self.recovery_interval = recovery_interval
        self.teardowns = Teardowns(store, sandbox, credentials, recovery_interval,
                                   lambda tid: tid in self.dispatch.finishing, config)
        self.dispatch = Dispatcher(config, store, self.events, self.transitions, self.leases, self.records,
                                   self.teardowns, redactor, max_running=max_running)
        self.dispatch.host = self
        self.dispatch.on_ended.append(self._ended)
        self.handover = Handover(store, self.events, self.leases, self.dispatch.busy)
        self.approvals = Approvals(store, self.events, self.transitions, self.dispatch, self.view)
        self.reopens = Reopen(config, store, credentials, self.events, self.transitions, self.dispatch,
                              self.leases, self.view)
        # Warm sandboxes (pool.py): `pool_dir` None = none; their reserved ids are live for reconcile.
        self.pool = SandboxPool(config, sandbox, credentials, pool_dir, cap=pool_cap,
                                is_ticket=lambda tid: store.tickets.get(tid) is not None)
        self.teardowns.reserved = self.pool.ids
        self.pool.export(self.metrics)

    # ---- who this scheduler is --------------------------------------------------------

    @property
    def owner(self) -> str:
        return self.leases.owner

    @property
    def lease_s(self) -> float:
        return self.leases.lease_s

    @property
    def max_running(self) -> int:
        return self.dispatch.max_running

    @property
    def fencing(self) -> bool:
        return self.leases.fencing

    @fencing.setter
    def fencing(self, on: bool) -> None:
        self.leases.fencing = on

    @property
    def stopping(self) -> bool:
        return self.dispatch.stopping

    @property
    def checkpoints(self) -> bool:
        """A workspace checkpoint after each node that may change it: only where another scheduler
        can take a ticket over (a shared store); `keep_checkpoints` False turns it off (tests)."""
        return self.store.shared and self.keep_checkpoints

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        """Resume every non-terminal ticket, reconcile sandboxes, tear down leftovers."""
        self.dispatch.started = True
        await self.teardowns.reconcile()
        await self.pool.recover()
        live = self.store.tickets.in_states(LIVE)
        if self.recovery_interval > 0:
            self._spawn(self.teardowns.retry_loop())
            self._spawn(self.teardowns.watch_broker())
        else:
            for t in self.store.tickets.terminal_not_torn_down():
                self._spawn(self.teardowns.teardown_only(t))
        for t in live:
            if t.state in HELD and self.dispatch.claim(t.id, HELD):
                self.dispatch.resume(t)
        if self.store.shared:
            stopping = self._stopping
            self._spawn(self.leases.renew_loop(self._heard, stopping))
            self._spawn(self.leases.watch_loop(stopping))
            self._spawn(self.leases.takeover_loop(self._take, self._busy, self.dispatch.full, stopping,
                                                  self.dispatch.kick))
        self.dispatch.kick()
        self.transitions.set_gauges()
        self.pool.start()

    async def stop(self) -> None:
        """Stop running work WITHOUT changing ticket states: they resume on the next start
        (or at once in another scheduler on the same store: their leases are given up)."""
        background = list(self._background)
        for task in background:
            task.cancel()
        await self.dispatch.stop()
        if background:
            await asyncio.gather(*background, return_exceptions=True)
        if self.store.shared:
            self.leases.release_all()
        await self.pool.close()
        if self.recovery_interval > 0:
            await self.teardowns.final()
        self.events.flush()

    def _stopping(self) -> bool:
        return self.dispatch.stopping

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- leases: what this scheduler does with what it hears -----------------------------

    def _lost(self, ticket_id: str, why: str, reason: str) -> None:
        """`Leases.lose`: the ticket is not this scheduler's to drive any more. Its events not
        stored yet are dropped and counted (never written late), and its run is stopped."""
        self.events.fence(ticket_id)
        self.dispatch.stop_lost(ticket_id, why)

    def _busy(self, ticket_id: str) -> bool:
        """A lost ticket's old attempt is not over here yet: its run, or its events in flight."""
        return self.dispatch.busy(ticket_id) or self.events.fenced(ticket_id)

    def _ended(self, ticket_id: str) -> None:
        """A run task ended here: a lost ticket's attempt hands over its count of unstored events."""
        self.handover.ended(ticket_id)
        if self.leases.lost(ticket_id) and self.events.fenced(ticket_id):
            self._spawn(self.handover.lost_here(ticket_id, self.leases.lost_fence(ticket_id)))

    def _take(self, t: TicketRecord, why: str) -> None:
        """A ticket claimed by the takeover scan (`why`: leases.TAKEN_OVER from another scheduler, or
        leases.SELF_FENCED here): a new attempt of what was running."""
        if why == leases_mod.SELF_FENCED:
            log.info("ticket %s: claimed again after this scheduler fenced itself off (%s)", t.id, t.state)
        else:
            log.info("ticket %s: taken over (%s; its scheduler's lease expired)", t.id, t.state)
            if self.metrics is not None:
                self.metrics.lease_takeovers.labels(from_state=t.state).inc()
            self.events.append(t.id, "ticket.takeover", {"scheduler": self.owner, "state": t.state})
        reason = attempts.SELF_FENCED if why == leases_mod.SELF_FENCED else attempts.TAKEOVER
        interrupted = max((n.attempt for n in self.store.tickets.node_runs(t.id) if n.state in (N_RUNNING, N_WAITING)),
                          default=0)
        self.dispatch.resume(t, self.handover.attempt_for(t.id, reason, self.owner, interrupted))

    def _heard(self, lease: Lease) -> None:
        """A renewed lease: act on what was asked of the ticket through another scheduler."""
        tid = lease.ticket_id
        self.handover.heard(tid)
        if lease.cancel_by and tid in self.dispatch.tasks and tid not in self.dispatch.cancelling:
            self._spawn(self.cancel(tid, lease.cancel_by))
        elif lease.state == RUNNING:
            self.approvals.heard(tid)

    # ---- API ---------------------------------------------------------------

    def create_ticket(self, workspace: str, workflow: str, title: str, body: str,
                      inputs: dict[str, str], principal: str, *,
                      origin: dict[str, Any] | None = None) -> TicketView:
        """`origin` (github_intake.py) says where the ticket came from and which of its
        texts are untrusted (R36); it changes nothing of the workflow that runs."""
        nt = validate(self.config, workspace, workflow, title, body, inputs, principal)
        now = now_ms()
        # a warm sandbox of this profile, made for a reserved id, becomes this ticket's (pool.py, R12)
        reserved = self.pool.claim(nt.workspace, nt.workflow)
        t = TicketRecord(id=reserved or new_ticket_id(), workspace=nt.workspace.name, workflow=nt.workflow.name,
                         title=nt.title, body=nt.body, inputs=nt.inputs, state=QUEUED,
                         created_at_ms=now, updated_at_ms=now, principal=nt.principal, origin=dict(origin or {}))
        self.dispatch.traceparents[t.id] = telemetry.current_traceparent()
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
        self.dispatch.kick()
        return self.view(t.id)

    def view(self, ticket_id: str) -> TicketView:
        t = self.store.tickets.get(ticket_id)
        if t is None:
            raise NotFound(f"no ticket {ticket_id!r}; list tickets to see their ids")
        self.events.flush()
        return TicketView(t, self.store.tickets.node_runs(t.id), self.store.prs.get_pr(t.id),
                          self.store.approvals.latest_approval(t.id), self.store.events.last_seq(t.id))

    def pull_request(self, workspace: str, number: str) -> TicketView:
        """The ticket whose pull request in `workspace` is `number` (the UI's page of a
        local-forge pull request)."""
        if workspace not in self.config.workspaces:
            raise NotFound(f"no workspace {workspace!r}; list workspaces to see their names")
        tid = self.store.prs.ticket_for_pr(workspace, number) if number else None
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
        rows = self.store.tickets.list(states or None, workspace or None, size + 1, before)
        more = len(rows) > size
        rows = rows[:size]
        token = format(rows[-1].rowid, "x") if more and rows else ""
        return [self.view(t.id) for t in rows], token

    async def cancel(self, ticket_id: str, principal: str) -> TicketView:
        t = self.view(ticket_id).ticket
        if t.state in TERMINAL:
            return self.view(ticket_id)
        who = principal or "unknown"
        d = self.dispatch
        task = d.tasks.get(ticket_id)
        if task is None and not d.claim(t.id, (t.state,)):
            return await self._cancel_elsewhere(t.id, who)
        if t.state == QUEUED and task is None:
            self.store.tickets.update(t.id, torn_down=True)
            await d.finish(t, CANCELLED, f"cancelled by {who}")
            return self.view(ticket_id)
        d.cancelling[ticket_id] = who
        if task is not None:
            if ticket_id not in d.finishing:
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            d.cancelling.pop(ticket_id, None)
        else:
            await d.finish(t, CANCELLED, f"cancelled by {who}")
        return self.view(ticket_id)

    async def _cancel_elsewhere(self, ticket_id: str, who: str) -> TicketView:
        """A cancel of a ticket another scheduler drives: ask it (its heartbeat sees the
        request) and wait for the end, at most a lease and a half."""
        self.store.leases.request_cancel(ticket_id, who)
        end = asyncio.get_running_loop().time() + self.lease_s * 1.5 + 5
        while asyncio.get_running_loop().time() < end:
            t = self.store.tickets.get(ticket_id)
            if t is None or t.state in TERMINAL:
                break
            await asyncio.sleep(0.2)
        return self.view(ticket_id)

    async def watch(self, ticket_id: str, from_seq: int, follow: bool) -> AsyncGenerator[EventRecord, None]:
        self.view(ticket_id)

        def terminal() -> bool:
            t = self.store.tickets.get(ticket_id)
            return t is None or t.state in TERMINAL

        async with contextlib.aclosing(self.events.watch(ticket_id, from_seq, follow, terminal)) as events:
            async for ev in events:
                yield ev

    def running_count(self, workspace: str | None = None) -> int:
        return self.dispatch.running_count(workspace)

    # ---- the parts' public calls ----------------------------------------------------------

    async def approve(self, ticket_id: str, principal: str, sha: str, *,
                      accept_harness_change: bool = False) -> TicketView:
        return await self.approvals.approve(ticket_id, principal, sha, accept_harness_change=accept_harness_change)

    async def reject(self, ticket_id: str, principal: str, reason: str) -> TicketView:
        return await self.approvals.reject(ticket_id, principal, reason)

    async def reopen(self, ticket_id: str, principal: str, reason: str, *,
                     payload: dict[str, Any] | None = None,
                     on_reopen: Callable[[TicketRecord, int], None] | None = None,
                     nodes: set[str] | None = None) -> TicketView:
        return await self.reopens.reopen(ticket_id, principal, reason, payload=payload, on_reopen=on_reopen,
                                         nodes=nodes)

    async def retry(self, ticket_id: str, from_node: str, principal: str) -> TicketView:
        return await self.reopens.retry(ticket_id, from_node, principal)

    async def update_branch(self, ticket_id: str, principal: str) -> TicketView:
        return await self.reopens.update_branch(ticket_id, principal)

    async def diff(self, ticket_id: str) -> tuple[str, bool, bool]:
        return await self.records.diff(ticket_id)

    async def forge_head(self, ticket_id: str) -> tuple[str, str]:
        return await self.records.forge_head(ticket_id)

    def running_here(self, ticket_id: str) -> bool:
        """A run of the ticket is under way in this scheduler."""
        return self.dispatch.busy(ticket_id)

    # ---- executor.Host -----------------------------------------------------------------

    def check_lease(self, ticket_id: str) -> None:
        self.leases.check(ticket_id)

    def fence(self, ticket_id: str) -> int:
        return self.leases.fence(ticket_id)

    def lease_lost(self, ticket_id: str) -> bool:
        return self.leases.lost(ticket_id)

    async def wait_for_decision(self, ticket_id: str) -> ApprovalRecord:
        return await self.approvals.wait_for_decision(ticket_id)

    def node_metric(self, kind: str, outcome: str, seconds: float) -> None:
        self.records.node_metric(kind, outcome, seconds)

    def usage_metric(self, model: str, input_tokens: int, output_tokens: int, cost_usd: float | None) -> None:
        self.records.usage_metric(model, input_tokens, output_tokens, cost_usd)
