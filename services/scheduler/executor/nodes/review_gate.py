"""What happens around a person's decision on a head (builtins.py calls it):

- `before_request(ctx, node, sha, pr)`: right before the approval of `sha`
  is asked — the clean-room verification of that head (R41,
  verification.py), then the signed record of the run (R42, run_record.py),
  which includes the verification's result. Returns what the
  `approval.requested` event carries of them.
- `after_decision(ctx, node, appr)`: a person approved or rejected `appr.sha`:
  the record is signed again with the decision (R42).
- `ensure_mergeable(ctx, node, appr)`: right before `builtin:merge` merges
  `appr.sha`: refuses a head whose verification merged onto the base's
  current tip did not pass (verifying again when the base moved), or whose
  harness change the approval did not acknowledge (R41).

Each part is idempotent for a (ticket, head): a resumed ticket repeats none.
"""

from __future__ import annotations

from typing import Any

from services.common.config.model import Node

from ...store.base import ApprovalRecord, PullRequestRecord
from ..context import RunContext
from . import run_record, verification


async def before_request(ctx: RunContext, node: Node, sha: str, pr: PullRequestRecord | None) -> dict[str, Any]:
    """What the approval request of `sha` carries (merged into `approval.requested`)."""
    gate: dict[str, Any] = {}
    verified = await verification.verify_head(ctx, node, sha, pr)
    if verified is not None:
        gate["verification"] = verified
    record = await run_record.sign_request(ctx, node, sha, pr, verified)
    if record is not None:
        gate["record"] = record
    return gate


async def after_decision(ctx: RunContext, node: Node, appr: ApprovalRecord) -> None:
    await run_record.sign_decision(ctx, node, appr)


async def ensure_mergeable(ctx: RunContext, node: Node, appr: ApprovalRecord) -> dict[str, Any] | None:
    return await verification.ensure_mergeable(ctx, node, appr)
