"""Warm sandboxes: a ticket whose sandbox was made before it was.

A *profile* is everything fixed when a sandbox is created: its Workspace and
the `SandboxSpec` of a workflow of that Workspace (image, limits, disk cap,
egress allowlist, declared env NAMES, relay or not). For each profile the
pool keeps `sandbox.pool` sandboxes ready, at most `cap` in all, refilled in
the background.

R12 with labels that cannot change after creation: each pooled sandbox is
made for a *reserved ticket id* (`new_ticket_id()`, never shown, never given
twice). The workspace is prepared for it by the credential broker and the
sandbox created for it by the sandbox broker through the ordinary calls
(PrepareWorkspace, OpenRelay, CreateSandbox), so the container, its proxy and
its network carry `afe.ticket=<that id>` from birth, `/workspace` is
`<data>/workspaces/<that id>` (with its disk image in `mount` mode, R34) and
the relay folder is that id's (R32). A new ticket of that profile is *given*
the reserved id (`claim`, in the same synchronous step that stores it): its
run's own PrepareWorkspace and CreateSandbox then find everything made, and
its teardown destroys it like any sandbox. So a pooled sandbox serves
exactly one ticket and carries that ticket's label.

Never leaks: each reserved id is marked (`<data>/pool/<id>`, an empty file)
before anything is made for it and unmarked once a ticket owns it or it is
torn down. Reconcile counts the pool's ids as live (`ids`); a restarted
scheduler tears down every marked id that is no ticket (`recover`), and the
sandbox broker's reconcile removes the sandboxes of ids no scheduler holds.
`close` (the scheduler stopping, `afe up` stopped) tears the pool down.

Freshness: a checkout is made from the base branch at fill time; entries
older than `max_age_s` are replaced, so a ticket never starts from a base
older than that (a fresh ticket fetches at its start).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services.common.config.model import Config, Workflow, Workspace
from services.common.errors import AfeError, NotFound
from services.common.layout import check_ticket_id, new_ticket_id
from services.common.observability.metrics import SchedulerMetrics

from .brokers import CredentialBroker, SandboxBroker
from .spec import SANDBOX_KINDS, relay_mcp, relay_models, sandbox_spec

log = logging.getLogger(__name__)

DEFAULT_CAP = 8             # `afe up --sandbox-pool-max`: warm sandboxes in all, every workspace together
MAX_AGE_S = 600.0           # a warm checkout older than this is replaced (the base branch may have moved)
RETRY_S = (1.0, 30.0)       # back-off after a failed fill (first, max)
CLOSE_S = 5.0               # what a stopping scheduler spends removing its pool

Key = tuple[str, bytes]     # (workspace, SandboxSpec serialized deterministically)


@dataclass
class _Profile:
    key: Key
    workspace: Workspace
    workflow: Workflow        # one workflow of the profile (its relay Models and budget)
    spec: spb.SandboxSpec
    size: int


@dataclass
class _Entry:
    ticket_id: str
    made_at: float = field(default_factory=time.monotonic)


def profile_key(config: Config, workspace: Workspace, workflow: Workflow) -> Key | None:
    """The profile of a ticket of `workflow` on `workspace`; None when it needs no sandbox."""
    if not any(n.kind in SANDBOX_KINDS for n in workflow.nodes):
        return None
    spec = sandbox_spec(config, workflow, workspace)
    return workspace.name, spec.SerializeToString(deterministic=True)


class SandboxPool:
    def __init__(self, config: Config, sandbox: SandboxBroker, credentials: CredentialBroker,
                 marks: Path | None, *, cap: int = DEFAULT_CAP, max_age_s: float = MAX_AGE_S,
                 is_ticket: Callable[[str], bool] = lambda _t: False) -> None:
        """`marks` is a private folder of the scheduler's data dir (None: no
        pool); `is_ticket(id)` says whether the store holds that ticket."""
        self.config = config
        self.sandbox = sandbox
        self.credentials = credentials
        self.marks = marks
        self.cap = max(0, cap)
        self.max_age_s = max_age_s
        self.is_ticket = is_ticket
        self.profiles = self._profiles()
        self._ready: dict[Key, list[_Entry]] = {k: [] for k in self.profiles}
        self._making: dict[str, Key] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._teardowns: set[asyncio.Task[None]] = set()
        self.filled = asyncio.Event()       # every profile is at its size (tests, the bench)

    @property
    def enabled(self) -> bool:
        return self.marks is not None and self.cap > 0 and bool(self.profiles)

    def _profiles(self) -> dict[Key, _Profile]:
        out: dict[Key, _Profile] = {}
        for wf in sorted(self.config.workflows.values(), key=lambda w: w.name):
            ws = self.config.workspaces.get(wf.workspace or "")
            if ws is None or ws.sandbox.pool <= 0:
                continue
            key = profile_key(self.config, ws, wf)
            if key is not None and key not in out:
                out[key] = _Profile(key, ws, wf, sandbox_spec(self.config, wf, ws), ws.sandbox.pool)
        return out

    # ---- what the engine asks --------------------------------------------------

    def ids(self) -> set[str]:
        """Every reserved id the pool holds (ready or being made): live for reconcile."""
        return {e.ticket_id for es in self._ready.values() for e in es} | set(self._making)

    def size(self) -> int:
        return sum(len(es) for es in self._ready.values())

    def wanted(self) -> int:
        """What the pool aims to hold: every profile's size, at most the cap (0 when disabled)."""
        return min(self.cap, sum(p.size for p in self.profiles.values())) if self.enabled else 0

    def export(self, metrics: SchedulerMetrics | None) -> None:
        """`afe_sandbox_pool_ready` and `afe_sandbox_pool_wanted`, read at each scrape."""
        if metrics is not None:
            metrics.pool_ready.set_function(self.size)
            metrics.pool_wanted.set_function(self.wanted)

    def claim(self, workspace: Workspace, workflow: Workflow) -> str | None:
        """A ready reserved id of this ticket's profile (removed from the pool), or None."""
        if not self.enabled:
            return None
        key = profile_key(self.config, workspace, workflow)
        ready = self._ready.get(key) if key is not None else None
        now = time.monotonic()
        while ready:
            e = ready.pop(0)
            if now - e.made_at <= self.max_age_s:
                self.filled.clear()
                self._wake.set()
                return e.ticket_id
            self._retire(e.ticket_id, workspace.name)
        return None

    def claimed(self, ticket_id: str) -> None:
        """The store holds the ticket now: its teardown is the ticket's."""
        self._unmark(ticket_id)

    def unclaim(self, ticket_id: str, workspace: str) -> None:
        """A claimed id whose ticket was not stored after all: tear it down."""
        self._retire(ticket_id, workspace)

    # ---- lifecycle -------------------------------------------------------------

    async def recover(self) -> None:
        """After a restart: every marked id that is not a ticket is torn down
        (the sandbox broker's reconcile has removed its containers already)."""
        if self.marks is None or not self.marks.is_dir():
            return
        for p in sorted(self.marks.iterdir()):
            tid = p.name
            try:
                check_ticket_id(tid)
            except AfeError:
                p.unlink(missing_ok=True)
                continue
            if self.is_ticket(tid):
                self._unmark(tid)
                continue
            ws = p.read_text().strip()
            if await self._teardown(tid, ws):
                self._unmark(tid)

    def start(self) -> None:
        if self.enabled and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sandbox-pool")

    async def close(self) -> None:
        """Stop filling and tear down every unclaimed sandbox (bounded by CLOSE_S;
        what is left is torn down by the next start's `recover`)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        entries = [(e.ticket_id, k[0]) for k, es in self._ready.items() for e in es]
        for es in self._ready.values():
            es.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_S):
                if self._teardowns:
                    await asyncio.gather(*self._teardowns, return_exceptions=True)
                for tid, ws in entries:
                    if await self._teardown(tid, ws):
                        self._unmark(tid)

    # ---- filling ---------------------------------------------------------------

    async def _run(self) -> None:
        delay = RETRY_S[0]
        while True:
            self._wake.clear()
            failed = False
            for p in self.profiles.values():
                ready = self._ready[p.key]
                for e in [e for e in ready if time.monotonic() - e.made_at > self.max_age_s]:
                    ready.remove(e)
                    self._retire(e.ticket_id, p.workspace.name)
                while len(ready) < p.size and self.size() + len(self._making) < self.cap:
                    if not await self._fill(p):
                        failed = True
                        break
            if not failed:
                delay = RETRY_S[0]
                if all(len(self._ready[k]) >= p.size for k, p in self.profiles.items()) or \
                        self.size() >= self.cap:
                    self.filled.set()
            wait = delay if failed else min(self.max_age_s / 4, 60.0)
            if failed:
                delay = min(delay * 2, RETRY_S[1])
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wake.wait()

    async def _fill(self, p: _Profile) -> bool:
        """Make one warm sandbox for `p`: the same calls, in the same order, as a ticket's run."""
        tid = new_ticket_id()
        self._making[tid] = p.key
        self._mark(tid, p.workspace.name)
        try:
            await self.credentials.prepare(tid, p.workspace.name)
            if p.spec.relay:   # the relay folder must exist before the sandbox mounts it (R32)
                await self.credentials.open_relay(tid, relay_models(self.config, p.workflow),
                                                  p.workflow.max_tokens, relay_mcp(self.config, p.workflow))
            await self.sandbox.create(tid, p.spec)
        except asyncio.CancelledError:
            self._making.pop(tid, None)
            self._retire(tid, p.workspace.name)
            raise
        except AfeError as exc:
            self._making.pop(tid, None)
            log.warning("warm sandbox for workspace %s not made (retried): %s", p.workspace.name, exc)
            self._retire(tid, p.workspace.name)
            return False
        self._making.pop(tid, None)
        self._ready[p.key].append(_Entry(tid))
        log.info("warm sandbox %s ready for workspace %s", tid, p.workspace.name)
        return True

    # ---- teardown --------------------------------------------------------------

    def _retire(self, ticket_id: str, workspace: str) -> None:
        task = asyncio.get_running_loop().create_task(self._teardown_unmark(ticket_id, workspace))
        self._teardowns.add(task)
        task.add_done_callback(self._teardowns.discard)

    async def _teardown_unmark(self, ticket_id: str, workspace: str) -> None:
        if await self._teardown(ticket_id, workspace):
            self._unmark(ticket_id)

    async def _teardown(self, ticket_id: str, workspace: str) -> bool:
        ok = True
        try:
            await self.sandbox.destroy(ticket_id)
        except AfeError as exc:
            ok = False
            log.warning("warm sandbox %s: could not remove it (retried at the next start): %s", ticket_id, exc)
        try:
            await self.credentials.release(ticket_id, workspace)
        except NotFound:
            pass
        except AfeError as exc:
            ok = False
            log.warning("warm sandbox %s: could not release its workspace: %s", ticket_id, exc)
        return ok

    def _mark(self, ticket_id: str, workspace: str) -> None:
        if self.marks is None:
            return
        self.marks.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.marks / ticket_id, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(workspace + "\n")

    def _unmark(self, ticket_id: str) -> None:
        if self.marks is not None:
            (self.marks / ticket_id).unlink(missing_ok=True)
