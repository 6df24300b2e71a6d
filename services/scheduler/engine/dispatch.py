"""The dispatcher: which tickets run here, within which capacity, and each
run's life from its start to its recorded end.

`Dispatcher` owns the run tasks (`tasks`), the tickets counted against
capacity (`running`), the cancels and ends under way, and the trace each run
continues. `kick` starts queued tickets in creation order while the global
and the per-workspace limits allow; `launch` runs an `executor.TicketRun`
(which walks the node graph through the engine's `executor.Host`); `finish`
records the final diff and denied egress, tears the sandbox and workspace
down (teardown.py) and stores the terminal state with `ticket.finished` as
the ticket's last event.

A ticket lost here (`Leases.lose`: taken over, or self-fenced, R45) has its
run cancelled by `stop_lost`; the run then ends without a write (its fence
is marked lost). Once it has stopped and every write it left on the store's
thread is through (refused by the fence), `Handover.lost_here` forgets the
fence; the events it could not store are counted by the event log
(`EventLog.fence`) and said by the next attempt (handover.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from services.common.config.model import Config
from services.common.errors import AfeError
from services.common.observability import telemetry
from services.common.observability.logs import ticket_var
from services.common.secrecy.redact import Redactor

from ..events.log import EventLog
from ..executor import TicketRun, Transitions
from ..executor.attempts import Attempt
from ..executor.host import Host
from ..executor.transitions import state_event
from ..sandboxes.teardown import Teardowns
from ..store.base import CANCELLED, FAILED, QUEUED, RUNNING, LeaseLost, TicketRecord
from ..store.store import Store
from .leases import TAKEN_OVER, Leases
from .records import Records

log = logging.getLogger(__name__)


class Dispatcher:
    """Capacity, the run tasks and each run's end."""

    def __init__(self, config: Config, store: Store, events: EventLog, transitions: Transitions,
                 leases: Leases, records: Records, teardowns: Teardowns, redactor: Redactor,
                 *, max_running: int) -> None:
        self.config = config
        self.store = store
        self.events = events
        self.transitions = transitions
        self.leases = leases
        self.records = records
        self.teardowns = teardowns
        self.redactor = redactor
        self.max_running = max(1, max_running)
        self.host: Host | None = None          # what runs use of the engine (set by Engine)
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.traceparents: dict[str, str | None] = {}   # ticket -> trace of its CreateTicket call
        self.running: set[str] = set()         # tickets counted against capacity
        self.cancelling: dict[str, str] = {}   # ticket -> principal who cancelled
        self.finishing: set[str] = set()       # tickets tearing down / recording their end
        self.attempts: dict[str, Attempt] = {}  # ticket -> why its next run is a new attempt (takeover)
        self.started = False
        self.stopping = False
        self.on_ended: list[Callable[[str], None]] = []   # after a ticket's run task ended here

    # ---- capacity ---------------------------------------------------------------------

    def running_count(self, workspace: str | None = None) -> int:
        if workspace is None:
            return len(self.running)
        n = 0
        for tid in self.running:
            t = self.store.tickets.get(tid)
            if t is not None and t.workspace == workspace:
                n += 1
        return n

    def full(self) -> bool:
        return len(self.running) >= self.max_running

    def busy(self, ticket_id: str) -> bool:
        """A run task of the ticket is still here (running, or stopping after a loss)."""
        return ticket_id in self.tasks

    def claim(self, ticket_id: str, states: tuple[str, ...]) -> bool:
        """This scheduler drives the ticket: its run is here, or it claimed it now."""
        return ticket_id in self.tasks or self.leases.claim(ticket_id, states)

    def kick(self) -> None:
        """Start queued tickets, oldest first, while the limits allow."""
        if not self.started or self.stopping:
            return
        if self.full():
            return
        per_ws: dict[str, int] = {}
        for tid in self.running:
            t = self.store.tickets.get(tid)
            if t is not None:
                per_ws[t.workspace] = per_ws.get(t.workspace, 0) + 1
        for t in self.store.tickets.in_states((QUEUED,)):
            if self.full():
                break
            if t.id in self.tasks:
                continue
            ws = self.config.workspaces.get(t.workspace)
            limit = ws.max_running if ws else 0
            if limit and per_ws.get(t.workspace, 0) >= limit:
                continue
            if not self.claim(t.id, (QUEUED,)):
                continue       # another scheduler took it
            per_ws[t.workspace] = per_ws.get(t.workspace, 0) + 1
            self.running.add(t.id)
            self.transitions.move(t.id, RUNNING, state_event(RUNNING))
            t.state = RUNNING
            self.launch(t, resumed=False)
        self.transitions.set_gauges()

    # ---- runs ---------------------------------------------------------------------------

    def resume(self, t: TicketRecord, attempt: Attempt | None = None) -> None:
        """Drive a ticket claimed in RUNNING or WAITING_APPROVAL (a restart, a takeover)."""
        if attempt is not None:
            self.attempts[t.id] = attempt
        if t.state == RUNNING:
            self.running.add(t.id)
        self.launch(t, resumed=True)

    def launch(self, t: TicketRecord, resumed: bool) -> None:
        if t.workflow not in self.config.workflows or t.workspace not in self.config.workspaces:
            # The config changed under a live ticket: end it with the reason.
            what = (f"workflow {t.workflow!r}" if t.workflow not in self.config.workflows
                    else f"workspace {t.workspace!r}")
            task = asyncio.create_task(self.finish(t, FAILED, f"{what} is no longer configured"))
        else:
            assert self.host is not None, "the engine sets the dispatcher's host before it starts"
            run = TicketRun(self.host, t, resumed=resumed, attempt=self.attempts.pop(t.id, None))
            task = asyncio.create_task(self._run(run), name=f"ticket-{t.id}")
        self.tasks[t.id] = task

        def forget(done: asyncio.Task[None], tid: str = t.id) -> None:
            if self.tasks.get(tid) is done:
                del self.tasks[tid]
                for ended in self.on_ended:
                    ended(tid)

        task.add_done_callback(forget)

    def stop_lost(self, ticket_id: str, why: str) -> None:
        """The ticket was lost here (`Leases.lose`): stop its run at once, without a write; its
        capacity is free again."""
        task = self.tasks.get(ticket_id)
        if task is not None and ticket_id not in self.finishing:
            task.cancel()
        elif task is None:          # no run here to stop: the loss is handed over now
            for ended in self.on_ended:
                ended(ticket_id)
        self.running.discard(ticket_id)
        self.cancelling.pop(ticket_id, None)
        self.kick()

    async def _traced(self, run: TicketRun) -> tuple[str, str]:
        """Run a ticket in a span continuing the trace of the call that created it
        (a new trace when it resumes after a restart)."""
        with telemetry.span("ticket.run", parent=self.traceparents.pop(run.ticket.id, None), root=True,
                            attributes={"afe.ticket": run.ticket.id}):
            return await run.execute()

    def _stopped_lost(self, ticket_id: str, why: str) -> None:
        """The run of a ticket lost here has stopped: nothing of it writes any more."""
        log.warning("ticket %s: its run here stopped: %s", ticket_id, why)
        if not self.leases.lost(ticket_id):      # the store found out first (a write refused)
            self.leases.lose(ticket_id, TAKEN_OVER, notify=False)
            self.events.fence(ticket_id)
        # The fence stays marked lost: writes of this run may still be on the store's thread
        # (Handover.lost_here forgets it once they are through).
        self.running.discard(ticket_id)
        self.cancelling.pop(ticket_id, None)
        self.kick()

    async def _run(self, run: TicketRun) -> None:
        t = run.ticket
        ticket_var.set(t.id)
        try:
            state, error = await self._traced(run)
        except LeaseLost as exc:
            self._stopped_lost(t.id, exc.message)
            return
        except asyncio.CancelledError:
            if self.leases.lost(t.id):
                self._stopped_lost(t.id, "its lease was lost")
                raise
            who = self.cancelling.get(t.id)
            if who is not None and not self.stopping:
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
        self.finishing.add(t.id)
        try:
            await asyncio.shield(self.finish(t, state, error))
        except LeaseLost as exc:
            self._stopped_lost(t.id, exc.message)
        finally:
            self.finishing.discard(t.id)

    async def _finish_quietly(self, t: TicketRecord, state: str, error: str) -> None:
        try:
            await self.finish(t, state, error)
        except Exception:
            log.exception("ticket %s: could not finish", t.id)

    async def finish(self, t: TicketRecord, state: str, error: str) -> None:
        """Record the final diff, tear down, then record the terminal state and the final event."""
        if not self.leases.holds(t.id):     # taken over: the new owner ends it, tears down (R37)
            self._stopped_lost(t.id, "its lease was lost before it ended")
            return
        await self.records.record_diff(t)
        await self.records.record_denied_egress(t)
        torn = await self.teardowns.teardown(t)
        if not torn:
            self.teardowns.wake()
        self.transitions.move(t.id, state, ("ticket.finished", {"state": state, "error": error or ""}),
                              error=self.redactor.redact(error or ""), awaiting_sha="", torn_down=torn)
        self.events.flush()
        self.leases.release(t.id)
        self.running.discard(t.id)
        self.cancelling.pop(t.id, None)
        log.info("ticket %s %s", t.id, state)
        self.kick()
        self.transitions.set_gauges()

    async def stop(self) -> None:
        """Cancel every run WITHOUT changing ticket states (they resume on the next start)."""
        self.stopping = True
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
