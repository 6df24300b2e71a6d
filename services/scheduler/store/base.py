"""The store's records and words: what its repositories (store.py) take
and return, as plain dataclasses, the states as stored, `LeaseLost` and
`Lease`. Nothing here runs a statement or knows about gRPC.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from services.common import states
from services.common.errors import FailedPrecondition
from services.common.states import NodeState, TicketState

from .github_records import PollCursor, WorkClaim  # noqa: F401  (re-exported)
from .run_records import RunRecord  # noqa: F401  (re-exported)
from .verification_records import VerificationRecord  # noqa: F401  (re-exported)

# States are stored as the words of services/common/states.py (plain text, as since the first schema).
QUEUED = TicketState.QUEUED.value
RUNNING = TicketState.RUNNING.value
WAITING_APPROVAL = TicketState.WAITING_APPROVAL.value
SUCCEEDED = TicketState.SUCCEEDED.value
FAILED = TicketState.FAILED.value
CANCELLED = TicketState.CANCELLED.value
TERMINAL = frozenset(s.value for s in states.TERMINAL)
LIVE = tuple(s.value for s in states.LIVE)

N_PENDING = NodeState.PENDING.value
N_RUNNING = NodeState.RUNNING.value
N_SUCCEEDED = NodeState.SUCCEEDED.value
N_FAILED = NodeState.FAILED.value
N_SKIPPED = NodeState.SKIPPED.value
N_CANCELLED = NodeState.CANCELLED.value
N_WAITING = NodeState.WAITING.value
N_TERMINAL = frozenset(s.value for s in states.NODE_TERMINAL)


@dataclass
class TicketRecord:
    id: str
    workspace: str
    workflow: str
    title: str
    body: str
    inputs: dict[str, str]
    state: str
    created_at_ms: int
    updated_at_ms: int
    principal: str = ""
    error: str = ""
    tokens_used: int = 0
    awaiting_sha: str = ""
    torn_down: bool = False
    rowid: int = 0
    # Where the ticket came from ({} = a person through the UI, CLI or API); for a GitHub
    # trigger: source, event, url, author, trigger, and which texts are untrusted (R36).
    origin: dict[str, Any] = field(default_factory=dict)
    # When the ticket was last re-opened (Engine.reopen): approvals before it do not count (R16).
    reopened_at_ms: int = 0


@dataclass
class NodeRunRecord:
    ticket_id: str
    node_id: str
    kind: str
    state: str = N_PENDING
    needs: tuple[str, ...] = ()
    attempt: int = 0
    started_at_ms: int = 0
    finished_at_ms: int = 0
    output: str = ""
    error: str = ""
    rounds: int = 0          # on_failure rounds this node's failure sent back
    feedback: str = ""       # the failure text the latest on_failure round gave this node


class EventRecord(NamedTuple):
    """One event; a tuple in the column order of the events table."""

    ticket_id: str
    seq: int
    type: str
    payload_json: str
    at_ms: int


@dataclass
class ApprovalRecord:
    ticket_id: str
    principal: str
    sha: str
    granted: bool
    at_ms: int
    reason: str = ""
    # the harness files (R41) the person acknowledged this head changes
    accepted_harness_change: list[str] = field(default_factory=list)


def str_list(raw: object) -> list[str]:
    """A JSON list of strings as stored in a TEXT column ([] for anything else)."""
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return []
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


@dataclass
class PullRequestRecord:
    ticket_id: str
    number: str
    url: str = ""
    head_branch: str = ""
    base_branch: str = ""
    head_sha: str = ""
    state: str = "open"
    merge_sha: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class FollowUpRecord:
    """An instruction for a re-opened ticket's model and agent nodes (Engine.follow_up).
    `text` is untrusted when `source` is not "operator" (R36): quoted in the prompt."""

    ticket_id: str
    at_ms: int
    author: str
    source: str              # operator | github:review | github:review_comment | github:comment
    text: str
    path: str = ""           # a review comment's file
    line: int = 0            # and line
    url: str = ""
    # given: an instruction of the re-run that started at `at_ms` (`followups`); pending: received,
    # waiting for the ticket's next re-open (followups.FollowUpQueue); dropped: that re-open was refused
    state: str = "given"


FOLLOWUP_GIVEN, FOLLOWUP_PENDING, FOLLOWUP_DROPPED = "given", "pending", "dropped"
TERMINAL_STATES = tuple(sorted(TERMINAL))


class LeaseLost(FailedPrecondition):
    """This scheduler no longer drives the ticket: its lease expired and
    another scheduler took it over (a new fence). Nothing was written; the run
    stops without a side effect (R37, docs/SCALE.md)."""

    def __init__(self, ticket_id: str) -> None:
        super().__init__(f"ticket {ticket_id} is driven by another scheduler now (this one's lease expired); "
                         "this scheduler stopped its run without writing or pushing anything")
        self.ticket_id = ticket_id


@dataclass
class Lease:
    """A held ticket as its owner's heartbeat sees it (`Leases.renew`)."""

    ticket_id: str
    fence: int
    state: str
    cancel_by: str = ""
