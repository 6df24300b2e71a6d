"""The signed run records of a ticket's heads (R42, docs/GUIDE.md "The run
record"), kept in the store's `run_records` table: one DSSE envelope per
(ticket, head, kind), kind `request` (signed when the approval of the head
is asked) or `decision` (signed again with the person's decision). The
statements: repos/run_records.py (`store.run_records`), which keeps the
first envelope of a key.
"""

from __future__ import annotations

from dataclasses import dataclass

REQUEST, DECISION = "request", "decision"


@dataclass(frozen=True)
class RunRecord:
    ticket_id: str
    sha: str
    kind: str
    envelope: str
    at_ms: int
