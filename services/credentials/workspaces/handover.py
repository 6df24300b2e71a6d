"""The workspace of a sandbox on another host (docs/SCALE.md).

When the scheduler placed a ticket's sandbox on a sandbox broker on another
host, the workspace folder is there, not here, and this broker sees it only
as a tar stream the scheduler relays (services/common/safefs/archive.py):

- CheckoutArchive: the checkout is laid in a new folder private to this
  broker (`<data>/handover/`, 0700), packed and streamed, then removed;
- CommitArchive, DiffArchive, ReleaseArchive: the stream the sandbox broker
  read from the workspace is unpacked, with the archive's checks (no
  absolute name, no `..`, nothing written through a link, no hard link or
  device, R17-R19) and bounds (depth, entries, bytes, one file's size,
  R34), into a new private folder; the commit, diff or kept state is then
  made from that copy exactly as from a local workspace (snapshot.py's
  no-follow walk; host git never reads it as a work tree, R13). The copy is
  removed at once.

The sandbox never sees this folder: it is on another host and private to
this broker; no token is near the stream (R1-R3).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator, Generator
from pathlib import Path

from services.common import safefs
from services.common.layout import Layout
from services.common.safefs import archive
from services.credentials.workspaces import snapshot

UNPACK_LIMITS = archive.ArchiveLimits("the commit snapshot of a workspace on another host",
                                      max_file=snapshot.MAX_FILE_BYTES)   # depth 256, 1,000,000 entries, 10 GiB
CHECKOUT_LIMITS = archive.ArchiveLimits("the checkout sent to another host")


@contextlib.asynccontextmanager
async def private_folder(layout: Layout) -> AsyncIterator[Path]:
    """A new empty folder `.../w` only this broker can reach; removed on exit."""
    base = layout.data_dir / "handover"
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(base, 0o700)
    tmp = Path(tempfile.mkdtemp(prefix="ws-", dir=base))
    try:
        yield tmp / "w"
    finally:
        await asyncio.to_thread(safefs.remove_tree, tmp)


@contextlib.asynccontextmanager
async def unpacked(layout: Layout, chunks: AsyncIterator[bytes],
                   limits: archive.ArchiveLimits = UNPACK_LIMITS) -> AsyncIterator[Path]:
    """The archive in `chunks`, unpacked into a private folder (see the module)."""
    async with private_folder(layout) as work:
        work.mkdir(mode=0o700)
        fd = os.open(work, safefs.DIR_FLAGS)
        try:
            u = archive.Unpacker(fd, limits)
            try:
                async for c in chunks:
                    await asyncio.to_thread(u.feed, c)
                u.finish()
            finally:
                u.close()
        finally:
            os.close(fd)
        yield work


async def packed(work: Path, limits: archive.ArchiveLimits = CHECKOUT_LIMITS) -> AsyncIterator[bytes]:
    """The tree at `work` as tar chunks (its .git included: the sandbox's scratch repository)."""
    gen: Generator[bytes, None, None] = archive.pack_path(work, limits)
    try:
        while (data := await asyncio.to_thread(next, gen, None)) is not None:
            yield data
    finally:
        gen.close()
