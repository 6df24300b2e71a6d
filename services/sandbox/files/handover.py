"""The workspace across hosts: ReadWorkspace and WriteWorkspace (docs/SCALE.md).

On one host the credential broker lays the checkout at
`<data>/workspaces/<ticket>` and snapshots it from there. When this broker
runs on another host (`--listen`), that folder is only here, so the
workspace crosses the network as a tar stream (services/common/safefs/archive.py):

- `write`: the credential broker's checkout, relayed by the scheduler, is
  unpacked into a private folder next to the workspace (0700, root) with
  the archive's checks (no absolute name, no `..`, nothing written through a
  link, no hard link or device; R17-R19), bounded by the sandbox's disk cap
  and the walk limits (R34), then renamed into place and handed to the
  sandbox user. A workspace that already holds files is left alone (a
  second prepare, as on one host). The broker marks it as its own
  (`.<ticket>.handed`), so DestroySandbox and reconcile remove it: no
  credential broker will.
- `read`: the workspace walked without following a link, `.git`
  directories' content left out (never commit content), bounded (R34).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Generator, Iterable
from pathlib import Path

from services.common import safefs
from services.common.errors import FailedPrecondition
from services.common.layout import SANDBOX_GID, SANDBOX_UID, Layout, check_ticket_id
from services.common.safefs import archive
from services.sandbox.files import diskcap

log = logging.getLogger(__name__)

READ_WHAT = "the workspace read for the credential broker"
WRITE_WHAT = "the workspace hand-over"
OWN_LIMITS = safefs.Limits(WRITE_WHAT)


def is_git_dir_name(name: bytes) -> bool:
    """`.git` and the names other file systems treat as `.git`: never content."""
    return name.lower().rstrip(b". ") in (b".git", b"git~1")


class Handover:
    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    def _marker(self, ticket_id: str) -> Path:
        return self.layout.workspaces_dir / f".{check_ticket_id(ticket_id)}.handed"

    def read(self, ticket_id: str, max_bytes: int = 0) -> Generator[bytes, None, None]:
        """The ticket's workspace as tar chunks (see the module)."""
        path = self.layout.workspace(check_ticket_id(ticket_id))
        limits = archive.ArchiveLimits(READ_WHAT, max_bytes=max_bytes or archive.DEFAULT_MAX_BYTES)
        return archive.pack_path(path, limits, skip=is_git_dir_name)

    async def write(self, ticket_id: str, disk_bytes: int, chunks: AsyncIterator[bytes]) -> tuple[int, int, bool]:
        """Unpack the archive into the ticket's (empty or missing) workspace:
        (entries, bytes, existing)."""
        path = self.layout.workspace(check_ticket_id(ticket_id))
        cap = diskcap.resolve_disk(disk_bytes)
        self.layout.workspaces_dir.mkdir(parents=True, exist_ok=True, mode=0o711)
        if _holds_files(path):
            log.info("ticket %s: its workspace already holds files; the hand-over keeps them", ticket_id)
            return 0, 0, True
        tmp = Path(tempfile.mkdtemp(prefix=f".in-{ticket_id}-", dir=self.layout.workspaces_dir))
        try:
            fd = os.open(tmp, safefs.DIR_FLAGS)
            try:
                u = archive.Unpacker(fd, archive.ArchiveLimits(WRITE_WHAT, max_bytes=cap))
                try:
                    async for c in chunks:
                        await asyncio.to_thread(u.feed, c)
                    u.finish()
                finally:
                    u.close()
            finally:
                os.close(fd)
            await asyncio.to_thread(self._place, tmp, path, ticket_id)
        except BaseException:
            await asyncio.to_thread(safefs.remove_tree, tmp)
            raise
        log.info("ticket %s: workspace handed over (%d entries, %d bytes)", ticket_id, u.entries, u.bytes)
        return u.entries, u.bytes, False

    def _place(self, tmp: Path, path: Path, ticket_id: str) -> None:
        self._marker(ticket_id).touch(mode=0o600)
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(path)    # an empty folder (a create before the hand-over); one with files was kept above
        try:
            os.rename(tmp, path)
        except OSError as exc:
            raise FailedPrecondition(f"ticket {ticket_id}'s workspace could not be put in place "
                                     f"({exc.strerror}); retry") from None
        os.chmod(path, 0o755)
        if os.geteuid() == 0:
            safefs.chown_tree(path, SANDBOX_UID, SANDBOX_GID, OWN_LIMITS)

    def remove(self, ticket_id: str) -> bool:
        """Remove a workspace this broker received (after its sandbox and disk image went)."""
        marker = self._marker(ticket_id)
        if not marker.exists():
            return False
        safefs.remove_tree(self.layout.workspace(ticket_id))
        marker.unlink(missing_ok=True)
        return True

    def reconcile(self, live: Iterable[str]) -> list[str]:
        """Remove the received workspaces of tickets not in `live`."""
        live = set(live)
        done = []
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(self.layout.workspaces_dir):
                if e.name.startswith(".") and e.name.endswith(".handed"):
                    t = e.name[1:-len(".handed")]
                    if t not in live:
                        with contextlib.suppress(Exception):
                            if self.remove(t):
                                done.append(t)
        return done


def _holds_files(path: Path) -> bool:
    try:
        with os.scandir(path) as it:
            return any(True for _ in it)
    except (FileNotFoundError, NotADirectoryError):
        return False
