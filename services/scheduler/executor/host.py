"""What a ticket's run may use of the engine that started it: `Host`.

The engine (engine/core.py) implements it; a run sees nothing else of the engine
(not its capacity bookkeeping, not its other tickets).
"""

from __future__ import annotations

from typing import Protocol

from services.common.config.model import Config
from services.common.secrecy.redact import Redactor

from ..events.log import EventLog
from ..sandboxes.brokers import CredentialBroker, SandboxBroker
from ..store.base import ApprovalRecord
from ..store.store import Store
from .transitions import Transitions


class Host(Protocol):
    config: Config
    store: Store
    events: EventLog
    sandbox: SandboxBroker
    credentials: CredentialBroker
    redactor: Redactor
    transitions: Transitions
    # How long preparation and a builtin step wait for a broker that went away (R37; 0: fail at once).
    broker_retry_s: float

    @property
    def owner(self) -> str:
        """This scheduler's id (its leases' owner), named in the events of the attempts it runs."""
        ...

    @property
    def checkpoints(self) -> bool:
        """Keep the workspace's state after each node that may change it, for a takeover's new
        attempt to start from (several schedulers share the store)."""
        ...

    @property
    def stopping(self) -> bool:
        """The scheduler is stopping: a cancelled node runs again on the next start."""
        ...

    def check_lease(self, ticket_id: str) -> None:
        """Raise `LeaseLost` unless this scheduler still drives the ticket (right before a side effect, R37)."""
        ...

    def fence(self, ticket_id: str) -> int:
        """The fence of this scheduler's lease on the ticket, sent with each side effect so the
        credential broker refuses it once a newer owner acted (R37); 0 = no lease store."""
        ...

    def lease_lost(self, ticket_id: str) -> bool:
        """Another scheduler took the ticket over: write nothing more for it."""
        ...

    def node_metric(self, kind: str, outcome: str, seconds: float) -> None: ...

    def usage_metric(self, model: str, input_tokens: int, output_tokens: int, cost_usd: float | None) -> None: ...

    async def wait_for_decision(self, ticket_id: str) -> ApprovalRecord:
        """Park the ticket (it stops counting against capacity) until a person
        approves or rejects; the caller has moved it to `waiting_approval`."""
        ...
