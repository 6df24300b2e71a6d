"""The polling mode of the GitHub intake (docs/GITHUB.md): the repository's
events read through the credential broker, each new one handed to the same
path as a webhook delivery (github_intake.py)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from services.common.config.model import Workspace
from services.common.errors import AfeError

from ..store.github_records import PollCursor
from .intake import POLL_ERROR_BACKOFF_S, POLL_INTERVAL_S, GitHubIntake
from .outcome import Outcome

log = logging.getLogger(__name__)

NOTHING_SEEN = "0"      # the cursor of a listing that held no event: every later event is new


class Poller:
    """The polling mode: for each workspace with a `poll: true` Trigger, one
    conditional request at a time (ETag; a 304 costs no rate limit). The
    earliest next request is stored with the cursor (ETag, newest event id):
    never sooner than `interval_s` or GitHub's X-Poll-Interval, and after a
    rate limit not before X-RateLimit-Reset or Retry-After, also across a
    restart. The first listing of a workspace only sets the cursor: polling
    starts from now, never from GitHub's 90 days of history."""

    def __init__(self, intake: GitHubIntake, interval_s: float = POLL_INTERVAL_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.intake = intake
        self.interval_s = interval_s
        self.clock = clock
        self._task: asyncio.Task[None] | None = None

    def workspaces(self) -> list[Workspace]:
        cfg = self.intake.config
        names = sorted({t.workspace for t in cfg.triggers.values() if t.poll})
        return [cfg.workspaces[n] for n in names if n in cfg.workspaces]

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    def cursor(self, workspace: str) -> PollCursor:
        """Where the polling of `workspace` stands, as stored."""
        return self.intake.store.intake.poll_cursor(workspace)

    def _save(self, workspace: str, cursor: PollCursor, now_ms: int) -> None:
        self.intake.store.intake.put_poll_cursor(workspace, cursor, now_ms)

    async def poll_once(self, ws: Workspace) -> tuple[list[Outcome], float]:
        """One poll of `ws`: (outcomes of the new events, seconds to wait before the next)."""
        cur = self.cursor(ws.name)
        r = await self.intake.credentials.repo_events(ws.name, cur.etag, cur.last_event_id)
        now_ms = self._now_ms()
        next_ms = self.next_poll_ms(r, now_ms)
        wait = (next_ms - now_ms) / 1000
        if r.not_modified or r.rate_limited:
            # Rate limited: even the pages read before the refusal wait, so no event between is passed over.
            if r.rate_limited:
                log.warning("github polling of workspace %s is rate limited; next poll at %s", ws.name,
                            _utc(next_ms))
            self._save(ws.name, PollCursor(cur.etag, cur.last_event_id, next_ms), now_ms)
            if r.not_modified:
                await self._poll_ci(ws, next_ms)
            return [], wait
        events = _ordered(r.events)
        if not cur.last_event_id:       # the first listing: polling starts from now
            self._save(ws.name, PollCursor(r.etag, events[-1].id if events else NOTHING_SEEN, next_ms), now_ms)
            await self._poll_ci(ws, next_ms)
            return [], wait
        if not r.complete:
            log.warning("github polling of workspace %s: more events than GitHub lists came after event %s; "
                        "the ones before the oldest listed are lost (use webhooks for so busy a repository)",
                        ws.name, cur.last_event_id)
        outcomes = await self._handle(ws, cur, r.etag, events, next_ms, now_ms)
        await self._poll_ci(ws, next_ms)
        return outcomes, wait

    async def _poll_ci(self, ws: Workspace, next_ms: int) -> None:
        """The Events API carries no check runs: the heads of afe's pull requests are asked (ci.py),
        as often as the events; a rate limit pushes the next poll back by POLL_ERROR_BACKOFF_S at least."""
        if not await self.intake.poll_ci(ws):
            cur = self.cursor(ws.name)
            at = max(next_ms, self._now_ms() + int(POLL_ERROR_BACKOFF_S * 1000))
            log.warning("github polling of workspace %s: CI checks rate limited; next poll at %s", ws.name, _utc(at))
            self._save(ws.name, PollCursor(cur.etag, cur.last_event_id, at), self._now_ms())

    def next_poll_ms(self, r: Any, now_ms: int) -> int:
        """The earliest next request GitHub allows: the poll interval, and
        after a limit its reset (X-RateLimit-Remaining: 0) or Retry-After."""
        at = now_ms + int(max(self.interval_s, float(r.poll_interval_s or 0)) * 1000)
        if r.rate_limit_reset_ms:
            at = max(at, r.rate_limit_reset_ms)
        if r.retry_after_s:
            at = max(at, now_ms + r.retry_after_s * 1000)
        return at

    async def _handle(self, ws: Workspace, cur: PollCursor, etag: str, events: list[Any], next_ms: int,
                      now_ms: int) -> list[Outcome]:
        """The events newer than the cursor to the intake, oldest first. The
        cursor follows each handled one; when one fails (its claim released
        by the intake) it stops there with the old ETag, so the next poll,
        not before `next_ms`, lists it again."""
        done = cur.last_event_id
        outcomes: list[Outcome] = []
        try:
            for e in events:
                if int(e.id) > _number(done):
                    outcomes.append(await self.intake.poll_event(ws, e))
                    done = e.id
        finally:
            whole = not events or _number(done) >= int(events[-1].id)       # every listed event handled
            self._save(ws.name, PollCursor(etag if whole else cur.etag, done, next_ms), now_ms)
        return outcomes

    async def poll_due(self) -> list[str]:
        """Poll every workspace whose stored next poll has come; their names."""
        polled = []
        for ws in self.workspaces():
            if self.cursor(ws.name).next_poll_ms > self._now_ms():
                continue
            polled.append(ws.name)
            try:
                await self.poll_once(ws)
            except AfeError as exc:
                self._back_off(ws, exc)
        return polled

    def _back_off(self, ws: Workspace, exc: AfeError) -> None:
        """After a failed poll: the next one in POLL_ERROR_BACKOFF_S, or later if GitHub asked."""
        cur = self.cursor(ws.name)
        at = max(cur.next_poll_ms, self._now_ms() + int(POLL_ERROR_BACKOFF_S * 1000))
        log.warning("github polling of workspace %s failed; next try at %s: %s", ws.name, _utc(at), exc)
        self._save(ws.name, PollCursor(cur.etag, cur.last_event_id, at), self._now_ms())

    def _sleep_s(self) -> float:
        """Until the next due poll: at least 1 s, at most `interval_s` (a clock step cannot stall polling)."""
        now = self._now_ms()
        due = min((self.cursor(ws.name).next_poll_ms for ws in self.workspaces()), default=now)
        return min(max(1.0, (due - now) / 1000), max(1.0, self.interval_s))

    async def _loop(self) -> None:
        while True:
            await self.poll_due()
            await asyncio.sleep(self._sleep_s())

    def start(self) -> None:
        if self.workspaces() and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def _ordered(listed: Iterable[Any]) -> list[Any]:
    """The listed events with a numeric id, oldest first, each once (pages overlap while events arrive)."""
    by_id = {e.id: e for e in listed if e.id.isdigit()}
    return sorted(by_id.values(), key=lambda e: int(e.id))


def _number(event_id: str) -> int:
    return int(event_id) if event_id.isdigit() else 0


def _utc(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
