"""A repository's events for the polling mode (docs/GITHUB.md, "Polling
set-up"): one conditional request, further pages until the caller's last
handled event, and GitHub's limits read off the answer rather than waited
out here. The scheduler stores the earliest next poll with its cursor, so
the wait survives a restart; waiting inside the broker would hold the RPC
and, capped, ask GitHub again before the time it named."""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from services.credentials.httpclient import Response, rate_limited, retry_after_s

MAX_EVENT_PAGES = 3             # GitHub keeps a repository's last 300 events, 100 to a page
UNNAMED_LIMIT_WAIT_S = 60       # GitHub: a limit that names no time asks for at least a minute


@dataclass(frozen=True)
class RepoEvent:
    id: str
    type: str
    actor_login: str
    payload_json: str
    repo: str


@dataclass(frozen=True)
class RepoEvents:
    not_modified: bool
    etag: str
    events: list[RepoEvent]
    poll_interval_s: int
    rate_limit_reset_ms: int    # X-RateLimit-Reset while X-RateLimit-Remaining is 0, else 0
    rate_limit_remaining: int   # -1: GitHub did not say
    rate_limited: bool = False
    retry_after_s: int = 0
    complete: bool = True       # the events reach the caller's last one, or GitHub has no more


@dataclass(frozen=True)
class Limits:
    """What one answer says about when to ask again."""

    poll_interval_s: int
    remaining: int
    reset_ms: int
    limited: bool
    retry_after_s: int

    @classmethod
    def of(cls, resp: Response) -> Limits:
        h = resp.headers
        remaining = _int(h.get("x-ratelimit-remaining"), -1)
        reset_ms = _int(h.get("x-ratelimit-reset"), 0) * 1000 if remaining == 0 else 0
        limited = rate_limited(resp) or (resp.status == 403 and "rate limit" in _message(resp).lower())
        wait = 0
        if "retry-after" in h:
            wait = math.ceil(retry_after_s({"retry-after": h["retry-after"]}) or 0)
        elif limited and not reset_ms:
            wait = UNNAMED_LIMIT_WAIT_S
        return cls(_int(h.get("x-poll-interval"), 0), remaining, reset_ms, limited, wait)

    def answer(self, etag: str, events: list[RepoEvent], *, not_modified: bool,
               complete: bool = True) -> RepoEvents:
        return RepoEvents(etag=etag, events=events, poll_interval_s=self.poll_interval_s,
                          rate_limit_reset_ms=self.reset_ms, rate_limit_remaining=self.remaining,
                          rate_limited=self.limited, retry_after_s=self.retry_after_s,
                          not_modified=not_modified, complete=complete)


@dataclass
class EventPages:
    """Reads the pages of GET /repos/{owner}/{repo}/events; `get(page, etag)`
    is the forge's authenticated request, `fail(resp)` its clear error."""

    get: Callable[[int, str], Awaitable[Response]]
    fail: Callable[[Response], Exception]
    events: list[RepoEvent] = field(default_factory=list)

    async def read(self, etag: str, after_id: str) -> RepoEvents:
        resp = await self.get(1, etag)
        limits = Limits.of(resp)
        if resp.status == 304:
            return limits.answer(etag, [], not_modified=True)
        if limits.limited:
            return limits.answer(etag, [], not_modified=False, complete=False)
        new_etag = resp.headers.get("etag", "")
        page = 1
        while True:
            self._take(resp)
            more = 'rel="next"' in resp.headers.get("link", "")
            if not after_id or self._reaches(after_id) or not more or page == MAX_EVENT_PAGES:
                return limits.answer(new_etag, self.events, not_modified=False,
                                     complete=not more or not after_id or self._reaches(after_id))
            page += 1
            resp = await self.get(page, "")
            later = Limits.of(resp)
            if later.limited:       # what the earlier pages hold is handled; the cursor stays
                return later.answer(new_etag, self.events, not_modified=False, complete=False)

    def _take(self, resp: Response) -> None:
        if not resp.ok or not isinstance(resp.body, list):
            raise self.fail(resp)
        for e in resp.body:
            if isinstance(e, dict) and isinstance(e.get("payload"), dict):
                self.events.append(RepoEvent(id=str(e.get("id", "")), type=str(e.get("type", "")),
                                             actor_login=str((e.get("actor") or {}).get("login", "")),
                                             payload_json=json.dumps(e["payload"]),
                                             repo=str((e.get("repo") or {}).get("name", ""))))

    def _reaches(self, after_id: str) -> bool:
        last = _int(after_id, 0)
        return any(e.id.isdigit() and int(e.id) <= last for e in self.events)


def _message(resp: Response) -> str:
    return str(resp.body.get("message") or "") if isinstance(resp.body, dict) else ""


def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default
