"""The signed record of a run for each head afe asks approval for (R42).
(Being built: issue #24, part 3.)"""

from __future__ import annotations

from typing import Any

from services.common.config import Node

from ...store import ApprovalRecord, PullRequestRecord
from ..context import RunContext


async def sign_request(ctx: RunContext, node: Node, sha: str, pr: PullRequestRecord | None,
                       verification: dict[str, Any] | None) -> dict[str, Any] | None:
    """Sign (once per ticket and head) the record of the run that made `sha`; what the approval shows of it."""



async def sign_decision(ctx: RunContext, node: Node, appr: ApprovalRecord) -> None:
    """Sign the record again with the decision on `appr.sha`."""
