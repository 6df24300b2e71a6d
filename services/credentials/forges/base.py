"""What a forge does for the engine, whichever forge it is."""

from __future__ import annotations

import abc
from dataclasses import dataclass

from services.common.config.model import Workspace


@dataclass(frozen=True)
class PullRequestInfo:
    number: str
    url: str
    head_branch: str
    base_branch: str
    head_sha: str
    state: str                 # open | merged | closed
    merge_sha: str = ""


class Forge(abc.ABC):
    """A forge adapter. Callers check approvals (R16) before `merge`."""

    @abc.abstractmethod
    async def open_pull_request(self, ws: Workspace, head: str, base: str, title: str,
                                body: str) -> PullRequestInfo:
        """Create the PR for `head`, or return the open one (idempotent)."""

    @abc.abstractmethod
    async def get_pull_request(self, ws: Workspace, number: str) -> PullRequestInfo: ...

    @abc.abstractmethod
    async def merge_pull_request(self, ws: Workspace, number: str, sha: str, method: str,
                                 base_sha: str = "") -> str:
        """Merge exactly `sha` (the approved head); return the merge commit's sha. With
        `base_sha`, a forge that can refuses (Aborted) when the base's tip is no longer it."""

    @abc.abstractmethod
    async def comment(self, ws: Workspace, number: str, body: str) -> str: ...

    async def close(self) -> None:
        return None


MERGE_METHODS = ("merge", "squash", "rebase")
