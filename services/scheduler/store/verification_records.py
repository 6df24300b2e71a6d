"""Clean-room verifications (R41, executor/nodes/verification.py), kept in
the store's `verification_runs` table : one row per
(ticket, commit, base tip, verify: configuration, kind), whose `result` is
the `verification.finished` event's payload (the run record, R42, reads it
from there). kind 'head' is a ticket's head merged onto the base tip; kind
'base' is the base tip's own run of the same commands, whose test counts a
head must not fall below. The statements: repos/verifications.py
(`store.verifications`): a row is written once (INSERT ... ON CONFLICT DO
NOTHING), so a retried or repeated write keeps the first result.

A verification that could not run (a dead sandbox, a missing image) is
never stored: it is no verdict on the head.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HEAD, BASE = "head", "base"


@dataclass
class VerificationRecord:
    ticket_id: str
    sha: str
    passed: bool
    at_ms: int
    result: dict[str, Any] = field(default_factory=dict)
    base_sha: str = ""
    config: str = ""
    kind: str = HEAD
