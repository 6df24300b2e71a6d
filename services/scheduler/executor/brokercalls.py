"""Broker calls that outlive a broker restart (R37): `afe up` restarts a dead
child after 1 s, 2 s, 4 s, ...; preparation and each builtin step wait for it
instead of failing the node."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from services.common.errors import PeerUnavailable, Reason, Unavailable

T = TypeVar("T")
Emit = Callable[[str, dict[str, Any]], None]

# How long preparation and a builtin step (commit, push, open_pr, merge) wait
# for a broker that went away. An engine may set `broker_retry_s` (0: fail at once).
BROKER_RETRY_S = 60.0


async def retry_unavailable(limit_s: float, what: str, fn: Callable[[], Awaitable[T]],
                            retry_on: type[Unavailable] = Unavailable) -> T:
    """Call `fn` until it stops raising `retry_on`, for at most `limit_s` seconds."""
    delay, deadline = 0.2, time.monotonic() + limit_s
    while True:
        try:
            return await fn()
        except retry_on as exc:
            if time.monotonic() + delay > deadline:
                raise type(exc)(f"{what}: {exc.message}; afe retried for {limit_s:g} s "
                                "(see `afe status` and the broker's log)") from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


async def step(limit_s: float, emit: Emit, node_id: str, name: str, fn: Callable[[], Awaitable[T]]) -> T:
    """One credential broker call of a builtin step (commit, push, open_pr,
    merge) that survives a broker crash: while the broker is away
    (`PeerUnavailable`: not running, or its connection closed mid-call) the
    call is made again, with back-off, for up to `limit_s` seconds, whatever
    the node's `retries`. Each step is idempotent in the broker (keyed by
    ticket and step: the branch `afe/<ticket>`, its one PR, the approved
    head), so a call that landed before the crash is not repeated. The
    same for the broker's UNAVAILABLE when the database holding the fences
    does not answer it (Reason.FENCE_STORE_AWAY)."""
    delay, started = 0.5, time.monotonic()
    away = False
    while True:
        try:
            out = await fn()
        except Unavailable as exc:
            # The broker away, or (with a PostgreSQL store) the database that holds the fences not
            # answering it: nothing was done either way, so the step is tried again (the lease is
            # checked again before each try). Any other UNAVAILABLE is the step's own answer.
            fence_db = not isinstance(exc, PeerUnavailable)
            if fence_db and exc.reason is not Reason.FENCE_STORE_AWAY:
                raise
            waited = time.monotonic() - started
            if waited + delay > limit_s:
                if fence_db:
                    raise Unavailable(f"{name}: {exc.message}; afe retried for {limit_s:g} s") from None
                raise PeerUnavailable(
                    f"the credential broker went away during {name} and did not come back within "
                    f"{limit_s:g} s; check that `afe up` is running and see the credential broker's log, "
                    "then retry the ticket") from None
            if not away:
                away = True
                said = (f"the credential broker cannot check the fence of {name}: the database does not "
                        "answer; retrying" if fence_db else
                        f"the credential broker went away during {name}; retrying (afe up restarts it)")
                emit("broker.retry", {"node": node_id, "step": name, "broker": "credentials", "message": said})
            await asyncio.sleep(delay)
            delay = min(delay * 2, 4.0)
            continue
        if away:
            emit("broker.recovered", {"node": node_id, "step": name, "broker": "credentials",
                                      "after_s": round(time.monotonic() - started, 1)})
        return out
