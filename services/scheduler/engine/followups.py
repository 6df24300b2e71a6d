"""Follow-ups: a ticket that waits for approval or has ended runs its model
and agent nodes again with an instruction, on the same branch and pull
request, and asks for a new approval of the new head (Engine.reopen).

Two ways in, one path: `afe ticket followup ID "instruction"` (the
scheduler's FollowUpTicket RPC, `follow_up`: at once, or refused while the
ticket runs) and, for a pull request afe opened, a review asking for
changes, a review comment or a `/afe ...` comment by a person with write
access (github_intake.py, through `FollowUpQueue`). The instruction is
stored with where it came from (`ticket_followups`) and reaches the nodes
only as quoted data (R36, quoting.followup_section); it changes nothing of
the workflow: its egress, secrets and approval stay what the Workflow says.

GitHub sends a review and then each of its inline comments as separate
deliveries, milliseconds apart. `FollowUpQueue` stores each as a *pending*
follow-up first (so a restart loses none) and re-opens the ticket once no
more has come for `settle_s` (at most MAX_GATHER_S after the first): the
review and its comments are one re-run. What arrives while the ticket runs
is queued: the ticket is re-opened with it when it next waits for approval
or ends. What can never be given to a re-run (the pull request got merged,
the workflow is gone) is dropped loudly: an event on the ticket and a
comment on the pull request. A CI round's follow-up (`github:ci`) whose
failed head is no longer the pull request's when it would be given (the
run it waited for pushed a newer head) is dropped with an event: the newer
head's own CI decides (store/ci_records.py drop_stale_ci), and `stale_ci`
corrects the comment that announced the round. Every arrival is an event on the ticket
(`followup.received`, saying whether it starts, joins or waits for a re-run).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from services.common.errors import AfeError, FailedPrecondition, InvalidArgument

from ..events.log import now_ms
from ..store.base import (
    FOLLOWUP_PENDING,
    QUEUED,
    TERMINAL,
    WAITING_APPROVAL,
    FollowUpRecord,
    TicketRecord,
)
from ..store.ci_records import drop_stale_ci, failed_head
from .tickets import MAX_INPUT_BYTES

log = logging.getLogger(__name__)

FOLLOWUP_KINDS = ("model", "agent")
SETTLE_S = 2.0          # default: a review's comments come within milliseconds of it
MAX_GATHER_S = 30.0     # a steady stream of arrivals re-opens the ticket after this at the latest
RECHECK_S = 5.0         # a queued follow-up looks at its ticket this often (besides every state change here)

# How an arrival was taken (metrics.GITHUB_REASONS):
STARTS = "followup"     # the first of a settle window: the ticket is re-opened with it shortly
GATHERED = "gathered"   # joins the follow-ups of the same window, or a re-run that has not started yet
QUEUED_NEXT = "queued"  # the ticket is running: the next re-run, when it waits for approval or ends


def _clip_utf8(text: str, limit: int) -> str:
    data = text.encode("utf-8")
    return text if len(data) <= limit else data[:limit].decode("utf-8", errors="ignore")


def _record(engine: Any, ticket_id: str, text: str, *, principal: str, author: str, source: str, path: str,
            line: int, url: str) -> tuple[TicketRecord, FollowUpRecord]:
    """The ticket and the follow-up to store, or the error that refuses it."""
    text = (text or "").strip()
    if not text:
        raise InvalidArgument("a follow-up needs an instruction: what should change")
    t = engine.view(ticket_id).ticket
    wf = engine.config.workflows.get(t.workflow)
    if wf is not None and not any(n.kind in FOLLOWUP_KINDS for n in wf.nodes):
        raise FailedPrecondition(f"workflow {t.workflow!r} has no model or agent node to give the follow-up to; "
                                 "create a new ticket instead")
    return t, FollowUpRecord(ticket_id=ticket_id, at_ms=0, author=author or principal, source=source,
                             text=_clip_utf8(text, MAX_INPUT_BYTES), path=path[:500], line=max(0, int(line or 0)),
                             url=url[:500])


def _brief(f: FollowUpRecord) -> dict[str, Any]:
    return {"source": f.source, "author": f.author, "path": f.path, "line": f.line, "url": f.url}


async def follow_up(engine: Any, ticket_id: str, text: str, *, principal: str, author: str = "",
                    source: str = "operator", path: str = "", line: int = 0, url: str = "") -> Any:
    """Record `text` for the ticket's next run and re-open it. Returns the ticket's view.
    Follow-ups from GitHub still waiting for a re-open (`FollowUpQueue`) go with it."""
    _, rec = _record(engine, ticket_id, text, principal=principal, author=author, source=source, path=path,
                     line=line, url=url)

    def record(_t: TicketRecord, at_ms: int) -> None:
        rec.at_ms = at_ms
        engine.store.followups.add_followup(rec)
        engine.store.followups.give_followups(ticket_id, at_ms)

    payload = {"followup": _brief(rec)}
    return await engine.reopen(ticket_id, principal, "follow-up", payload=payload, on_reopen=record)


def final_refusal(engine: Any, t: TicketRecord) -> str:
    """Why the ticket can never be re-opened with a follow-up ("" when it can, now or later)."""
    pr = engine.store.prs.get_pr(t.id)
    if pr is not None and pr.state == "merged":
        return f"its pull request {pr.number} is merged; open a new issue for more changes"
    if t.workflow not in engine.config.workflows or t.workspace not in engine.config.workspaces:
        return f"its workflow {t.workflow!r} or workspace {t.workspace!r} is no longer configured"
    return ""


class FollowUpQueue:
    """Follow-ups from GitHub: stored pending, gathered in a settle window into
    one re-open, queued while the ticket runs, never dropped silently."""

    def __init__(self, engine: Any, *, settle_s: float = SETTLE_S,
                 reply: Callable[[str, str], Awaitable[None]] | None = None,
                 stale_ci: Callable[[str, str, str], Awaitable[None]] | None = None) -> None:
        self.engine = engine
        self.store = engine.store
        self.settle_s = max(0.0, settle_s)
        self.reply = reply          # (ticket id, text): a comment on the ticket's pull request
        self.stale_ci = stale_ci    # (ticket id, failed head, new head): a CI round was dropped as stale
        self._drivers: dict[str, asyncio.Task[None]] = {}
        self._first: dict[str, float] = {}    # ticket -> first arrival of the open window (monotonic)
        self._last: dict[str, float] = {}     # and the latest
        self._wake: dict[str, asyncio.Event] = {}
        self._closed = False
        engine.transitions.listeners.append(self.changed)

    # -- in -----------------------------------------------------------------------

    def submit(self, ticket_id: str, text: str, *, principal: str, author: str = "", source: str,
               path: str = "", line: int = 0, url: str = "", delivery: str = "", review_id: int = 0) -> str:
        """Store a follow-up for the ticket's next re-open and say how it was
        taken (STARTS, GATHERED, QUEUED_NEXT); an AfeError when it is refused
        (said on the ticket too)."""
        detail = {"source": source, "author": author or principal, "path": path[:500], "line": line,
                  "url": url[:500], "delivery": delivery, "review_id": review_id}
        try:
            t, rec = _record(self.engine, ticket_id, text, principal=principal, author=author, source=source,
                             path=path, line=line, url=url)
            refusal = final_refusal(self.engine, t)
            if refusal:
                raise FailedPrecondition(f"ticket {ticket_id} cannot take a follow-up: {refusal}")
        except AfeError as exc:
            self._event(ticket_id, "followup.refused", {**detail, "reason": exc.message})
            raise
        waiting = self.store.followups.pending_followups(ticket_id)
        rec.state = FOLLOWUP_PENDING
        rec.at_ms = now_ms()
        self.store.followups.add_followup(rec)
        if t.state == QUEUED and t.reopened_at_ms and not self.engine.running_here(ticket_id):
            how = GATHERED          # a re-run not started yet: it takes this one at once
        elif t.state in TERMINAL or t.state == WAITING_APPROVAL:
            how = GATHERED if waiting else STARTS
        else:
            how = QUEUED_NEXT
        self._event(ticket_id, "followup.received", {**detail, "taken": how, "waiting": len(waiting) + 1})
        now = time.monotonic()
        self._first.setdefault(ticket_id, now)
        self._last[ticket_id] = now
        self._ensure(ticket_id)
        return how

    def changed(self, ticket_id: str, state: str) -> None:
        """A Transitions listener: a ticket with queued follow-ups may be re-opened now."""
        ev = self._wake.get(ticket_id)
        if ev is not None:
            ev.set()

    def start(self) -> None:
        """Resume the follow-ups a stopped scheduler still owed a re-open."""
        for tid in self.store.followups.tickets_with_pending_followups():
            self._ensure(tid)

    async def close(self) -> None:
        self._closed = True
        tasks = list(self._drivers.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- the re-open ---------------------------------------------------------------

    def _ensure(self, ticket_id: str) -> None:
        self._wake.setdefault(ticket_id, asyncio.Event()).set()
        if ticket_id in self._drivers or self._closed:
            return
        self._drivers[ticket_id] = asyncio.get_running_loop().create_task(self._drive(ticket_id),
                                                                          name=f"followups-{ticket_id}")

    async def _wait(self, ticket_id: str, timeout: float) -> None:
        """Until woken (an arrival, a state change) or `timeout`. Not asyncio.wait_for:
        on Python 3.11 it swallows a cancel that comes as the event is set, and
        `close` would then wait out a whole settle window."""
        ev = self._wake.setdefault(ticket_id, asyncio.Event())
        waiter = asyncio.ensure_future(ev.wait())
        try:
            await asyncio.wait({waiter}, timeout=max(0.0, timeout))
        finally:
            waiter.cancel()
        ev.clear()
        if self._closed:
            raise asyncio.CancelledError

    async def _settle(self, ticket_id: str) -> None:
        """Until nothing more came for settle_s (at most MAX_GATHER_S after the
        first), or at once for a re-run that has not started yet."""
        while True:
            first, last = self._first.get(ticket_id), self._last.get(ticket_id)
            t = self.store.tickets.get(ticket_id)
            if first is None or last is None or t is None or (t.state == QUEUED and t.reopened_at_ms):
                return
            left = min(last + self.settle_s, first + max(MAX_GATHER_S, self.settle_s)) - time.monotonic()
            if left <= 0:
                return
            await self._wait(ticket_id, left)

    async def _drive(self, ticket_id: str) -> None:
        """Re-open the ticket with its pending follow-ups until none is left."""
        me = asyncio.current_task()
        try:
            while True:
                await self._settle(ticket_id)
                pending = self.store.followups.pending_followups(ticket_id)
                if not pending:
                    return              # no await from this check to the driver's removal (finally)
                t = self.store.tickets.get(ticket_id)
                refusal = final_refusal(self.engine, t) if t is not None else "the ticket does not exist"
                if refusal:
                    await self._drop(ticket_id, refusal)
                    continue
                if await self._drop_stale(ticket_id, pending):
                    continue
                try:
                    await self._reopen(ticket_id, pending)
                except FailedPrecondition as exc:       # running, tearing down: when it waits or has ended
                    log.debug("ticket %s: %d follow-up(s) wait: %s", ticket_id, len(pending), exc.message)
                    await self._wait(ticket_id, RECHECK_S)
                except Exception:
                    log.exception("ticket %s: re-open with %d follow-up(s) failed; trying again", ticket_id,
                                  len(pending))
                    await self._wait(ticket_id, RECHECK_S)
        finally:
            if self._drivers.get(ticket_id) is me:
                del self._drivers[ticket_id]
                self._first.pop(ticket_id, None)
                self._last.pop(ticket_id, None)
                self._wake.pop(ticket_id, None)

    async def _reopen(self, ticket_id: str, pending: list[FollowUpRecord]) -> None:
        given: list[int] = []

        def give(_t: TicketRecord, at_ms: int) -> None:
            given.append(self.store.followups.give_followups(ticket_id, at_ms))

        first = pending[0]
        principal = f"github:{first.author}" if first.source.startswith("github:") else first.author
        await self.engine.reopen(ticket_id, principal, "follow-up", on_reopen=give,
                                 payload={"followup": _brief(first), "followups": [_brief(f) for f in pending]})
        self._first.pop(ticket_id, None)
        self._last.pop(ticket_id, None)
        log.info("ticket %s: re-opened with %d follow-up(s)", ticket_id, sum(given))

    async def _drop(self, ticket_id: str, reason: str) -> None:
        dropped = self.store.followups.drop_followups(ticket_id)
        if not dropped:
            return
        self._event(ticket_id, "followup.dropped", {"reason": reason, "count": len(dropped),
                                                    "followups": [_brief(f) for f in dropped]})
        log.warning("ticket %s: %d follow-up(s) dropped: %s", ticket_id, len(dropped), reason)
        if self.reply is not None:
            who = sorted({f.author for f in dropped})
            text = (f"afe did not act on {len(dropped)} follow-up(s) (from {', '.join(who)}) for ticket "
                    f"`{ticket_id}`: {reason}.")
            try:
                await self.reply(ticket_id, text)
            except Exception:   # noqa: BLE001 - said on the ticket and in the log already
                log.warning("ticket %s: the reply about dropped follow-ups could not be posted", ticket_id)

    async def _drop_stale(self, ticket_id: str, pending: list[FollowUpRecord]) -> bool:
        """CI rounds' follow-ups about a head that is no longer the pull request's are dropped (said on
        the ticket, and by `stale_ci` on the pull request) just before a re-open would give them; True
        when any was."""
        dropped = drop_stale_ci(self.store, ticket_id, pending)
        for d in dropped:
            self._event(ticket_id, "followup.dropped", {
                "reason": d["reason"], "count": d["count"], "stale_head": d["sha"], "head": d["head"],
                "followups": [_brief(f) for f in pending if failed_head(f.source, f.text) == d["sha"]]})
            log.info("ticket %s: %s", ticket_id, d["reason"])
            if self.stale_ci is not None:
                try:
                    await self.stale_ci(ticket_id, d["sha"], d["head"])
                except Exception:   # noqa: BLE001 - said on the ticket and in the log already
                    log.warning("ticket %s: the comment of the dropped CI round could not be corrected", ticket_id)
        return bool(dropped)

    def _event(self, ticket_id: str, type_: str, payload: dict[str, Any]) -> None:
        if self.store.tickets.get(ticket_id) is None:
            return
        self.engine.events.append(ticket_id, type_, payload)
        self.engine.events.flush()
