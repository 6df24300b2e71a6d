"""Clean-room verification of a head before its approval is asked (R41).
(Being built: issue #24, part 1.)"""

from __future__ import annotations

from typing import Any

from services.common.config import Node

from ...store import PullRequestRecord
from ..context import RunContext


async def verify_head(ctx: RunContext, node: Node, sha: str, pr: PullRequestRecord | None) -> dict[str, Any] | None:
    """The verification of `sha` (run once per ticket and head), or None when the workflow declares none."""
    return None


def check_mergeable(ctx: RunContext, node: Node, sha: str) -> None:
    """Raise unless `sha` may be merged: its verification passed (when the workflow declares one)."""
