"""What a ticket leaves behind: its diff against its base (stored before its
workspace goes, shown after it ended), the hosts its egress proxy refused,
and the metrics of its nodes and model calls; and the head its pull request
has on the forge now (what `afe verify` checks the signed records against).

`Records` holds no state of its own: it reads and writes through the
store, the brokers and the metrics it is given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from services.common.config.model import Config
from services.common.errors import AfeError, FailedPrecondition
from services.common.observability.metrics import SchedulerMetrics, UsageMetrics
from services.common.secrecy.redact import Redactor

from ..events.log import EventLog, now_ms
from ..sandboxes import egress_report
from ..sandboxes.brokers import CredentialBroker, SandboxBroker
from ..store.base import QUEUED, TERMINAL, TicketRecord
from ..store.store import Store
from .view import TicketView

log = logging.getLogger(__name__)

DIFF_MAX_BYTES = 1024 * 1024


class Records:
    """The final diff, the denied egress, node and usage metrics."""

    def __init__(self, config: Config, store: Store, sandbox: SandboxBroker, credentials: CredentialBroker,
                 redactor: Redactor, events: EventLog, metrics: SchedulerMetrics | None,
                 usage: UsageMetrics | None, view: Callable[[str], TicketView]) -> None:
        self.config = config
        self.store = store
        self.sandbox = sandbox
        self.credentials = credentials
        self.redactor = redactor
        self.events = events
        self.metrics = metrics
        self.usage = usage
        self.view = view

    async def diff(self, ticket_id: str) -> tuple[str, bool, bool]:
        """(diff, truncated, recorded): the live workspace's diff, or, once the
        ticket ended, the one stored when it ended (its workspace is gone)."""
        t = self.view(ticket_id).ticket
        if t.state in TERMINAL:
            rec = self.store.diffs.final_diff(t.id)
            if rec is not None:
                return rec[0], rec[1], True
        if t.torn_down or t.state == QUEUED:
            raise FailedPrecondition(f"ticket {ticket_id} is {t.state} and has no workspace"
                                     + (" and no stored diff (it ended before it changed anything)"
                                        if t.state in TERMINAL else " yet; try again once it runs"))
        r = await self.credentials.diff(t.id, t.workspace, DIFF_MAX_BYTES)
        return r.diff, r.truncated, False

    async def forge_head(self, ticket_id: str) -> tuple[str, str]:
        """(the head of the ticket's pull request as the forge has it now, why it is not
        known): `afe verify` checks that head, not only the one afe stored (a person may have
        pushed to the branch since). ("", "") without a pull request."""
        t = self.view(ticket_id).ticket
        pr = self.store.prs.get_pr(t.id)
        if pr is None or not pr.number:
            return "", ""
        try:
            current = await self.credentials.get_pr(t.workspace, pr.number)
        except AfeError as exc:
            return "", exc.message
        return current.head_sha.lower(), ""

    async def record_diff(self, t: TicketRecord) -> None:
        """The ticket's diff against its base, stored before its workspace goes,
        so it is shown after the ticket ended (also when it failed or was cancelled)."""
        if t.workspace not in self.config.workspaces:
            return
        try:
            r = await self.credentials.diff(t.id, t.workspace, DIFF_MAX_BYTES)
        except AfeError as exc:   # no workspace (ended before it was prepared) or the broker is away
            log.info("ticket %s: no diff to keep: %s", t.id, exc.message)
            return
        self.store.diffs.put_final_diff(t.id, self.redactor.redact(r.diff), r.truncated, now_ms())

    async def record_denied_egress(self, t: TicketRecord) -> None:
        """The hosts the ticket's egress proxy refused, as an event before its sandbox
        goes (the final GitHub comment lists them, egress_report.py)."""
        try:
            r = await self.sandbox.denied_egress(t.id)
        except AfeError:      # no sandbox (none needed, or ended before one was made) or the broker is away
            return
        if r.hosts:
            self.events.append(t.id, egress_report.EVENT, egress_report.payload(r))
            self.events.flush()

    def node_metric(self, kind: str, outcome: str, seconds: float) -> None:
        if self.metrics is not None:
            k = kind.split(":")[0]
            self.metrics.node_duration.labels(kind=k, outcome=outcome).observe(seconds)

    def usage_metric(self, model: str, input_tokens: int, output_tokens: int, cost_usd: float | None) -> None:
        """Count a model call's tokens and estimated cost; `model` is a Model manifest name."""
        if self.usage is None or model not in self.config.models:
            return
        self.usage.tokens.labels(model=model, direction="input").inc(max(0, input_tokens))
        self.usage.tokens.labels(model=model, direction="output").inc(max(0, output_tokens))
        if cost_usd:
            self.usage.cost.labels(model=model).inc(cost_usd)

