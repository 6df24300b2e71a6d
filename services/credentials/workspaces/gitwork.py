"""What the helpers of a ticket's git work (continuation.py, verification/checkout.py)
use of `WorkspaceGit` (host.py): its git runner, mirrors and layout,
the per-key locks, ref lookups and the workspace snapshot. Typed here as a
Protocol, so they need not import host.py, which imports them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Protocol

from services.common.host.gitcmd import GitRunner
from services.common.layout import Layout
from services.credentials.git.mirrors import Mirrors
from services.credentials.workspaces import capture


class GitWork(Protocol):
    git: GitRunner
    mirrors: Mirrors
    layout: Layout

    def _lock(self, key: str) -> asyncio.Lock: ...

    async def _rev(self, git_dir: Path, rev: str) -> str | None: ...

    async def _revs(self, git_dir: Path, revs: list[str]) -> list[str | None]: ...

    async def snapshot_tree(self, ticket_id: str, work: Path | None = None) -> capture.Snapshot: ...
