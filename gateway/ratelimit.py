"""Per-client limit on failed logins (a sliding window of failure times)."""

from __future__ import annotations

import time
from collections import deque


class FailureLimiter:
    def __init__(self, max_failures: int = 10, window: float = 60.0, max_clients: int = 10000) -> None:
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
        """Seconds until `client` may try again (0 when it may now)."""
        now = time.monotonic() if now is None else now
        q = self._recent(client, now)
        if len(q) < self.max_failures:
            return 0.0
        return max(0.0, q[0] + self.window - now)

    def failed(self, client: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if client not in self._failures and len(self._failures) >= self.max_clients:
            # Forget the client whose last failure is oldest, keeping memory bounded.
            oldest = min(self._failures, key=lambda c: self._failures[c][-1])
            del self._failures[oldest]
        self._failures.setdefault(client, deque()).append(now)
