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

Engine is the composition of its parts, each a module named for what it
holds: leases.py (several schedulers on one store, R37), approvals.py (a
person's decision, R16), reopen.py (re-open, retry, update the branch),
records.py (the final diff, denied egress, metrics). The state they share is
made here, in `Engine.__init__`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from pathlib import Path

from services.common import telemetry
from services.common.config import Config
from services.common.errors import AfeError, InvalidArgument, NotFound
from services.common.logs import ticket_var
from services.common.metrics import scheduler_metrics, usage_metrics
from services.common.redact import Redactor

from ..events.log import EventLog, EventRecord, now_ms
from ..executor import TicketRun, Transitions
from ..executor.brokercalls import BROKER_RETRY_S
from ..executor.transitions import state_event
from ..sandboxes.brokers import CredentialBroker, SandboxBroker
from ..sandboxes.pool import DEFAULT_CAP, SandboxPool
from ..sandboxes.teardown import Teardowns
from ..store.base import (
    CANCELLED,
    FAILED,
    LIVE,
    QUEUED,
    RUNNING,
    TERMINAL,
    LeaseLost,
    NodeRunRecord,
    Store,
    TicketRecord,
)
from .approvals import Approvals
from .leases import HELD, LEASE_S, Leases, scheduler_id
from .records import DIFF_MAX_BYTES, Records
from .reopen import REOPENABLE, Reopen
from .tickets import new_ticket_id, validate
from .view import TicketView

__all__ = ["DIFF_MAX_BYTES", "HELD", "LEASE_S", "REOPENABLE", "Engine", "TicketView", "scheduler_id"]

log = logging.getLogger(__name__)


class Engine(Leases, Approvals, Reopen, Records):
    """The scheduler core; its parts are the base classes (leases.py, approvals.py, reopen.py, records.py)."""

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
        self.metrics = scheduler_metrics(registry) if registry is not None else None
        self.events = EventLog(store, redactor, self.metrics)
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
        self.teardowns = Teardowns(store, sandbox, credentials, recovery_interval, self._finishing.__contains__, config)
        # Warm sandboxes (pool.py): `pool_dir` None = none; their reserved ids are live for reconcile.
        self.pool = SandboxPool(config, sandbox, credentials, pool_dir, cap=pool_cap,
                                is_ticket=lambda tid: store.get_ticket(tid) is not None)
        self.teardowns.reserved = self.pool.ids
        self.pool.export(self.metrics)

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

    async def watch(self, ticket_id: str, from_seq: int, follow: bool) -> AsyncGenerator[EventRecord, None]:
        self.view(ticket_id)

        def terminal() -> bool:
            t = self.store.get_ticket(ticket_id)
            return t is None or t.state in TERMINAL

        async with contextlib.aclosing(self.events.watch(ticket_id, from_seq, follow, terminal)) as events:
            async for ev in events:
                yield ev

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

    # ---- what a run may use (executor.Host) ---------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stopping
