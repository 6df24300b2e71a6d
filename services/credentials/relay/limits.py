"""Per-ticket limits of the model relay (R32), so one ticket can fail only
itself: open connections, the time a connection may sit idle and the time a
request's head may take, and the request-body bytes the broker holds for
the ticket at once. What the limits stop is counted (a metric) and logged
once per interval, never once per connection or request (`Throttle`).

Each ticket's socket is served by `GuardedSite`: every accepted connection
first meets a `_Guard`, which closes it at once when the ticket already has
its limit of connections (the descriptor is given back immediately, so a
flood of connections from one ticket cannot use up the broker's descriptors)
and otherwise hands it to aiohttp, with a timer while no request is being
handled: `idle_s` while nothing arrives, `head_s` once a request's first
byte has arrived until its head is complete.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

LOG_EVERY_S = 60.0


@dataclass(frozen=True)
class RelayLimits:
    """0 (or 0.0) turns a limit off; `RelayLimits.off()` turns all off (tests' positive controls)."""

    connections: int = 64            # open connections per ticket
    idle_s: float = 60.0             # a connection with no request arriving
    head_s: float = 10.0             # from a request's first byte to its complete head
    body_s: float = 120.0            # to receive a request's body
    buffered: int = 64 * 1024 * 1024  # request-body bytes held per ticket at once

    @classmethod
    def off(cls) -> RelayLimits:
        return cls(connections=0, idle_s=0.0, head_s=0.0, body_s=0.0, buffered=0)


@dataclass
class TicketLoad:
    """What one ticket's relay holds right now."""

    connections: int = 0
    buffered: int = 0
    guards: dict[Any, _Guard] = field(default_factory=dict)   # transport -> its guard


class Throttle:
    """Counts repeated events per key and logs the first, then at most one
    line per `every_s` with how many happened since the last line."""

    def __init__(self, logger: logging.Logger, every_s: float = LOG_EVERY_S) -> None:
        self.logger = logger
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def note(self, key: str, message: str, level: int = logging.WARNING) -> None:
        self._count[key] = self._count.get(key, 0) + 1
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            return
        n = self._count.pop(key)
        self._last[key] = now
        if len(self._last) > 4096:      # keys name tickets: forget the oldest
            for k in sorted(self._last, key=self._last.__getitem__)[:2048]:
                self._last.pop(k, None)
                self._count.pop(k, None)
        suffix = "" if last is None else f" ({n} times in the last {now - last:.0f}s)"
        self.logger.log(level, "%s%s", message, suffix)


class Limiter:
    """The limits, one `TicketLoad` per ticket, and what happens when one is hit."""

    def __init__(self, limits: RelayLimits, counter: Callable[[str], None]) -> None:
        self.limits = limits
        self.count = counter              # a metric, by reason
        self.throttle = Throttle(log)

    def stopped(self, ticket_id: str, reason: str, message: str) -> None:
        self.count(reason)
        self.throttle.note(f"{ticket_id}:{reason}", f"model relay of ticket {ticket_id}: {message}")

    def reserve(self, ticket_id: str, load: TicketLoad, n: int) -> bool:
        """Room for `n` more body bytes of this ticket? (Taken when there is.)"""
        cap = self.limits.buffered
        if cap and load.buffered + n > cap:
            self.stopped(ticket_id, "buffered", f"request bodies over its limit of {cap} bytes held at once "
                                                "were refused")
            return False
        load.buffered += n
        return True

    def release(self, load: TicketLoad, n: int) -> None:
        load.buffered = max(0, load.buffered - n)

    def busy(self, load: TicketLoad, transport: Any, on: bool) -> None:
        """A request is being handled on this connection (no timer), or ended (idle timer)."""
        g = load.guards.get(transport)
        if g is not None:
            g.busy(on)


class ServerLog:
    """aiohttp's server logger for one ticket's relay. aiohttp logs each
    request it cannot handle (a malformed head, say) with a traceback; here
    that is one line per interval with a count, and its debug lines are dropped."""

    def __init__(self, ticket_id: str, throttle: Throttle) -> None:
        self.ticket_id = ticket_id
        self.throttle = throttle

    def _note(self, what: str, exc: object) -> None:
        kind = type(exc).__name__ if isinstance(exc, BaseException) else "error"
        self.throttle.note(f"{self.ticket_id}:server:{kind}", f"model relay of ticket {self.ticket_id}: {what} "
                           f"({kind}); answered with an error")

    def debug(self, *args: Any, **kwargs: Any) -> None:
        pass

    def info(self, *args: Any, **kwargs: Any) -> None:
        pass

    def warning(self, *args: Any, **kwargs: Any) -> None:
        self._note("the HTTP server warned", kwargs.get("exc_info"))

    def error(self, *args: Any, **kwargs: Any) -> None:
        self._note("a request the HTTP server could not handle", kwargs.get("exc_info"))

    exception = error


class _Guard(asyncio.Protocol):
    """Sits in front of aiohttp's protocol for one connection (see the module doc)."""

    def __init__(self, inner: asyncio.Protocol, ticket_id: str, load: TicketLoad, limiter: Limiter) -> None:
        self.inner = inner
        self.ticket_id = ticket_id
        self.load = load
        self.limiter = limiter
        self.transport: asyncio.Transport | None = None
        self.admitted = False
        self._busy = False
        self._head = False
        # One timer per connection, never moved: it fires at most `_step` (the shortest limit) after it
        # was set, so a new deadline (now + a limit) is never before it, and arming a limit costs no timer
        # operation (two per request otherwise); when it fires early it is set again.
        self._deadline = 0.0          # loop time the armed limit runs out; 0: none armed
        self._reason = ""
        self._seconds = 0.0
        self._step = min((x for x in (limiter.limits.idle_s, limiter.limits.head_s) if x), default=0.0)
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        cap = self.limiter.limits.connections
        if cap and self.load.connections >= cap:
            self.limiter.stopped(self.ticket_id, "connections",
                                 f"connections over its limit of {cap} open at once were closed")
            transport.abort()           # the descriptor is given back now, not after a graceful close
            return
        self.admitted = True
        self.load.connections += 1
        self.load.guards[transport] = self
        self.inner.connection_made(transport)
        self._arm(self.limiter.limits.idle_s, "idle_timeout")

    def _arm(self, seconds: float, reason: str) -> None:
        """The connection is closed if nothing disarms this within `seconds` (0: disarm)."""
        if not seconds or self.transport is None:
            self._deadline = 0.0
            return
        loop = asyncio.get_running_loop()
        self._deadline, self._reason, self._seconds = loop.time() + seconds, reason, seconds
        if self._timer is None:
            self._timer = loop.call_at(min(self._deadline, loop.time() + self._step), self._fire)

    def _fire(self) -> None:
        self._timer = None
        if not self._deadline or self._busy or self.transport is None:
            return                      # disarmed: the next _arm sets the timer again
        loop = asyncio.get_running_loop()
        if loop.time() + 0.001 < self._deadline:
            self._timer = loop.call_at(min(self._deadline, loop.time() + self._step), self._fire)
            return
        self._expire(self._reason, self._seconds)

    def _expire(self, reason: str, seconds: float) -> None:
        if self._busy or self.transport is None:
            return
        what = "sent no request" if reason == "idle_timeout" else "did not finish a request's head"
        self.limiter.stopped(self.ticket_id, reason, f"connections that {what} within {seconds:g}s were closed")
        self.transport.abort()

    def busy(self, on: bool) -> None:
        self._busy, self._head = on, False
        if on:
            self._arm(0.0, "")
        else:
            self._arm(self.limiter.limits.idle_s, "idle_timeout")

    def data_received(self, data: bytes) -> None:
        if not self._busy and not self._head:
            self._head = True
            self._arm(self.limiter.limits.head_s, "head_timeout")
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.admitted:
            return
        self.admitted = False
        self.load.connections -= 1
        self.load.guards.pop(self.transport, None)
        self.inner.connection_lost(exc)


class GuardedSite(web.SockSite):
    """`web.SockSite` for a Unix socket whose connections meet a `_Guard` first."""

    def __init__(self, runner: web.AppRunner, sock: socket.socket, ticket_id: str, load: TicketLoad,
                 limiter: Limiter) -> None:
        super().__init__(runner, sock)
        self._ticket_id = ticket_id
        self._load = load
        self._limiter = limiter

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Guard(server(), self._ticket_id, self._load, self._limiter), sock=self._sock,
            backlog=self._backlog)
