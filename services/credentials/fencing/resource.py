"""Fencing at the resource (R37, docs/SCALE.md "Fencing").

Every side-effecting request of a ticket (commit, push, update of the branch,
pull request, merge, comment, commit status) carries the fence of the
scheduler's lease on the ticket. The broker keeps, per ticket, the highest
fence it has seen and refuses a lower one: a scheduler that was paused past
its lease, and whose ticket another scheduler took over, can no longer act
even if it passed its own lease check just before the pause.

The check, the record and the side effect run under one per-ticket lock, so
a newer owner's request waits for an older one already under way and none
starts after it. Fence 0 (a store of one scheduler, SQLite) is not checked.

State: `<data>/credentials/fences.json` (0600, written atomically, re-read
at start), one entry per live ticket; ReleaseWorkspace removes the entry.

This file is one machine's: it is the fence of a SQLite store (one
scheduler). With a PostgreSQL store the broker checks the fence in the
database instead (database.py), so it spans machines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

from services.common.errors import FailedPrecondition, Reason
from services.common.layout import check_ticket_id

log = logging.getLogger(__name__)

LOST_LEASE = "this scheduler lost its lease"   # the words for people; programs read the reason


class StaleFence(FailedPrecondition):
    """A request with a fence older than one seen: the scheduler's LeaseLost (Reason.LEASE_LOST)."""

    reason = Reason.LEASE_LOST

    def __init__(self, ticket_id: str, fence: int, highest: int) -> None:
        super().__init__(f"a newer owner of ticket {ticket_id} exists (fence {fence} < {highest}); {LOST_LEASE}")


class FenceGuard(Protocol):
    """What the broker asks of a fence: this file's, or the database's (database.py)."""

    def hold(self, ticket_id: str, fence: int) -> contextlib.AbstractAsyncContextManager[None]: ...
    def forget(self, ticket_id: str) -> None: ...
    async def aclose(self) -> None: ...


class Fences:
    """The highest fence seen per ticket, kept in `path` (None: in memory only, for tests)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._highest: dict[str, int] = self._load()
        self._locks: dict[str, asyncio.Lock] = {}

    def _load(self) -> dict[str, int]:
        if self.path is None:
            return {}
        try:
            doc = json.loads(self.path.read_text())
            return {check_ticket_id(str(k)): int(v) for k, v in doc.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            # Refuse to start blind: forgetting the fences would let a stale scheduler act again.
            raise FailedPrecondition(f"the fence file {self.path} is unreadable ({type(exc).__name__}); "
                                     "restore it, or remove it when no scheduler is running") from None

    def _save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self._highest, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def highest(self, ticket_id: str) -> int:
        return self._highest.get(ticket_id, 0)

    @contextlib.asynccontextmanager
    async def hold(self, ticket_id: str, fence: int) -> AsyncIterator[None]:
        """Run the block only when `fence` is the highest seen for the ticket
        (recorded first, durably), else `StaleFence`. Fence 0: no check."""
        if not fence:
            yield
            return
        check_ticket_id(ticket_id)
        lock = self._locks.setdefault(ticket_id, asyncio.Lock())
        async with lock:
            highest = self._highest.get(ticket_id, 0)
            if fence < highest:
                log.warning("ticket %s: refused a request with fence %d (a newer owner holds %d)",
                            ticket_id, fence, highest)
                raise StaleFence(ticket_id, fence, highest)
            if fence > highest:
                self._highest[ticket_id] = fence
                self._save()
            yield

    def forget(self, ticket_id: str) -> None:
        """The ticket ended (ReleaseWorkspace): its entry goes."""
        self._locks.pop(ticket_id, None)
        if self._highest.pop(ticket_id, None) is not None:
            self._save()

    async def aclose(self) -> None:
        """Nothing to close: every change is on disk already."""
