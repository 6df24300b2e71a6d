"""Spare checkouts: the next ticket on a repository starts from a checkout
made in the background.

After a workspace is prepared, the next checkout of the same base commit is
made in `folder` (private, on the data dir's filesystem), so the next ticket
only renames it into place. One spare per repository (the newest base); a
spare is an optimisation, so its failure never fails a ticket.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

log = logging.getLogger(__name__)

Populate = Callable[[Path, Path, str, Path], Awaitable[None]]   # (git dir, target, sha, index)


class Spares:
    def __init__(self, folder: Path | None, populate: Populate, remove: Callable[[Path], None]) -> None:
        """`folder` None disables spares; `populate` checks a commit out into a
        new folder; `remove` removes a tree (whatever its depth)."""
        self.folder = folder
        self._populate = populate
        self._remove = remove
        self._tasks: dict[Path, asyncio.Task[None]] = {}

    def _path(self, mirror: Path, base: str) -> Path | None:
        if self.folder is None:
            return None
        return self.folder / f"{mirror.name}-{base}"

    def take(self, mirror: Path, base: str, work: Path) -> bool:
        """Move a ready spare checkout of `base` into place (atomic rename)."""
        spare = self._path(mirror, base)
        if spare is None:
            return False
        try:
            os.rename(spare, work)
        except FileNotFoundError:
            return False
        return True

    def schedule(self, mirror: Path, base: str) -> None:
        spare = self._path(mirror, base)
        if spare is None or spare.exists() or spare in self._tasks:
            return
        task = asyncio.get_running_loop().create_task(self._make(mirror, base, spare))
        self._tasks[spare] = task
        task.add_done_callback(lambda _t: self._tasks.pop(spare, None))

    async def _make(self, mirror: Path, base: str, spare: Path) -> None:
        assert self.folder is not None
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = Path(tempfile.mkdtemp(prefix=".new-", dir=self.folder))
        try:
            os.rmdir(tmp)
            await self._populate(mirror, tmp, base, self.folder / (tmp.name + ".index"))
            for old in self.folder.glob(f"{mirror.name}-*"):
                await asyncio.to_thread(self._remove, old)  # one spare per repository: the newest base
            os.rename(tmp, spare)
        except asyncio.CancelledError:
            await asyncio.to_thread(self._remove, tmp)
            raise
        except Exception as exc:  # noqa: BLE001 -- a spare is an optimisation: never fail a ticket for it
            log.warning("spare checkout failed: %s", exc)
            await asyncio.to_thread(self._remove, tmp)

    async def idle(self) -> None:
        """Wait for background spare checkouts."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)
