"""The sandbox broker's command supervisors: one link per sandbox container
(supervisor.py), the sandbox's own one first (attached before it starts),
restarted with an exec when it dies, given up for one exec per command after
MAX_RESTARTS or when the image has no python3."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from .dockerapi import DockerAPI, EngineError
from .supervisor import MAX_RESTARTS, Link, NoSupervisor, SupervisorDown

log = logging.getLogger(__name__)


class Supervisors:
    """One link per sandbox container, started on first use (or ahead with
    `warm`), restarted when it dies, given up for exec after MAX_RESTARTS."""

    def __init__(self, api: DockerAPI, enabled: bool = True) -> None:
        self.api = api
        self.enabled = enabled
        self._links: dict[str, Link] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._restarts: dict[str, int] = {}
        self._exec_only: set[str] = set()
        self._born: dict[str, Link] = {}      # attached to a new sandbox's own supervisor, not yet ready

    async def link(self, container_id: str) -> Link | None:
        """The live link of a container, or None: use one exec per command.
        Engine errors (NotFound, 409 not running) propagate to the caller."""
        if not self.enabled or container_id in self._exec_only:
            return None
        link = self._links.get(container_id)
        if link is not None and link.alive:
            return link
        async with self._locks.setdefault(container_id, asyncio.Lock()):
            link = self._links.get(container_id)
            if link is not None and link.alive:
                return link
            if link is not None:
                n = self._restarts[container_id] = self._restarts.get(container_id, 0) + 1
                if n > MAX_RESTARTS:
                    log.warning("sandbox %s: its command supervisor stopped %d times; one exec per command "
                                "from now on", container_id[:12], n)
                    self._exec_only.add(container_id)
                    self._links.pop(container_id, None)
                    return None
            born = self._born.pop(container_id, None)
            if born is not None:
                try:
                    await born.ready()
                    self._links[container_id] = born
                    return born
                except NoSupervisor:
                    self._exec_only.add(container_id)
                    return None
                except SupervisorDown as exc:
                    log.info("sandbox %s: its own command supervisor: %s; starting one with an exec",
                             container_id[:12], exc)
            try:
                link = await Link.start(self.api, container_id)
            except NoSupervisor:
                self._exec_only.add(container_id)
                return None
            except SupervisorDown as exc:
                log.warning("sandbox %s: %s; using one exec per command", container_id[:12], exc)
                return None
            self._links[container_id] = link
            return link

    async def attach(self, container_id: str) -> None:
        """Before a new sandbox starts: attach to the supervisor it will start
        itself (`keeper_argv`); its first `link` waits for that one."""
        if not self.enabled:
            return
        try:
            self._born[container_id] = await Link.attach(self.api, container_id)
        except (EngineError, OSError) as exc:
            log.warning("sandbox %s: could not attach to its command supervisor: %s", container_id[:12], exc)

    async def warm(self, container_id: str) -> None:
        """Start the supervisor ahead of the first command (errors are the first
        command's to report)."""
        with contextlib.suppress(Exception):
            await self.link(container_id)

    def drop(self, container_id: str) -> None:
        born = self._born.pop(container_id, None)
        if born is not None:
            born.close()
        link = self._links.pop(container_id, None)
        self._locks.pop(container_id, None)
        self._restarts.pop(container_id, None)
        self._exec_only.discard(container_id)
        if link is not None:
            link.close()

    def live(self) -> list[Link]:
        return [lk for lk in self._links.values() if lk.alive]
