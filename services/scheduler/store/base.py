"""The scheduler's durable state behind one interface.

`Store` is what the engine sees: tickets, node runs, events, approvals and
pull-request records. `SqliteStore` (sqlite_store.py) is the embedded
default; a PostgreSQL implementation follows the same ABC without touching
the engine. Records are plain dataclasses; nothing here knows about gRPC.
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass, field
from typing import NamedTuple

from services.common import states
from services.common.errors import FailedPrecondition
from services.common.states import NodeState, TicketState

from .ci_records import CiRecords
from .github_records import PollCursor, WorkClaim
from .run_records import RunRecord, RunRecords  # noqa: F401  (re-exported)
from .verification_records import VerificationRecord, VerificationRecords  # noqa: F401  (re-exported)

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
    origin: dict = field(default_factory=dict)
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
    extra: dict = field(default_factory=dict)


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


# The statements both stores run (PostgreSQL's placeholders; SQLite's store swaps them for `?`).
FOLLOWUP_COLS = "ticket_id, at_ms, author, source, text, path, line, url, state"
# Insert the claim, or take over one that blocks nothing any more: its ticket has ended, or it has
# had no (stored) ticket for longer than the grace period (its creator crashed, the ticket is gone).
# One statement, on the primary key: of two concurrent claimers one inserts, the other sees its row
# (and joins its ticket). A ticket that does not exist counts only after the grace period because
# PostgreSQL checks the conflicting row at its newest version but reads `tickets` in the statement's
# snapshot: a claimer whose statement began just before the holder's ticket was committed sees the
# holder's ticket id but not the ticket (test_github_work_store.py has that interleaving).
# `{now}`: the store's clock (PostgreSQL: the database's, so the hosts' clocks do not matter).
# Parameters: repo, number, trigger, claim, [now,] [now,] grace_ms, then the TERMINAL states.
CLAIM_WORK = (
    "INSERT INTO github_work (repo, number, trigger_name, claim, ticket_id, claimed_at_ms) "
    "VALUES (%s,%s,%s,%s,'',{now}) ON CONFLICT (repo, number, trigger_name) DO UPDATE SET "
    "claim=excluded.claim, ticket_id='', claimed_at_ms=excluded.claimed_at_ms "
    "WHERE (github_work.claimed_at_ms<{now}-%s AND NOT EXISTS (SELECT 1 FROM tickets t "
    "WHERE t.id=github_work.ticket_id)) OR EXISTS (SELECT 1 FROM tickets t WHERE t.id=github_work.ticket_id "
    "AND t.state IN (" + ",".join(["%s"] * len(TERMINAL)) + "))")
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
    """A held ticket as its owner's heartbeat sees it (`Store.renew_leases`)."""

    ticket_id: str
    fence: int
    state: str
    cancel_by: str = ""


class Store(CiRecords, RunRecords, VerificationRecords, abc.ABC):
    """Durable state. Every method commits before it returns.

    Leases (docs/SCALE.md): a store that several schedulers share (`shared`)
    hands each live ticket to one of them (`claim_ticket`, with a fence that
    every claim bumps), refuses the writes of a scheduler whose fence is not
    the ticket's (`LeaseLost`) for the tickets in `fences`, and lets the
    owner renew (`renew_leases`). A store of one scheduler (SQLite) owns
    everything: the defaults below."""

    shared = False                 # several schedulers may use this store at once
    owner = ""                     # this scheduler's id (the engine sets it)

    @property
    def fences(self) -> dict[str, int]:
        """Ticket -> the fence this scheduler holds (its writes of these tickets are checked)."""
        f = self.__dict__.get("_fences")
        if f is None:
            f = self.__dict__["_fences"] = {}
        return f

    def claim_ticket(self, ticket_id: str, states: tuple[str, ...], lease_ms: int) -> int | None:
        """Take the ticket when it is in one of `states` and free (no owner, this
        owner, or an expired lease): returns the new fence, None when it is not."""
        t = self.get_ticket(ticket_id)
        return 1 if t is not None and t.state in states else None

    def expired_tickets(self, states: tuple[str, ...]) -> list[str]:
        """Tickets in `states` whose lease has expired (another scheduler died), oldest first."""
        return []

    def renew_leases(self, ticket_ids: list[str], lease_ms: int) -> list[Lease]:
        """Extend this owner's leases of `ticket_ids`; returns the ones it still holds."""
        return [Lease(tid, self.fences.get(tid, 1), (t.state if (t := self.get_ticket(tid)) else ""))
                for tid in ticket_ids]

    def holds(self, ticket_id: str, fence: int) -> bool:
        """This owner holds the ticket with `fence` and its lease has not expired (the database's clock)."""
        return True

    def release_ticket(self, ticket_id: str) -> None:
        """Give up the ticket (it ended, or this scheduler stops): another may claim it at once."""
        self.fences.pop(ticket_id, None)

    def request_cancel(self, ticket_id: str, principal: str) -> None:
        """Ask the ticket's owner to cancel it (seen on its next heartbeat); one
        scheduler drives every ticket of an unshared store, so never called there."""
        raise NotImplementedError

    @abc.abstractmethod
    def close(self) -> None: ...

    @abc.abstractmethod
    def ping(self) -> bool: ...

    # tickets
    @abc.abstractmethod
    def create_ticket(self, ticket: TicketRecord, nodes: list[NodeRunRecord],
                      first_events: list[EventRecord]) -> TicketRecord:
        """Insert the ticket, its pending node runs and its first events atomically."""

    @abc.abstractmethod
    def get_ticket(self, ticket_id: str) -> TicketRecord | None: ...

    @abc.abstractmethod
    def list_tickets(self, states: list[str] | None = None, workspace: str | None = None,
                     limit: int = 50, before_rowid: int | None = None) -> list[TicketRecord]:
        """Newest first; `before_rowid` pages backwards."""

    @abc.abstractmethod
    def update_ticket(self, ticket_id: str, **fields: object) -> None: ...

    @abc.abstractmethod
    def tickets_in_states(self, states: tuple[str, ...]) -> list[TicketRecord]:
        """Oldest first (creation order)."""

    @abc.abstractmethod
    def terminal_not_torn_down(self) -> list[TicketRecord]: ...

    def count_by_state(self) -> dict[str, int]:
        """How many tickets are in each state (the `afe_tickets` gauge)."""
        counts: dict[str, int] = {}
        for t in self.list_tickets(limit=1 << 30):
            counts[t.state] = counts.get(t.state, 0) + 1
        return counts

    # node runs
    @abc.abstractmethod
    def node_runs(self, ticket_id: str) -> list[NodeRunRecord]: ...

    @abc.abstractmethod
    def update_node(self, ticket_id: str, node_id: str, **fields: object) -> None: ...

    # events
    @abc.abstractmethod
    def append_events(self, events: list[EventRecord]) -> None: ...

    @abc.abstractmethod
    def events(self, ticket_id: str, from_seq: int, limit: int = 1000) -> list[EventRecord]: ...

    @abc.abstractmethod
    def last_seq(self, ticket_id: str) -> int: ...

    # approvals and pull requests
    @abc.abstractmethod
    def add_approval(self, approval: ApprovalRecord) -> None: ...

    @abc.abstractmethod
    def latest_approval(self, ticket_id: str) -> ApprovalRecord | None: ...

    @abc.abstractmethod
    def put_pr(self, pr: PullRequestRecord) -> None: ...

    @abc.abstractmethod
    def get_pr(self, ticket_id: str) -> PullRequestRecord | None: ...

    # records that outlive the ticket
    @abc.abstractmethod
    def put_final_diff(self, ticket_id: str, diff: str, truncated: bool, at_ms: int) -> None:
        """The ticket's diff against its base, taken before its workspace is released."""

    @abc.abstractmethod
    def final_diff(self, ticket_id: str) -> tuple[str, bool] | None:
        """(diff, truncated) as stored by `put_final_diff`, or None."""

    # GitHub intake (github_intake.py)
    @abc.abstractmethod
    def claim_once(self, key: str, at_ms: int) -> bool:
        """Record `key` (a delivery id, a polled event id, ...) and return True, or
        return False when it was recorded before: what it guards happens once (R35)."""

    @abc.abstractmethod
    def release_once(self, key: str) -> None:
        """Forget a claimed `key`: its handling failed before it was done, so a
        redelivery must be handled rather than refused as seen."""

    @abc.abstractmethod
    def poll_cursor(self, workspace: str) -> PollCursor:
        """Where the workspace's polling stands; PollCursor() before its first listing."""

    @abc.abstractmethod
    def put_poll_cursor(self, workspace: str, cursor: PollCursor, at_ms: int) -> None: ...

    def ticket_for_pr(self, workspace: str, number: str) -> str | None:
        """The ticket whose pull request in `workspace` is `number`, if afe opened it."""
        raise NotImplementedError

    # One ticket per piece of work (github_intake.py, docs/GITHUB.md "One ticket per issue")
    @abc.abstractmethod
    def claim_work(self, repo: str, number: int, trigger: str, claim: str, at_ms: int,
                   grace_ms: int) -> WorkClaim | None:
        """Claim (repo, number, trigger) for a ticket about to be created, in one
        atomic statement (INSERT ... ON CONFLICT on the table's primary key): the
        row is inserted when there is none, and replaced when its ticket has
        ended, or when it has had no stored ticket for more than `grace_ms`
        (its creator crashed, or the ticket is gone). `at_ms`: now, on the caller's clock
        (a store shared by several hosts uses its own clock instead). Returns the claim as stored
        afterwards: `claim` equal to the argument means this caller holds it;
        another token means another delivery or scheduler does (join its
        ticket); None: the row went away meanwhile (try again)."""

    @abc.abstractmethod
    def set_work_ticket(self, repo: str, number: int, trigger: str, claim: str, ticket_id: str) -> bool:
        """Record the ticket of this caller's claim; False when the claim is no longer its own."""

    @abc.abstractmethod
    def release_work(self, repo: str, number: int, trigger: str, claim: str) -> None:
        """Give up this caller's claim (its ticket could not be created), so the next event may start one."""

    # follow-ups and reports (followups.py, github_report.py)
    def add_followup(self, rec: FollowUpRecord) -> None:
        """Store `rec` (in its `state`: given, or pending for the ticket's next re-open)."""
        raise NotImplementedError

    def followups(self, ticket_id: str, since_ms: int) -> list[FollowUpRecord]:
        """The ticket's follow-ups given to a re-run at or after `since_ms`, oldest first."""
        raise NotImplementedError

    @abc.abstractmethod
    def pending_followups(self, ticket_id: str) -> list[FollowUpRecord]:
        """The ticket's follow-ups waiting for its next re-open, oldest first."""

    @abc.abstractmethod
    def give_followups(self, ticket_id: str, at_ms: int) -> int:
        """Give every pending follow-up of the ticket to the re-run that started at
        `at_ms` (state given, at_ms); returns how many. One statement: a follow-up
        is given to one re-run only, also with several schedulers."""

    @abc.abstractmethod
    def drop_followups(self, ticket_id: str) -> list[FollowUpRecord]:
        """Mark the ticket's pending follow-ups dropped (it cannot be re-opened any
        more); returns the ones this call dropped."""

    @abc.abstractmethod
    def tickets_with_pending_followups(self) -> list[str]:
        """Tickets that have follow-ups waiting (after a restart: their re-open is still owed)."""

    def report(self, ticket_id: str, step: str) -> tuple[str, str] | None:
        """(comment id, digest) of the report `step` of the ticket, as last recorded."""
        raise NotImplementedError

    def put_report(self, ticket_id: str, step: str, comment_id: str, digest: str, at_ms: int) -> None:
        raise NotImplementedError

    # sandbox placement on several sandbox brokers (placement.py, docs/SCALE.md)
    def place_sandbox(self, ticket_id: str, broker: str, at_ms: int) -> None:
        """Record that the sandbox of `ticket_id` (a ticket, or a warm sandbox's reserved id) is on `broker`."""
        raise NotImplementedError

    def sandbox_placement(self, ticket_id: str) -> str | None:
        """The broker `place_sandbox` recorded for the ticket, None when none is."""
        raise NotImplementedError

    def unplace_sandbox(self, ticket_id: str) -> None:
        raise NotImplementedError
