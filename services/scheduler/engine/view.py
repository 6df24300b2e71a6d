"""`TicketView`: one ticket as the engine answers for it — its record, node
runs, pull request, latest decision and last event seq. Its own module, so
the engine's parts (approvals.py, leases.py, records.py, reopen.py) name it
without importing core.py, which is made of them."""

from __future__ import annotations

from dataclasses import dataclass

from ..store.base import ApprovalRecord, NodeRunRecord, PullRequestRecord, TicketRecord


@dataclass
class TicketView:
    ticket: TicketRecord
    nodes: list[NodeRunRecord]
    pr: PullRequestRecord | None
    approval: ApprovalRecord | None
    last_seq: int
