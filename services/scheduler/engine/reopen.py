"""Re-opening a ticket: running a ticket that waits for approval or has ended
again on its own branch and pull request (`reopen`, R16), and the two ways a
person asks for it: `retry` (from a node) and `update_branch` (merge the base
into a conflicting pull request's branch first).

`Reopen` owns the re-opens under way; the runs it stops and the dispatch
that starts the re-opened ticket are the dispatcher's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from services.common.config.model import Config
from services.common.errors import FailedPrecondition, InvalidArgument

from ..events.log import EventLog, now_ms
from ..executor import Transitions
from ..executor.graph import descendants
from ..executor.transitions import state_event
from ..sandboxes.brokers import CredentialBroker
from ..store.base import (
    CANCELLED,
    FAILED,
    N_PENDING,
    N_SUCCEEDED,
    QUEUED,
    TERMINAL,
    WAITING_APPROVAL,
    TicketRecord,
)
from ..store.store import Store
from .dispatch import Dispatcher
from .leases import Leases
from .view import TicketView

log = logging.getLogger(__name__)

REOPENABLE = (FAILED, CANCELLED)   # states `retry` and `update_branch` re-open


class Reopen:
    """Re-open, retry, update the branch of a ticket."""

    def __init__(self, config: Config, store: Store, credentials: CredentialBroker, events: EventLog,
                 transitions: Transitions, dispatch: Dispatcher, leases: Leases,
                 view: Callable[[str], TicketView]) -> None:
        self.config = config
        self.store = store
        self.credentials = credentials
        self.events = events
        self.transitions = transitions
        self.dispatch = dispatch
        self.leases = leases
        self.view = view
        self.reopening: set[str] = set()   # tickets in `reopen` now

    async def reopen(self, ticket_id: str, principal: str, reason: str, *,
                     payload: dict[str, Any] | None = None,
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
        if t.state == QUEUED and t.reopened_at_ms and ticket_id not in self.dispatch.tasks:
            if on_reopen is not None:
                on_reopen(t, t.reopened_at_ms)
            return self.view(ticket_id)
        if (t.state not in TERMINAL and t.state != WAITING_APPROVAL) or ticket_id in self.reopening:
            raise FailedPrecondition(f"ticket {ticket_id} is {t.state}; ask again once it waits for approval or "
                                     "has ended")
        pr = self.store.prs.get_pr(ticket_id)
        if pr is not None and pr.state == "merged":
            raise FailedPrecondition(f"ticket {ticket_id}'s pull request {pr.number} is merged; create a new "
                                     "ticket for more changes")
        if t.state in TERMINAL and not t.torn_down:
            raise FailedPrecondition(f"ticket {ticket_id} is still being torn down; try again in a moment")
        if t.workflow not in self.config.workflows or t.workspace not in self.config.workspaces:
            raise FailedPrecondition(f"ticket {ticket_id}'s workflow {t.workflow!r} or workspace {t.workspace!r} "
                                     "is no longer configured; create a new ticket")
        self.reopening.add(ticket_id)
        try:
            task = self.dispatch.tasks.get(ticket_id)
            if task is not None:      # parked in waiting_approval: stop the run without ending the ticket
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            at = now_ms()
            if on_reopen is not None:
                on_reopen(t, at)
            for n in self.store.tickets.node_runs(ticket_id):
                if nodes is not None and n.node_id not in nodes:
                    continue          # `nodes` (a retry): the others keep their state and output
                self.store.tickets.update_node(ticket_id, n.node_id, state=N_PENDING, error="", output="",
                                       started_at_ms=0, finished_at_ms=0, rounds=0, feedback="")
            self.events.flush()
            self.transitions.move(ticket_id, QUEUED,
                                  ("ticket.reopened", {"principal": principal, "reason": reason,
                                                       "was": t.state, **(payload or {})}),
                                  state_event(QUEUED), error="", awaiting_sha="", torn_down=False,
                                  reopened_at_ms=at)
            log.info("ticket %s re-opened by %s (%s)", ticket_id, principal, reason)
        finally:
            self.reopening.discard(ticket_id)
        self.dispatch.kick()
        self.transitions.set_gauges()
        return self.view(ticket_id)

    def _again(self, t: TicketRecord, from_node: str | None) -> list[str]:
        """The nodes a retry runs again: `from_node` and every node after it, or,
        without it, every node that did not succeed and every node after those."""
        wf = self.config.workflows.get(t.workflow)
        if wf is None:
            raise FailedPrecondition(f"workflow {t.workflow!r} is no longer configured; create a new ticket")
        runs = {r.node_id: r for r in self.store.tickets.node_runs(t.id)}
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
        r = await self.credentials.update_branch(t.id, t.workspace, self.leases.fence(t.id))
        if r.conflicts:
            shown = ", ".join(list(r.conflicts)[:20]) + (" ..." if len(r.conflicts) > 20 else "")
            self.events.append(t.id, "branch.conflict", {"principal": principal, "paths": list(r.conflicts)[:100]})
            self.events.flush()
            raise FailedPrecondition(f"merging {v.pr.base_branch or 'the base branch'} into {v.pr.head_branch} "
                                     f"conflicts in: {shown}; resolve them on that branch (or retry the ticket "
                                     "with --from the node that writes the change) and approve again")
        if r.changed:
            v.pr.head_sha = r.head_sha
            self.store.prs.put_pr(v.pr)
        again = self._again(t, merge)
        return await self.reopen(ticket_id, principal, "update branch", nodes=set(again),
                                 payload={"from": merge or "", "nodes": again, "head_sha": r.head_sha,
                                          "branch_updated": bool(r.changed)})
