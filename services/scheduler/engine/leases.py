"""Leases: several schedulers on one PostgreSQL store (docs/SCALE.md, R37, R45).

`Leases` owns everything this scheduler knows about the tickets it drives on
a shared store: the fence of each claim (kept in `store.leases.fences`, where the
store's checks read it), when each lease is valid until by this process's
own clock, which tickets were lost here, and the two loops that keep them:

- `renew_loop` renews the held leases three times within the time a renewal
  is trusted (lease - margin) and hears what other schedulers asked of them
  (a cancel, an approval);
- `takeover_loop` claims live tickets whose owner's lease expired on the
  database's clock (it died, hangs, or fenced itself) and re-claims the
  tickets this scheduler fenced itself off once their run has stopped.

Self-fencing (R45): the local monotonic time at which each successful
renewal (or claim) was *sent* is recorded; the ticket is valid here until
sent + lease_s - margin. The database's lease ends no earlier than
sent + lease_s (the statement runs after it was sent), so once the local
validity passes without a newer success this scheduler stops acting for the
ticket — `check_lease` fails without asking anyone, the run is stopped, the
ticket is lost here — before any other scheduler can take it over.

A lost lease keeps its fence entry, marked lost (`mark_lost`: the fence
negated), so every later write of the old attempt fails the store's
owner/fence check; only a release (the ticket ended here) or `forget`
(its run stopped) removes it. On an unshared store (SQLite) this scheduler
owns every ticket: nothing is renewed, nothing expires.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable

from services.common.observability.metrics import SchedulerMetrics

from ..store.base import RUNNING, WAITING_APPROVAL, Lease, LeaseLost, TicketRecord
from ..store.store import Store
from ..store.worker import run_in_store, store_failing

log = logging.getLogger(__name__)

LEASE_S = 10.0                     # a live ticket's lease (docs/SCALE.md); see Leases.renew_interval
HELD = (RUNNING, WAITING_APPROVAL)  # states a scheduler drives a ticket in (takeover takes them over)
WATCH_S = 0.1                      # how often the self-fencing watch looks at the held leases (at most)

TAKEN_OVER = "taken_over"          # why a lease was lost here: another scheduler claimed the ticket
SELF_FENCED = "self_fenced"        # or its renewals stopped succeeding and this scheduler stopped first


def scheduler_id() -> str:
    """A new id for this scheduler process (host, pid, random): the owner of its leases."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def self_fence_margin(lease_s: float) -> float:
    """How long before its lease ends (by the local clock) an owner stops acting: a fifth of the
    lease, at least 1 s, at most half of it (a lease of a few seconds still leaves time to act)."""
    return min(max(1.0, lease_s / 5), lease_s / 2)


def mark_lost(store: Store, ticket_id: str) -> None:
    """Keep the ticket's fence entry, marked lost: every later write of it fails the store's check
    (store/leases.py `Leases.lose`)."""
    store.leases.lose(ticket_id)


def drop_fence(store: Store, ticket_id: str) -> None:
    """The lost ticket's run has stopped: its entry goes (nothing of that run writes any more)."""
    store.leases.forget(ticket_id)


class Leases:
    """The leases of the tickets this scheduler drives: claim, check (R37), renew, self-fence (R45),
    take over. `on_lost(ticket, why, reason)` is called once when a held ticket is lost here (the
    engine stops its run); `why` is for people, `reason` TAKEN_OVER or SELF_FENCED."""

    def __init__(self, store: Store, *, owner: str, lease_s: float, metrics: SchedulerMetrics | None,
                 on_lost: Callable[[str, str, str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.owner = owner
        store.owner = owner
        self.lease_s = lease_s
        self.margin = self_fence_margin(lease_s)
        self.metrics = metrics
        self.on_lost = on_lost
        self.clock = clock
        # False only in tests' positive controls: `fencing` skips the check before a side effect (R37),
        # `self_fencing` lets an owner act on after its renewals stopped succeeding (R45).
        self.fencing = True
        self.self_fencing = True
        self._valid_until: dict[str, float] = {}   # ticket -> local monotonic time its lease is trusted until
        self._lost: dict[str, str] = {}            # ticket -> TAKEN_OVER | SELF_FENCED, lost here
        self._lost_fence: dict[str, int] = {}      # ticket -> the fence its lost attempt held
        self._reclaim: set[str] = set()            # self-fenced here: claimed again once its run stopped

    @property
    def shared(self) -> bool:
        return self.store.shared

    @property
    def lease_ms(self) -> int:
        return int(self.lease_s * 1000)

    @property
    def renew_interval(self) -> float:
        """Renewals are sent three times within the time a renewal is trusted (lease - margin), so
        two may be slow or fail before this scheduler fences itself off."""
        return (self.lease_s - self.margin) / 3

    # ---- one ticket ------------------------------------------------------------------

    def claim(self, ticket_id: str, states: tuple[str, ...]) -> bool:
        """Take the ticket for this scheduler (a new fence) when it is in `states` and free;
        True when this scheduler drives it now."""
        sent = self.clock()
        fence = self.store.leases.claim(ticket_id, states, self.lease_ms)
        if fence is None:
            return False
        self._lost.pop(ticket_id, None)
        self._lost_fence.pop(ticket_id, None)
        self._reclaim.discard(ticket_id)
        self._valid_until[ticket_id] = sent + self.lease_s - self.margin
        return True

    def valid_for(self, ticket_id: str) -> float:
        """Seconds this scheduler may still act for the ticket by its own clock (inf: unshared store)."""
        if not self.shared:
            return float("inf")
        return self._valid_until.get(ticket_id, 0.0) - self.clock()

    def holds(self, ticket_id: str) -> bool:
        """This scheduler still drives the ticket: not lost here, its lease trusted by the local clock
        (self-fencing) and held with its fence by the database's."""
        if ticket_id in self._lost:
            return False
        if not self.shared:
            return True
        fence = self.store.leases.fences.get(ticket_id)
        if fence is None or fence <= 0:
            return False
        if self.self_fencing and self.valid_for(ticket_id) <= 0:
            self.lose(ticket_id, SELF_FENCED)
            return False
        return self.store.leases.holds(ticket_id, fence)

    def check(self, ticket_id: str) -> None:
        """Right before a side effect (a push, a pull request, a merge, a comment): this scheduler
        still holds the ticket, or `LeaseLost` (R37, R45)."""
        if self.fencing and not self.holds(ticket_id):
            self.lose(ticket_id, TAKEN_OVER)
            raise LeaseLost(ticket_id)

    def fence(self, ticket_id: str) -> int:
        """The fence this scheduler holds the ticket with (0: an unshared store, nothing to fence)."""
        return max(0, self.store.leases.fences.get(ticket_id, 0)) if self.fencing and self.shared else 0

    def lost(self, ticket_id: str) -> bool:
        return ticket_id in self._lost

    def lost_reason(self, ticket_id: str) -> str:
        return self._lost.get(ticket_id, "")

    def lost_fence(self, ticket_id: str) -> int:
        """The fence the lost attempt held (0: unknown, or an unshared store)."""
        return self._lost_fence.get(ticket_id, 0)

    def lose(self, ticket_id: str, reason: str, *, notify: bool = True) -> None:
        """The ticket is no longer this scheduler's to drive: its fence is kept, marked lost (every
        later write fails), and `on_lost` stops its run (not with `notify` False: the run is what
        found out, and stops by itself). Once per loss."""
        if ticket_id in self._lost:
            return
        self._lost[ticket_id] = reason
        self._lost_fence[ticket_id] = max(0, self.store.leases.fences.get(ticket_id, 0))
        mark_lost(self.store, ticket_id)
        self._valid_until.pop(ticket_id, None)
        if reason == SELF_FENCED:
            self._reclaim.add(ticket_id)
        if self.metrics is not None:
            self.metrics.lease_renew_failures.labels(reason="self_fenced" if reason == SELF_FENCED
                                                     else "lost").inc()
        why = (f"its lease could not be renewed within {self.lease_s - self.margin:g} s of the last renewal, "
               f"so it stopped {self.margin:g} s before the lease could end (self-fencing, R45)"
               if reason == SELF_FENCED else "another scheduler took it over (its lease expired)")
        log.warning("ticket %s: stopped here: %s", ticket_id, why)
        if notify:
            self.on_lost(ticket_id, why, reason)

    def forget(self, ticket_id: str) -> None:
        """The lost ticket's run has stopped: drop its fence entry (nothing of that run writes any more)."""
        drop_fence(self.store, ticket_id)
        self._valid_until.pop(ticket_id, None)

    def release(self, ticket_id: str) -> None:
        """The ticket ended here: give it up (another scheduler may claim it at once)."""
        self.store.leases.release(ticket_id)
        self._valid_until.pop(ticket_id, None)
        self._lost.pop(ticket_id, None)
        self._lost_fence.pop(ticket_id, None)
        self._reclaim.discard(ticket_id)

    def release_all(self) -> None:
        """The scheduler stops: give up every lease it still holds (lost ones run out by themselves)."""
        for tid in list(self.store.leases.fences):
            try:
                self.store.leases.release(tid)
            except Exception as exc:  # noqa: BLE001 - the lease runs out by itself
                log.info("ticket %s: lease not released (%s); it runs out by itself", tid,
                         getattr(exc, "message", type(exc).__name__))

    def held(self) -> list[str]:
        """The tickets this scheduler holds a live fence of."""
        return [tid for tid, f in self.store.leases.fences.items() if f > 0 and tid not in self._lost]

    # ---- the loops -------------------------------------------------------------------

    async def renew_loop(self, heard: Callable[[Lease], None], stopping: Callable[[], bool]) -> None:
        """Renew the held leases every `renew_interval`, trusting each for lease_s - margin from
        when its renewal was sent; lose the ones another scheduler took over; hand each renewed
        lease to `heard` (a cancel or an approval asked through another scheduler)."""
        while not stopping():
            await asyncio.sleep(self.renew_interval)
            held = self.held()
            if not held:
                continue
            sent = self.clock()
            try:
                # On the store's thread (store/worker.py), waited for at most a lease: a database that
                # does not answer holds neither this loop nor the self-fencing watch.
                def renew(s: Store, ids: list[str] = held) -> list[Lease]:
                    return s.leases.renew(ids, self.lease_ms)
                renewed = {lease.ticket_id: lease
                           for lease in await run_in_store(self.store, renew, timeout=self.lease_s)}
            except Exception as exc:  # noqa: BLE001 - the database is away: the watch fences in time
                log.warning("scheduler: could not renew its tickets' leases (%s); each ticket stops here "
                            "%g s after its last renewal unless one succeeds", getattr(exc, "message",
                                                                                  type(exc).__name__),
                            self.lease_s - self.margin)
                if self.metrics is not None:
                    self.metrics.lease_renew_failures.labels(reason="error").inc()
                continue
            for tid in held:
                if tid in self._lost or self.store.leases.fences.get(tid, 0) <= 0:
                    continue          # lost meanwhile (self-fenced), or released (the ticket ended)
                lease = renewed.get(tid)
                if lease is None:
                    self.lose(tid, TAKEN_OVER)
                    continue
                self._valid_until[tid] = max(self._valid_until.get(tid, 0.0), sent + self.lease_s - self.margin)
                heard(lease)

    async def watch_loop(self, stopping: Callable[[], bool]) -> None:
        """Self-fencing (R45): a held ticket whose lease is no longer trusted by the local clock is
        lost here at once, whatever the renewals are doing."""
        interval = min(WATCH_S, self.margin / 4)
        while not stopping():
            await asyncio.sleep(interval)
            if not self.self_fencing:
                continue
            now = self.clock()
            for tid in self.held():
                if now >= self._valid_until.get(tid, 0.0):
                    self.lose(tid, SELF_FENCED)

    async def takeover_loop(self, take: Callable[[TicketRecord, str], None], busy: Callable[[str], bool],
                            full: Callable[[], bool], stopping: Callable[[], bool],
                            kick: Callable[[], None]) -> None:
        """Claim the live tickets whose owner's lease expired (it died, hangs or fenced itself) and
        hand each to `take(ticket, why)` (TAKEN_OVER); claim again the tickets this scheduler fenced
        itself off (SELF_FENCED) once `busy(ticket)` (their old run, their unstored events) is over;
        then `kick` (queued tickets filed through other schedulers)."""
        interval = max(0.2, self.lease_s / 5)
        failing, back_at = False, float("-inf")
        while not stopping():
            await asyncio.sleep(interval)
            if store_failing(self.store):
                failing = True
                continue          # nothing to take over from a database that does not answer
            if failing:
                # The database was away for this scheduler, so most likely for the others too: their
                # leases ran out meanwhile. Each claims its own tickets again at once; theirs are
                # left to them for a lease before this one takes over what is still unclaimed.
                failing, back_at = False, self.clock()
            try:
                for tid in sorted(self._reclaim):
                    if stopping() or full():
                        break
                    if busy(tid):
                        continue
                    self._take(tid, SELF_FENCED, take)
                if self.clock() - back_at < self.lease_s:
                    kick()
                    continue
                expired = await run_in_store(self.store, lambda s: s.leases.expired(HELD), timeout=self.lease_s)
                for tid in expired:
                    if stopping() or full():
                        break
                    if busy(tid):
                        continue
                    self._take(tid, TAKEN_OVER, take)
                kick()
            except Exception as exc:  # noqa: BLE001 - the next scan tries again
                log.warning("scheduler: the takeover scan failed: %s", getattr(exc, "message", type(exc).__name__))

    def _take(self, ticket_id: str, why: str, take: Callable[[TicketRecord, str], None]) -> None:
        t = self.store.tickets.get(ticket_id)      # a store that does not answer: tried again next scan
        if t is None or t.state not in HELD or not self.claim(ticket_id, HELD):
            self._reclaim.discard(ticket_id)
            self.forget(ticket_id)      # ended meanwhile, or another scheduler claimed it first
            return
        take(self.store.tickets.get(ticket_id) or t, why)
