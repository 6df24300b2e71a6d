"""Teardown and sandbox recovery (R12): what is left of a ticket in the
brokers goes away, even across broker crashes.

- `teardown(t)`: ReleaseWorkspace + DestroySandbox (also of `<ticket>-verify`,
  the clean-room verification's, R41); a ticket whose teardown
  failed keeps `torn_down` false in the store.
- `reconcile()`: the sandbox broker removes every sandbox, proxy and network
  whose ticket is not live; creates are held meanwhile.
- `watch_broker()`: every `interval` s the sandbox broker is asked who it is
  (every `AWAY_POLL_S` while one does not answer, so a broker that comes back
  is found within a second: its channel reconnects within about 0.6 s,
  services/common/rpc/channels.py); a new boot id (it restarted) means reconcile
  now and retry teardowns.
- `retry_loop()`: failed teardowns again, with back-off, until done.
- `final()`: a stopping scheduler's one bounded attempt at what is pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from services.common.config.model import Config
from services.common.errors import AfeError, NotFound
from services.common.layout import verify_id

from ..store.base import LIVE, TicketRecord
from ..store.store import Store
from .brokers import CredentialBroker, SandboxBroker
from .placement import AWAY

log = logging.getLogger(__name__)

TEARDOWN_RETRY_FIRST = 1.0    # seconds before the first retry of a failed teardown (doubles)
TEARDOWN_RETRY_MAX = 30.0
FINAL_TEARDOWN_S = 3.0        # what a stopping scheduler spends on teardowns still pending
AWAY_POLL_S = 0.2             # how often a sandbox broker that does not answer is asked again


class Teardowns:
    def __init__(self, store: Store, sandbox: SandboxBroker, credentials: CredentialBroker, interval: float,
                 finishing: Callable[[str], bool], config: Config | None = None) -> None:
        self.store = store
        self.sandbox = sandbox
        self.credentials = credentials
        self.interval = interval
        self.finishing = finishing            # a ticket still recording its end (its own teardown runs)
        self.config = config                  # which workflows verify (R41): their `<ticket>-verify` sandbox goes too
        self._broker_boot: str | None = None
        self.reserved: Callable[[], set[str]] = set   # reserved ids of warm sandboxes (pool.py): live too
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """A teardown failed: `retry_loop` takes it from here."""
        self._wake.set()

    async def teardown(self, t: TicketRecord) -> bool:
        """ReleaseWorkspace + DestroySandbox; True when both are done.

        The workspace is released first: the credential broker keeps its last
        state for a retry, and a disk-capped workspace's content lives in an
        image that DestroySandbox removes."""
        ok = True
        try:
            await self.credentials.release(t.id, t.workspace)
        except NotFound:
            pass
        except AfeError as exc:
            ok = False
            log.warning("ticket %s: could not release its workspace: %s", t.id, exc)
        for sid in (t.id, *self._verify_ids(t)):     # its own sandbox and its verification's (R41)
            try:
                await self.sandbox.destroy(sid)
            except NotFound:
                pass
            except AfeError as exc:
                ok = False
                log.warning("ticket %s: could not remove its sandbox %s: %s", t.id, sid, exc)
        return ok

    def _verify_ids(self, t: TicketRecord) -> tuple[str, ...]:
        wf = self.config.workflows.get(t.workflow) if self.config is not None else None
        return (verify_id(t.id),) if wf is None or wf.verify is not None else ()

    async def teardown_only(self, t: TicketRecord) -> bool:
        if await self.teardown(t):
            self.store.tickets.update(t.id, torn_down=True)
            log.info("ticket %s: teardown done", t.id)
            return True
        return False

    async def reconcile(self) -> bool:
        """Have the sandbox broker remove every sandbox, proxy and network whose
        ticket is not live. Creates wait meanwhile, so the live set read here
        cannot miss a sandbox made during the call."""
        try:
            async with self.sandbox.creates_held():
                tickets = [t.id for t in self.store.tickets.in_states(LIVE)]
                # a live ticket's verification sandbox (R41) is live too: reconcile never kills a running one
                live = tickets + [verify_id(t) for t in tickets] + sorted(self.reserved())
                r = await self.sandbox.reconcile(live)
        except AfeError as exc:
            log.warning("could not reconcile sandboxes (retried when the sandbox broker answers): %s", exc)
            return False
        self._broker_boot = r.boot_id or None
        if r.removed_tickets:
            log.info("reconcile removed sandboxes of %s ticket(s)", len(r.removed_tickets))
        return True

    async def watch_broker(self) -> None:
        """A sandbox broker that restarted (new boot id) is reconciled at once,
        and the teardowns that failed while it was away are retried."""
        away = False
        while True:
            await asyncio.sleep(min(self.interval, AWAY_POLL_S) if away else self.interval)
            try:
                boot = await self.sandbox.identify()
            except AfeError:
                away = True         # down or restarting: asked again soon, reconciled once back
                continue
            away = f"={AWAY}" in boot     # one of several brokers (placement.py) does not answer
            if boot != self._broker_boot:
                log.warning("the sandbox broker restarted; reconciling sandboxes with the live tickets")
                if await self.reconcile():
                    self._wake.set()

    async def retry_loop(self) -> None:
        """Tear down terminal tickets whose teardown failed, with back-off while a broker is away."""
        delay = TEARDOWN_RETRY_FIRST
        while True:
            self._wake.clear()
            failed = 0
            for t in self.store.tickets.terminal_not_torn_down():
                if not self.finishing(t.id) and not await self.teardown_only(t):
                    failed += 1
            wait: float | None = None
            if failed:
                wait, delay = delay, min(delay * 2, TEARDOWN_RETRY_MAX)
            else:
                delay = TEARDOWN_RETRY_FIRST
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wake.wait()

    async def final(self) -> None:
        """One bounded attempt at pending teardowns (the launcher stops the
        scheduler before the brokers)."""
        pending = self.store.tickets.terminal_not_torn_down()
        if not pending:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FINAL_TEARDOWN_S):
                for t in pending:
                    await self.teardown_only(t)
