"""The polling mode of the GitHub intake (docs/GITHUB.md): the repository's
events read through the credential broker, each new one handed to the same
path as a webhook delivery (github_intake.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from services.common.config import Workspace
from services.common.errors import AfeError

from .github_intake import POLL_ERROR_BACKOFF_S, POLL_INTERVAL_S, GitHubIntake, Outcome

log = logging.getLogger(__name__)


class Poller:
    """The polling mode: for each workspace with a `poll: true` Trigger, one
    conditional request at a time (ETag; a 304 costs no rate limit), never
    sooner than GitHub's X-Poll-Interval, waiting out a rate limit. The
    cursor (ETag, newest event id) is stored, so a restart neither replays
    nor skips. The first poll of a workspace only sets the cursor: polling
    starts from now, never from GitHub's 90 days of history."""

    def __init__(self, intake: GitHubIntake, interval_s: float = POLL_INTERVAL_S) -> None:
        self.intake = intake
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None

    def workspaces(self) -> list[Workspace]:
        cfg = self.intake.config
        names = sorted({t.workspace for t in cfg.triggers.values() if t.poll})
        return [cfg.workspaces[n] for n in names if n in cfg.workspaces]

    async def poll_once(self, ws: Workspace) -> tuple[list[Outcome], float]:
        """One poll of `ws`: (outcomes of the new events, seconds to wait before the next)."""
        store = self.intake.store
        etag, last = store.poll_cursor(ws.name)
        r = await self.intake.credentials.repo_events(ws.name, etag)
        wait = max(self.interval_s, float(r.poll_interval_s or 0))
        now_ms = int(time.time() * 1000)
        if r.rate_limit_reset_ms and r.rate_limit_reset_ms > now_ms and (r.not_modified or not r.events):
            wait = max(wait, (r.rate_limit_reset_ms - now_ms) / 1000)
        if r.not_modified:
            return [], wait
        events = sorted((e for e in r.events if e.id.isdigit()), key=lambda e: int(e.id))
        newest = events[-1].id if events else last
        outcomes: list[Outcome] = []
        if last:
            for e in events:
                if int(e.id) > int(last or 0):
                    outcomes.append(await self.intake.poll_event(ws, e))
        store.put_poll_cursor(ws.name, r.etag, newest or "", now_ms)
        return outcomes, wait

    async def _loop(self) -> None:
        due: dict[str, float] = {}
        while True:
            now = time.monotonic()
            for ws in self.workspaces():
                if due.get(ws.name, 0.0) > now:
                    continue
                try:
                    _, wait = await self.poll_once(ws)
                except AfeError as exc:
                    log.warning("github polling of workspace %s failed; next try in %.0f s: %s", ws.name,
                                POLL_ERROR_BACKOFF_S, exc)
                    wait = POLL_ERROR_BACKOFF_S
                due[ws.name] = time.monotonic() + wait
            nxt = min(due.values(), default=now + self.interval_s)
            await asyncio.sleep(max(1.0, nxt - time.monotonic()))

    def start(self) -> None:
        if self.workspaces() and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
