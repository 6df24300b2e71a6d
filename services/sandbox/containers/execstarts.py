"""Keeps a freeze off an exec that is still starting.

`runc exec` puts a new process into the container's cgroup (its `runc init`
joins, then execs the command). If the cgroup is frozen between the engine's
"is it paused?" check and that join, `runc init` waits in uninterruptible
sleep for ever and the engine keeps its lock on the container: every later
inspect, exec, unpause or remove of that container hangs, and with it the
broker call that made it. The engine answers an exec start before it runs
the process, so a pause right after a start can land on it
(tests/sandbox/containers/test_exec_starts.py shows the early answer).

So every exec this process starts is counted as *starting* until the engine
reports its process running (or exited), and a freeze first waits until no
exec of the container is starting and holds new starts back while it pauses;
a start that comes after the pause is refused by the engine (409, paused).

One engine per process, so one record per process (`EXEC_STARTS`); it keeps
no loop of its own (the broker's loop is the only one that uses it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

# How long a freeze waits for the execs starting in its container before it gives up.
QUIET_TIMEOUT_S = 60.0


class ExecStarts:
    def __init__(self) -> None:
        self._starting: dict[str, int] = {}
        self._freezing: dict[str, int] = {}
        self._waiters: list[asyncio.Future[None]] = []

    def starting(self, container: str) -> int:
        return self._starting.get(container, 0)

    def _down(self, counts: dict[str, int], container: str) -> None:
        n = counts[container] - 1
        if n:
            counts[container] = n
        else:
            del counts[container]
        self._changed()

    def _changed(self) -> None:
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def _wait_for(self, ready: Callable[[], bool]) -> None:
        while not ready():
            w = asyncio.get_running_loop().create_future()
            self._waiters.append(w)
            await w

    @contextlib.asynccontextmanager
    async def start(self, container: str) -> AsyncIterator[None]:
        """Around an exec's start, until the engine reports its process: waits
        while the container is being frozen."""
        await self._wait_for(lambda: not self._freezing.get(container))
        self._starting[container] = self._starting.get(container, 0) + 1
        try:
            yield
        finally:
            self._down(self._starting, container)

    @contextlib.asynccontextmanager
    async def quiet(self, container: str, timeout: float = QUIET_TIMEOUT_S) -> AsyncIterator[None]:
        """Around a pause: no exec of the container is starting inside."""
        self._freezing[container] = self._freezing.get(container, 0) + 1
        try:
            try:
                await asyncio.wait_for(self._wait_for(lambda: not self._starting.get(container)), timeout)
            except TimeoutError:
                raise TimeoutError(f"an exec into container {container[:12]} is still starting after "
                                   f"{timeout:.0f} s") from None
            yield
        finally:
            self._down(self._freezing, container)


EXEC_STARTS = ExecStarts()

__all__ = ["EXEC_STARTS", "QUIET_TIMEOUT_S", "ExecStarts"]
