"""A sandbox killed under a running command: noticed at once, and named.

Under gVisor a sandbox that reaches its memory limit (or its pids limit) is
killed whole, and Docker keeps the exec's stream open after the runsc
container is gone: the command's only word is runsc's `urpc method
"containerManager.WaitPID" failed: EOF` on stderr, then nothing until the
command's deadline. `DeathWatch` keeps one engine `wait` per container
while commands run in it (by `docker exec`); when the container stops, every
such command is ended at once (execs.py).

`why_killed` says why, from what the engine knows: the stopped container's
state (`OOMKilled`, its exit code) and the limits it was made with; for a
sandbox that lives on (runc: the kernel's OOM killer ends one process, the
command exits 137), the engine's `oom` event for it since the command began.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from services.common.errors import AfeError, NotFound
from services.sandbox.containers.dockerapi import DockerAPI, EngineError
from services.sandbox.containers.hardening import GVISOR_PIDS_FACTOR, LABEL_RUNTIME

log = logging.getLogger(__name__)

# The exit code a command reports when its sandbox was killed under it (128 + SIGKILL).
KILLED = 137
# The exit code of gVisor's kernel (a Go program) when the Go runtime gives up,
# which it does when it cannot start a thread: the pids limit (docs/SECURITY.md).
GVISOR_FATAL = 2
# How long after a command's end the engine may still be publishing its `oom` event.
OOM_EVENT_GRACE_S = 0.3

Watch = asyncio.Task["int | None"]  # the container's exit code once stopped; None: the engine could not tell


def size_text(n: int) -> str:
    """512 MiB, 1 GiB, 1536 MiB: a memory limit as a person reads it."""
    for unit, size in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def memory_reason(memory: int, *, whole: bool) -> str:
    limit = f"its memory limit of {size_text(memory)}" if memory else "its memory limit"
    head = ("the sandbox was killed: it reached " + limit if whole
            else "the command was killed: the sandbox reached " + limit)
    return head + " (sandbox.limits.memory); use less memory or raise the Workspace's sandbox.limits.memory"


def pids_reason(engine_pids: int) -> str:
    pids = engine_pids // GVISOR_PIDS_FACTOR if engine_pids > 0 else 0
    limit = f"its process limit of {pids}" if pids else "its process limit"
    engine = f"; the engine's limit of {engine_pids} tasks counts gVisor's own threads too" if engine_pids > 0 else ""
    return ("the sandbox was killed: its gVisor kernel stopped (exit code 2), as it does when the sandbox reaches "
            f"{limit} (sandbox.limits.pids{engine}); start fewer processes or raise the Workspace's "
            "sandbox.limits.pids")


def stopped_reason(state: dict[str, Any], host_config: dict[str, Any], gvisor: bool) -> str:
    """Why a sandbox that is no longer running stopped, from its container's state."""
    if state.get("OOMKilled"):
        return memory_reason(int(host_config.get("Memory") or 0), whole=True)
    code = state.get("ExitCode")
    if gvisor and code == GVISOR_FATAL:
        return pids_reason(int(host_config.get("PidsLimit") or 0))
    return f"the sandbox stopped (exit code {code}) while the command ran"


async def why_killed(api: DockerAPI, container_id: str, *, since: float | None = None) -> str:
    """Why a command in this container was killed, or "" when nothing says:
    the sandbox stopped (its state names the limit), or, with `since` (the
    Unix time the command began), the engine saw the container's cgroup
    run out of memory while the sandbox lives on."""
    try:
        doc = await api.inspect_container(container_id)
    except NotFound:
        return "the sandbox was removed while the command ran"
    except (AfeError, EngineError, OSError):
        return ""
    state, host_config = doc.get("State") or {}, doc.get("HostConfig") or {}
    labels = (doc.get("Config") or {}).get("Labels") or {}
    if not state.get("Running"):
        return stopped_reason(state, host_config, labels.get(LABEL_RUNTIME) == "gvisor")
    if since is None:
        return ""
    try:
        oom = await api.events(since=since, until=time.time() + OOM_EVENT_GRACE_S,
                               filters={"type": ["container"], "container": [container_id], "event": ["oom"]})
    except (AfeError, EngineError, OSError, ValueError):
        return ""
    return memory_reason(int(host_config.get("Memory") or 0), whole=False) if oom else ""


class DeathWatch:
    """One engine `wait` per container while commands run in it by exec,
    shared by those commands; ended with the last of them."""

    def __init__(self, api: DockerAPI) -> None:
        self.api = api
        self._watches: dict[str, Watch] = {}
        self._users: dict[str, int] = {}

    @contextlib.contextmanager
    def watching(self, container_id: str) -> Iterator[Watch]:
        """The container's watch for as long as the block runs: done with the
        container's exit code once it stops (None when the engine could not
        tell: not a death)."""
        watch = self._watches.get(container_id)
        if watch is None or watch.done():
            watch = asyncio.get_running_loop().create_task(self._wait(container_id))
            self._watches[container_id] = watch
            self._users[container_id] = 0
        self._users[container_id] += 1
        try:
            yield watch
        finally:
            if self._watches.get(container_id) is watch:
                self._users[container_id] -= 1
                if self._users[container_id] <= 0:
                    del self._watches[container_id], self._users[container_id]
                    watch.cancel()

    async def _wait(self, container_id: str) -> int | None:
        try:
            return await self.api.wait_stopped(container_id)
        except NotFound:
            return -1                     # removed: gone all the same
        except (AfeError, EngineError, OSError, ValueError) as exc:
            log.warning("sandbox %s: cannot watch it for its end (%s)", container_id[:12], exc)
            return None


def died(watch: Watch) -> bool:
    """The watch saw its container stop."""
    return watch.done() and not watch.cancelled() and watch.result() is not None
