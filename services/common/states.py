"""The one vocabulary of ticket and node states.

The value of each member is the word everything outside the wire uses: the
store's text column (unchanged since the first schema, so no migration), the
gateway's JSON-RPC results, the CLI, the UI and the metric label `state`. The
proto enums afe.scheduler.v1.TicketState / NodeState carry the same members
as `TICKET_STATE_<NAME>` / `NODE_STATE_<NAME>`; their numbers are looked up
by that name here, so a member without its proto value fails at import.
"""

from __future__ import annotations

from enum import StrEnum

from services._gen.afe.scheduler.v1 import scheduler_pb2 as _pb


class TicketState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    WAITING_APPROVAL = "waiting_approval"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def proto(self) -> _pb.TicketState.ValueType:
        """The afe.scheduler.v1.TicketState number."""
        return _TICKET_TO_PB[self]

    @classmethod
    def from_proto(cls, number: int) -> TicketState | None:
        """None for TICKET_STATE_UNSPECIFIED and numbers this build does not know."""
        return _TICKET_FROM_PB.get(number)

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


class NodeState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"
    CANCELLED = "cancelled"
    WAITING = "waiting"          # a builtin:merge / builtin:approval node waiting for a person

    @property
    def proto(self) -> _pb.NodeState.ValueType:
        """The afe.scheduler.v1.NodeState number."""
        return _NODE_TO_PB[self]

    @classmethod
    def from_proto(cls, number: int) -> NodeState | None:
        return _NODE_FROM_PB.get(number)


TERMINAL = frozenset({TicketState.SUCCEEDED, TicketState.FAILED, TicketState.CANCELLED})
LIVE = (TicketState.QUEUED, TicketState.RUNNING, TicketState.WAITING_APPROVAL)
NODE_TERMINAL = frozenset({NodeState.SUCCEEDED, NodeState.FAILED, NodeState.SKIPPED, NodeState.CANCELLED})

_TICKET_TO_PB = {s: _pb.TicketState.Value(f"TICKET_STATE_{s.name}") for s in TicketState}
_TICKET_FROM_PB: dict[int, TicketState] = {n: s for s, n in _TICKET_TO_PB.items()}
_NODE_TO_PB = {s: _pb.NodeState.Value(f"NODE_STATE_{s.name}") for s in NodeState}
_NODE_FROM_PB: dict[int, NodeState] = {n: s for s, n in _NODE_TO_PB.items()}
