"""Follow-ups: a ticket that waits for approval or has ended runs its model
and agent nodes again with an instruction, on the same branch and pull
request, and asks for a new approval of the new head (Engine.reopen).

Two ways in, one path: `afe ticket followup ID "instruction"` (the
scheduler's FollowUpTicket RPC) and, for a pull request afe opened, a review
asking for changes, a review comment or a `/afe ...` comment by a person with
write access (github_intake.py). The instruction is stored with where it came
from (`ticket_followups`) and reaches the nodes only as quoted data (R36,
quoting.followup_section); it changes nothing of the workflow: its egress,
secrets and approval stay what the Workflow says.
"""

from __future__ import annotations

from typing import Any

from services.common.errors import FailedPrecondition, InvalidArgument

from .store import FollowUpRecord, TicketRecord
from .tickets import MAX_INPUT_BYTES

FOLLOWUP_KINDS = ("model", "agent")


def _clip_utf8(text: str, limit: int) -> str:
    data = text.encode("utf-8")
    return text if len(data) <= limit else data[:limit].decode("utf-8", errors="ignore")


async def follow_up(engine: Any, ticket_id: str, text: str, *, principal: str, author: str = "",
                    source: str = "operator", path: str = "", line: int = 0, url: str = "") -> Any:
    """Record `text` for the ticket's next run and re-open it. Returns the ticket's view."""
    text = (text or "").strip()
    if not text:
        raise InvalidArgument("a follow-up needs an instruction: what should change")
    t = engine.view(ticket_id).ticket
    wf = engine.config.workflows.get(t.workflow)
    if wf is not None and not any(n.kind in FOLLOWUP_KINDS for n in wf.nodes):
        raise FailedPrecondition(f"workflow {t.workflow!r} has no model or agent node to give the follow-up to; "
                                 "create a new ticket instead")
    rec = FollowUpRecord(ticket_id=ticket_id, at_ms=0, author=author or principal, source=source,
                         text=_clip_utf8(text, MAX_INPUT_BYTES), path=path[:500], line=max(0, int(line or 0)),
                         url=url[:500])

    def record(_t: TicketRecord, at_ms: int) -> None:
        rec.at_ms = at_ms
        engine.store.add_followup(rec)

    payload = {"followup": {"source": source, "author": rec.author, "path": rec.path, "line": rec.line,
                            "url": rec.url}}
    return await engine.reopen(ticket_id, principal, "follow-up", payload=payload, on_reopen=record)
