"""Failed credentials per source, for one surface (R38, R40).

The gateway keeps one limiter per surface: the UI and CLI (logins and /rpc
bearer tokens) and GitHub webhooks (signatures), so failures on one never
count against the other. Each limiter keeps, per client address, the times
of its latest failures (a sliding window).

A limiter is consulted only AFTER the credential was checked, and only for
a credential that failed: a valid token, cookie or signature is never
refused because of earlier failures from its address, so nobody (another
local process, or anyone behind the same reverse proxy) can lock the owner
out by failing on purpose. A source that has used up its budget gets 429
with Retry-After instead of 401; each further failure is recorded too, so
the 429s go on until the source stops failing for a whole window. What
bounds guessing is the credential itself (the UI token is 256 random bits,
the webhook secret should be 32 random bytes), checked in constant time;
the limiter bounds what failures cost the server: its log lines (one per
failure within the budget, none beyond) and the memory it keeps (at most
`max_failures` times per source, at most `max_clients` sources).
"""

from __future__ import annotations

import time
from collections import deque


class FailureLimiter:
    def __init__(self, max_failures: int = 10, window: float = 60.0, max_clients: int = 10000) -> None:
        if max_failures < 1:
            raise ValueError("max_failures must be at least 1")
        self.max_failures = max_failures
        self.window = window
        self.max_clients = max_clients
        self._failures: dict[str, deque[float]] = {}

    def _recent(self, client: str, now: float) -> deque[float]:
        q = self._failures.get(client)
        if q is None:
            return deque()
        while q and q[0] <= now - self.window:
            q.popleft()
        if not q:
            del self._failures[client]
        return q

    def retry_after(self, client: str, now: float | None = None) -> float:
        """Seconds until `client` is within its budget again (0 when it is now)."""
        now = time.monotonic() if now is None else now
        q = self._recent(client, now)
        if len(q) < self.max_failures:
            return 0.0
        return max(0.0, q[0] + self.window - now)

    def failed(self, client: str, now: float | None = None) -> float:
        """Record a failed credential of `client`. Returns 0 while the failure was
        within the budget (answer 401), else the seconds the client should wait
        (answer 429 with that Retry-After)."""
        now = time.monotonic() if now is None else now
        over = self.retry_after(client, now) > 0
        if client not in self._failures and len(self._failures) >= self.max_clients:
            # Forget the client whose last failure is oldest, keeping memory bounded.
            oldest = min(self._failures, key=lambda c: self._failures[c][-1])
            del self._failures[oldest]
        # Only the latest max_failures times decide the wait: older ones drop out.
        self._failures.setdefault(client, deque(maxlen=self.max_failures)).append(now)
        return self.retry_after(client, now) if over else 0.0


def retry_after_header(wait: float) -> dict[str, str]:
    """The Retry-After header for a wait in seconds (whole seconds, at least 1)."""
    return {"Retry-After": str(int(wait) + 1)}
