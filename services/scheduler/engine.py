"""The scheduler core: tickets, capacity, the per-ticket workflow run,
approvals, durability and teardown. No gRPC here; the servicer maps.

Life of a ticket: `create` stores it `queued` with pending node runs; the
dispatcher starts queued tickets in creation order while the global and the
per-workspace limits allow; a `TicketRun` (runs.py) walks the node graph;
on a terminal state the sandbox and workspace are torn down and
`ticket.finished` is the ticket's last event. On start every non-terminal
ticket resumes: nodes that were running run again, builtins are idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.common import telemetry
from services.common.config import Config
from services.common.errors import AfeError, FailedPrecondition, InvalidArgument, NotFound
from services.common.logs import ticket_var
from services.common.metrics import scheduler_metrics
from services.common.redact import Redactor

from .brokers import CredentialsClient, SandboxClient
from .events import EventLog, EventRecord, now_ms
from .store import (
    CANCELLED,
    FAILED,
    LIVE,
    N_PENDING,
    QUEUED,
    RUNNING,
    TERMINAL,
    WAITING_APPROVAL,
    ApprovalRecord,
    NodeRunRecord,
    PullRequestRecord,
    Store,
    TicketRecord,
)
from .tickets import new_ticket_id, validate

log = logging.getLogger(__name__)

DIFF_MAX_BYTES = 1024 * 1024
TEARDOWN_RETRY_FIRST = 1.0    # seconds before the first retry of a failed teardown (doubles)
TEARDOWN_RETRY_MAX = 30.0
FINAL_TEARDOWN_S = 3.0        # what a stopping scheduler spends on teardowns still pending


@dataclass
class TicketView:
    ticket: TicketRecord
    nodes: list[NodeRunRecord]
    pr: PullRequestRecord | None
    approval: ApprovalRecord | None
    last_seq: int


class Engine:
    def __init__(self, config: Config, store: Store, sandbox: SandboxClient, credentials: CredentialsClient,
                 redactor: Redactor, *, max_running: int = 4, registry=None,
                 recovery_interval: float = 2.0) -> None:
        self.config = config
        self.store = store
        self.sandbox = sandbox
        self.credentials = credentials
        self.redactor = redactor
        self.max_running = max(1, max_running)
        self.events = EventLog(store, redactor)
        self.metrics = scheduler_metrics(registry) if registry is not None else None
        self._tasks: dict[str, asyncio.Task] = {}
        self._traceparents: dict[str, str | None] = {}   # ticket -> trace of its CreateTicket call
        self._running: set[str] = set()        # tickets counted against capacity
        self._cancelling: dict[str, str] = {}  # ticket -> principal who cancelled
        self._finishing: set[str] = set()      # tickets tearing down / recording their end
        self._waiters: dict[str, asyncio.Future] = {}
        self._background: set[asyncio.Task] = set()
        self._started = False
        self._stopping = False
        # Every `recovery_interval` s the sandbox broker is asked who it is: a new
        # boot id (it restarted) means reconcile now; failed teardowns are retried
        # with back-off until done (R12). 0 turns both off (tests' positive control).
        self.recovery_interval = recovery_interval
        self._broker_boot: str | None = None
        self._teardown_wake = asyncio.Event()

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        """Resume every non-terminal ticket, reconcile sandboxes, tear down leftovers."""
        self._started = True
        await self._reconcile_sandboxes()
        live = self.store.tickets_in_states(LIVE)
        if self.recovery_interval > 0:
            self._spawn(self._retry_teardowns())
            self._spawn(self._watch_sandbox_broker())
        else:
            for t in self.store.terminal_not_torn_down():
                self._spawn(self._teardown_only(t))
        for t in live:
            if t.state == RUNNING:
                self._running.add(t.id)
                self._launch(t, resumed=True)
            elif t.state == WAITING_APPROVAL:
                self._launch(t, resumed=True)
        self._kick()
        self._update_gauges()

    async def stop(self) -> None:
        """Stop running work WITHOUT changing ticket states: they resume on the next start."""
        self._stopping = True
        tasks = list(self._tasks.values()) + list(self._background)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.recovery_interval > 0:
            await self._final_teardowns()
        self.events.flush()

    async def _reconcile_sandboxes(self) -> bool:
        """Have the sandbox broker remove every sandbox, proxy and network whose
        ticket is not live (R12). Creates wait meanwhile, so the live set read
        here cannot miss a sandbox made during the call."""
        try:
            async with self.sandbox.creates_held():
                live = [t.id for t in self.store.tickets_in_states(LIVE)]
                r = await self.sandbox.reconcile(live)
        except AfeError as exc:
            log.warning("could not reconcile sandboxes (retried when the sandbox broker answers): %s", exc)
            return False
        self._broker_boot = r.boot_id or None
        if r.removed_tickets:
            log.info("reconcile removed sandboxes of %s ticket(s)", len(r.removed_tickets))
        return True

    async def _watch_sandbox_broker(self) -> None:
        """A sandbox broker that restarted (new boot id) is reconciled at once,
        and the teardowns that failed while it was away are retried."""
        while True:
            await asyncio.sleep(self.recovery_interval)
            try:
                boot = await self.sandbox.identify()
            except AfeError:
                continue            # down or restarting: a later probe sees it back
            if boot != self._broker_boot:
                log.warning("the sandbox broker restarted; reconciling sandboxes with the live tickets")
                if await self._reconcile_sandboxes():
                    self._teardown_wake.set()

    async def _retry_teardowns(self) -> None:
        """Tear down terminal tickets whose teardown failed (the store keeps
        `torn_down` false for them), with back-off while a broker is away."""
        delay = TEARDOWN_RETRY_FIRST
        while True:
            self._teardown_wake.clear()
            failed = 0
            for t in self.store.terminal_not_torn_down():
                if t.id not in self._finishing and not await self._teardown_only(t):
                    failed += 1
            wait: float | None = None
            if failed:
                wait, delay = delay, min(delay * 2, TEARDOWN_RETRY_MAX)
            else:
                delay = TEARDOWN_RETRY_FIRST
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._teardown_wake.wait()

    async def _final_teardowns(self) -> None:
        """A stopping scheduler makes one bounded attempt at pending teardowns
        (the launcher stops it before the brokers)."""
        pending = self.store.terminal_not_torn_down()
        if not pending:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FINAL_TEARDOWN_S):
                for t in pending:
                    await self._teardown_only(t)

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
        t = TicketRecord(id=new_ticket_id(), workspace=nt.workspace.name, workflow=nt.workflow.name,
                         title=nt.title, body=nt.body, inputs=nt.inputs, state=QUEUED,
                         created_at_ms=now, updated_at_ms=now, principal=nt.principal, origin=dict(origin or {}))
        self._traceparents[t.id] = telemetry.current_traceparent()
        nodes = [NodeRunRecord(ticket_id=t.id, node_id=n.id, kind=n.label, needs=n.needs)
                 for n in nt.workflow.nodes]
        self.events.flush()
        first = [self.events.make(t.id, "ticket.created", {
            "workspace": t.workspace, "workflow": t.workflow, "title": t.title, "principal": t.principal,
            "nodes": [n.node_id for n in nodes],
            **({"origin": {k: t.origin.get(k, "") for k in ("source", "event", "url", "author", "trigger")}}
               if t.origin else {})})]
        self.store.create_ticket(t, nodes, first)
        self.events.delivered(first)
        self._transition_metric(QUEUED)
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
        self.store.update_ticket(t.id, state=RUNNING, awaiting_sha="", updated_at_ms=now_ms())
        self.events.append(t.id, "approval.granted", {"principal": principal, "sha": rec.sha})
        self.events.append(t.id, "ticket.state", {"state": RUNNING})
        self._transition_metric(RUNNING)
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
        self.store.update_ticket(t.id, state=RUNNING, awaiting_sha="", updated_at_ms=now_ms())
        self.events.append(t.id, "approval.rejected", {"principal": principal, "sha": rec.sha,
                                                       "reason": reason or ""})
        self._running.add(t.id)
        task = self._tasks.get(ticket_id)
        self._wake(t.id, rec)
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        return self.view(ticket_id)

    def _wake(self, ticket_id: str, rec: ApprovalRecord) -> None:
        fut = self._waiters.get(ticket_id)
        if fut is not None and not fut.done():
            fut.set_result(rec)
        elif ticket_id not in self._tasks:
            t = self.store.get_ticket(ticket_id)
            if t is not None:
                self._launch(t, resumed=True)

    async def watch(self, ticket_id: str, from_seq: int, follow: bool) -> AsyncIterator[EventRecord]:
        self.view(ticket_id)

        def terminal() -> bool:
            t = self.store.get_ticket(ticket_id)
            return t is None or t.state in TERMINAL

        async with contextlib.aclosing(self.events.watch(ticket_id, from_seq, follow, terminal)) as events:
            async for ev in events:
                yield ev

    async def diff(self, ticket_id: str) -> tuple[str, bool]:
        t = self.view(ticket_id).ticket
        if t.torn_down:
            raise FailedPrecondition(f"ticket {ticket_id} is {t.state} and its workspace is gone; "
                                     f"see its pull request for the change")
        r = await self.credentials.diff(t.id, t.workspace, DIFF_MAX_BYTES)
        return r.diff, r.truncated

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
            per_ws[t.workspace] = per_ws.get(t.workspace, 0) + 1
            self._running.add(t.id)
            self.store.update_ticket(t.id, state=RUNNING, updated_at_ms=now_ms())
            self.events.append(t.id, "ticket.state", {"state": RUNNING})
            self._transition_metric(RUNNING)
            t.state = RUNNING
            self._launch(t, resumed=False)
        self._update_gauges()

    def _launch(self, t: TicketRecord, resumed: bool) -> None:
        from .runs import TicketRun

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

    async def _traced(self, run):
        """Run a ticket in a span continuing the trace of the call that created it
        (a new trace when it resumes after a restart)."""
        with telemetry.span("ticket.run", parent=self._traceparents.pop(run.ticket.id, None), root=True,
                            attributes={"afe.ticket": run.ticket.id}):
            return await run.execute()

    async def _run_ticket(self, run) -> None:
        t = run.ticket
        ticket_var.set(t.id)
        try:
            state, error = await self._traced(run)
        except asyncio.CancelledError:
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
        finally:
            self._finishing.discard(t.id)

    async def _finish_quietly(self, t: TicketRecord, state: str, error: str) -> None:
        try:
            await self._finish(t, state, error)
        except Exception:
            log.exception("ticket %s: could not finish", t.id)

    async def _finish(self, t: TicketRecord, state: str, error: str) -> None:
        """Tear down, then record the terminal state and the final event."""
        torn = await self._teardown(t)
        self.events.flush()
        self.store.update_ticket(t.id, state=state, error=self.redactor.redact(error or ""),
                                 updated_at_ms=now_ms(), awaiting_sha="", torn_down=torn)
        if not torn:
            self._teardown_wake.set()       # _retry_teardowns takes it from here
        self.events.append(t.id, "ticket.finished", {"state": state, "error": error or ""})
        self.events.flush()
        self._transition_metric(state)
        self._running.discard(t.id)
        self._cancelling.pop(t.id, None)
        log.info("ticket %s %s", t.id, state)
        self._kick()
        self._update_gauges()

    async def _teardown(self, t: TicketRecord) -> bool:
        """DestroySandbox + ReleaseWorkspace; True when both are done (R12)."""
        ok = True
        try:
            await self.sandbox.destroy(t.id)
        except AfeError as exc:
            ok = False
            log.warning("ticket %s: could not remove its sandbox: %s", t.id, exc)
        try:
            await self.credentials.release(t.id, t.workspace)
        except NotFound:
            pass
        except AfeError as exc:
            ok = False
            log.warning("ticket %s: could not release its workspace: %s", t.id, exc)
        return ok

    async def _teardown_only(self, t: TicketRecord) -> bool:
        if await self._teardown(t):
            self.store.update_ticket(t.id, torn_down=True)
            log.info("ticket %s: teardown done", t.id)
            return True
        return False

    # ---- metrics ---------------------------------------------------------------

    def _transition_metric(self, state: str) -> None:
        if self.metrics is not None:
            self.metrics.ticket_transitions.labels(state=state).inc()

    def _update_gauges(self) -> None:
        if self.metrics is None:
            return
        counts: dict[str, int] = {}
        for state in (QUEUED, RUNNING, WAITING_APPROVAL):
            counts[state] = len(self.store.tickets_in_states((state,)))
        self.metrics.set_ticket_counts(counts)

    def node_metric(self, kind: str, outcome: str, seconds: float) -> None:
        if self.metrics is not None:
            k = kind.split(":")[0]
            self.metrics.node_duration.labels(kind=k, outcome=outcome).observe(seconds)

    # for runs.py
    def pending_reset(self, ticket_id: str, node_id: str) -> None:
        self.store.update_node(ticket_id, node_id, state=N_PENDING)
