"""The credential broker HTTP client's wait rule before it honoured a
server's named time: that time capped at `max_wait_s`, then another try.
Tests restore it (monkeypatching `httpclient.next_wait`) as the positive
control that shows a request sent before GitHub's reset."""

from __future__ import annotations

import random

from services.credentials.httpclient import Response, RetryPolicy, retry_after_s


def capped_next_wait(resp: Response | None, attempt: int, policy: RetryPolicy) -> float | None:
    wait = retry_after_s(resp.headers) if resp is not None else None
    if wait is None:
        wait = policy.backoff_s * (2 ** (attempt - 1)) * (0.5 + random.random() / 2)
    return min(wait, policy.max_wait_s)
