"""How a head's clean-room verification (R41) is shown outside the ticket:
one line for people (the merge refusal, the CLI) and, on a github forge, a
commit status `afe/verify` on the head (success / failure), set through the
credential broker's SetCommitStatus (fenced, R37) and recorded like the
ticket's own status (github_report.py), so it is set once per result. The
local forge has no statuses: its reviewers see the result on the approval
(UI, `afe ticket show/watch`)."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from services.common.verification import failure_line

from ..store.base import Store, TicketRecord

CONTEXT = "afe/verify"
STEP = "verify"


async def status(store: Store, credentials: Any, t: TicketRecord, sha: str, link: str, fence: int) -> None:
    """Set `afe/verify` on `sha` from its stored verification (nothing when there is none)."""
    rec = store.verification(t.id, sha)
    if rec is None:
        return
    state = "success" if rec.passed else "failure"
    description = failure_line(rec.result).replace("`", "")
    digest = hashlib.sha256(f"{sha} {state} {description}".encode()).hexdigest()[:32]
    known = store.report(t.id, STEP)
    if known is not None and known[1] == digest:
        return
    await credentials.set_status(t.workspace, sha, state, CONTEXT, description, link, t.id, fence)
    store.put_report(t.id, STEP, sha, digest, int(time.time() * 1000))
