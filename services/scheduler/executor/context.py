"""`RunContext`: what the node kinds (nodes/) share for one ticket — the
ticket and its workflow, the brokers, the outputs so far, template rendering,
and the preparation every sandbox node needs first: the workspace (credential
broker), the ticket's model relay (R32) and the sandbox (sandbox broker).

The ticket's text is data: `render` substitutes it into prompts and PR text
(templates.py); `render_command` passes it to a `run:` command as arguments,
never as shell code (R36); it never reaches tools, egress or config.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from services.common import cost
from services.common.config.model import Agent, Node
from services.common.errors import AfeError, PeerUnavailable, ResourceExhausted
from services.common.relayenv import relay_env, relay_mcp_url

from ..sandboxes.spec import SANDBOX_KINDS, agent_env_names, relay_mcp, relay_models, sandbox_spec
from ..store.base import TicketRecord
from . import brokercalls, quoting, templates
from .graph import ancestors
from .host import Host

log = logging.getLogger(__name__)

T = TypeVar("T")


class RunContext:
    def __init__(self, host: Host, ticket: TicketRecord) -> None:
        self.host = host
        self.ticket = ticket
        self.config = host.config
        self.workflow = host.config.workflows[ticket.workflow]
        self.workspace = host.config.workspaces[ticket.workspace]
        self.store = host.store
        self.sandbox = host.sandbox
        self.credentials = host.credentials
        self.outputs: dict[str, str] = {}
        self.feedback: dict[str, str] = {}   # node -> failure text of the latest on_failure round
        self.attempts: dict[str, int] = {}   # node -> its attempt now (TicketRun.run_node); events carry it
        self._ancestors: dict[str, set[str]] | None = None   # on first use: the graph is checked first
        self._ws_ready = False
        self._sb_ready = False
        self._relay_cap = ""
        self._relay_id = ""
        self._relay_counted: dict[str, tuple[int, int]] | None = None
        self._mcp_seen = 0          # the last MCP call of this relay recorded as an `mcp.call` event (R43)
        self._prep_lock = asyncio.Lock()

    def emit(self, type_: str, payload: dict[str, Any]) -> None:
        self.host.events.append(self.ticket.id, type_, payload)

    def render(self, template: str, node_id: str) -> str:
        """`template` with the ticket's fields and the outputs of the nodes `node_id` needs."""
        return templates.render(template, self._fields(), self._visible(node_id))

    def render_command(self, script: str, node_id: str) -> tuple[str, list[str]]:
        """(script, arguments) of a `run:` line: values as positional parameters (R36)."""
        return templates.render_command(script, self._fields(), self._visible(node_id))

    def _fields(self) -> dict[str, object]:
        t = self.ticket
        return {"id": t.id, "title": t.title, "body": t.body, "inputs": t.inputs}

    def _visible(self, node_id: str) -> dict[str, str]:
        if self._ancestors is None:
            self._ancestors = ancestors(self.workflow.nodes)
        return {k: v for k, v in self.outputs.items() if k in self._ancestors[node_id]}

    def prompt(self, node: Node) -> str:
        """A model or agent node's prompt: its template with the ticket's
        untrusted texts quoted, then the follow-ups of this re-run, quoted (R36)."""
        t = self.store.tickets.get(self.ticket.id) or self.ticket
        visible = {k: v for k, v in self.outputs.items() if k in self._node_ancestors(node.id)}
        text = templates.render(node.prompt or "", quoting.prompt_fields(t), visible)
        if t.reopened_at_ms:
            text += quoting.followup_section(self.store.followups.followups(t.id, t.reopened_at_ms))
        feedback = self.feedback.get(node.id)
        if feedback:   # an on_failure round (TicketRun): a later node's failure, sandbox-made text (R36)
            text += ("\n\nA later step failed after your previous attempt; fix the cause. Its output:\n"
                     + quoting.quote(feedback, source="the failing step's output in the sandbox"))
        data = text.encode("utf-8", "surrogatepass")   # its digest goes into the run record (R42)
        self.emit("node.prompt_digest", {"node": node.id, "sha256": hashlib.sha256(data).hexdigest(),
                                         "bytes": len(data)})
        return text

    def _node_ancestors(self, node_id: str) -> set[str]:
        if self._ancestors is None:
            self._ancestors = ancestors(self.workflow.nodes)
        return self._ancestors[node_id]

    def record_usage(self, node_id: str, model_name: str, input_tokens: int, output_tokens: int,
                     **extra: Any) -> None:
        """A `model.usage` event (tokens and the estimated cost, services/common/cost.py) and the
        usage metrics; the ticket's token total is added to by the caller (add_tokens)."""
        payload = cost.usage_payload(node_id, self.config.models.get(model_name), model_name,
                                     input_tokens, output_tokens)
        self.emit("model.usage", {**payload, **extra})
        self.host.usage_metric(model_name, input_tokens, output_tokens, payload.get("cost_usd"))

    def add_tokens(self, n: int) -> int:
        """Add `n` to the ticket's tokens used; returns the new total."""
        t = self.store.tickets.get(self.ticket.id)
        total = (t.tokens_used if t else 0) + n
        self.store.tickets.update(self.ticket.id, tokens_used=total)
        return total

    async def step(self, node: Node, name: str, fn: Callable[[], Awaitable[T]]) -> T:
        """A builtin step's credential broker call, waited through a broker restart (R37),
        made only while this scheduler holds the ticket's lease (checked before each try)."""
        tid = self.ticket.id

        async def fenced() -> T:
            self.host.check_lease(tid)
            return await fn()

        return await brokercalls.step(self.host.broker_retry_s, self.emit, node.id, name, fenced)

    # ---- checkpoints: a takeover's re-run starts from the last completed node ----------

    async def checkpoint(self, node: Node) -> None:
        """After `node` (it may have changed the workspace) and before it is stored as succeeded: the
        credential broker keeps the workspace's state after it, with the sandbox frozen, for a
        takeover's new attempt of a later node to start from (`restore`). A checkpoint that cannot
        be kept fails nothing: the event says so, and a restore after this node is refused later."""
        tid, ws = self.ticket.id, self.workspace.name
        try:
            async with self._frozen():
                r = await self.step(node, "checkpoint", lambda: self.credentials.checkpoint(
                    tid, ws, node.id, self.host.fence(tid)))
        except AfeError as exc:
            if self.host.lease_lost(tid):
                raise
            log.warning("ticket %s: no checkpoint after node %s: %s", tid, node.id, exc.message)
            self.emit("workspace.checkpoint", {"after": node.id, "error": exc.message[:500]})
            return
        self.emit("workspace.checkpoint", {"after": node.id, "sha": r.sha})

    async def restore(self, after: str, attempt: int) -> None:
        """Before a new attempt of an interrupted node: the workspace back to its state after node
        `after` ("": the branch head), not the files the interrupted attempt left. Refused (that
        checkpoint was never kept here, or the workspace is on another host): the event says so and
        the attempt runs on the files as they are."""
        tid, ws = self.ticket.id, self.workspace.name
        await self.ensure_workspace()
        try:
            async with self._frozen():
                self.host.check_lease(tid)
                r = await brokercalls.retry_unavailable(
                    self.host.broker_retry_s, "restoring the workspace",
                    lambda: self.credentials.restore(tid, ws, after, self.host.fence(tid)), PeerUnavailable)
        except AfeError as exc:
            if self.host.lease_lost(tid):
                raise
            log.warning("ticket %s: workspace not restored: %s", tid, exc.message)
            self.emit("workspace.restored", {"after": after, "attempt": attempt, "restored": False,
                                             "error": exc.message[:500]})
            return
        self.emit("workspace.restored", {"after": after, "attempt": attempt, "restored": True, "sha": r.sha})

    @contextlib.asynccontextmanager
    async def _frozen(self) -> AsyncIterator[None]:
        """The ticket's sandbox frozen for the block, when it has one (nothing in it writes meanwhile)."""
        frozen = False
        try:
            await self.sandbox.freeze(self.ticket.id, True)
            frozen = True
        except AfeError:
            pass            # no sandbox (yet): nothing runs that could write
        try:
            yield
        finally:
            if frozen:
                with contextlib.suppress(AfeError):
                    await asyncio.shield(self.sandbox.freeze(self.ticket.id, False))

    # ---- preparation ------------------------------------------------------------

    def uses_sandbox(self) -> bool:
        return any(n.kind in SANDBOX_KINDS for n in self.workflow.nodes)

    @property
    def sandbox_ready(self) -> bool:
        return self._sb_ready

    async def ensure_workspace(self) -> None:
        async with self._prep_lock:
            if self._ws_ready:
                return
            tid, ws = self.ticket.id, self.workspace.name
            self.host.check_lease(tid)
            r = await brokercalls.retry_unavailable(self.host.broker_retry_s, "preparing the workspace",
                                                    lambda: self.credentials.prepare(tid, ws), PeerUnavailable)
            self._ws_ready = True
            self.emit("workspace.ready", {"base_sha": r.base_sha, "branch": r.branch})

    async def ensure_sandbox(self) -> None:
        await self.ensure_workspace()
        async with self._prep_lock:
            if self._sb_ready:
                return
            spec = sandbox_spec(self.config, self.workflow, self.workspace)
            if spec.relay:   # the relay's folder must exist before the sandbox mounts it (R32)
                await self.open_relay(None)
            self.host.check_lease(self.ticket.id)
            s = await brokercalls.retry_unavailable(self.host.broker_retry_s, "creating the sandbox",
                                                    lambda: self.sandbox.create(self.ticket.id, spec))
            self._sb_ready = True
            self.emit("sandbox.ready", {"image": s.image, "egress": list(spec.egress),
                                        "network": bool(s.network)})
            if spec.env_names:   # names only, never values (R9, R43): also in the run record (R42)
                self.emit("sandbox.env_names", {"names": list(spec.env_names),
                                                "agents": agent_env_names(self.config, self.workflow)})

    # ---- the model relay (R32) ----------------------------------------------------
    #
    # The relay counts every token it serves for the ticket, whichever process in the
    # sandbox made the call (an agent, a `run:` command, something either left running).
    # `account_relay` adds what it counted since the last look to the ticket's tokens
    # (`model.usage` events carrying `relay`, the relay's id, and its running counts), so
    # the budget each `open_relay` gives the relay is what the ticket really has left.

    async def open_relay(self, node: Node | None) -> None:
        """Open (idempotent: again after a broker restart) the ticket's relay
        with the budget for `node`: a cap on all the relay counts for the
        ticket, namely what it counted so far plus what the Workflow's
        maxTokens leaves for the ticket, and at most the node's max_tokens."""
        await self._open_relay(node)
        if await self.account_relay(node.id if node is not None else "", "before"):
            await self._open_relay(node)     # tokens nobody had counted yet: the cap shrinks by them

    async def _open_relay(self, node: Node | None) -> None:
        tid, limit_s = self.ticket.id, self.host.broker_retry_s
        usage = await brokercalls.retry_unavailable(limit_s, "reading the model relay's usage",
                                                    lambda: self.credentials.relay_usage(tid), PeerUnavailable)
        limits = []
        if self.workflow.max_tokens:
            t = self.store.tickets.get(tid)
            limits.append(self.workflow.max_tokens - (t.tokens_used if t else 0))
        if node is not None and node.max_tokens:
            limits.append(node.max_tokens)
        if limits and min(limits) <= 0:
            raise ResourceExhausted(f"the ticket's token budget of {self.workflow.max_tokens} is spent; raise "
                                    f"maxTokens on workflow {self.workflow.name!r} to allow more")
        budget = usage.total_tokens + min(limits) if limits else 0
        models = relay_models(self.config, self.workflow)
        mcp = relay_mcp(self.config, self.workflow)
        r = await brokercalls.retry_unavailable(limit_s, "opening the model relay",
                                                lambda: self.credentials.open_relay(tid, models, budget, mcp),
                                                PeerUnavailable)
        if r.capability != self._relay_cap:
            self.host.redactor.register(r.capability)   # a placeholder, but no event needs to show it
            self._relay_cap = r.capability
            # The relay's id in events: a new capability is a new relay (the ticket re-opened), counting from 0.
            self._relay_id = hashlib.sha256(r.capability.encode()).hexdigest()[:16]
            self._relay_counted = None
            self._mcp_seen = 0

    def agent_env(self, agent: Agent) -> dict[str, str]:
        """The agent process's literal environment: its fixed settings and,
        for an agent with a Model, the relay's base URL and capability."""
        env = dict(getattr(agent, "fixed_env", ()) or ())
        if agent.model:
            m = self.config.models[agent.model]
            env.update(relay_env(agent.relay_env, provider=m.provider, model_name=m.name, model_id=m.model,
                                 capability=self._relay_cap))
        return env

    def agent_mcp_servers(self, node: Node) -> list[tuple[str, str, str]]:
        """(name, URL inside the sandbox, capability) of each remote MCP server the workflow grants
        agent node `node`: reached through the ticket's relay, which alone holds its credential (R43)."""
        if not self._relay_cap:
            return []
        return [(name, relay_mcp_url(name), self._relay_cap) for name in relay_mcp(self.config, self.workflow,
                                                                                  node.id)]

    async def settle_relay(self, node: Node | None) -> None:
        """After a node that ran in the sandbox, and at the ticket's end: what the
        relay counted since the last look becomes the ticket's."""
        await self.account_relay(node.id if node is not None else "", "after" if node is not None else "end")

    def _counted(self) -> dict[str, tuple[int, int]]:
        """Per Model, the relay's (input, output) counts already added to the
        ticket: the latest `model.usage` event of this relay (a scheduler that
        took the ticket over, or restarted, reads them back from the events)."""
        if self._relay_counted is None:
            self.host.events.flush()
            counted: dict[str, tuple[int, int]] = {}
            seq = 0
            while True:
                batch = self.store.events.read(self.ticket.id, seq, 1000)
                for e in batch:
                    if e.type in ("model.usage", "mcp.call") and f'"{self._relay_id}"' in e.payload_json:
                        p = json.loads(e.payload_json)
                        if p.get("relay") != self._relay_id:
                            continue
                        if e.type == "mcp.call":
                            self._mcp_seen = max(self._mcp_seen, int(p.get("seq") or 0))
                        else:
                            counted[str(p.get("model"))] = (int(p.get("ticket_input_tokens") or 0),
                                                            int(p.get("ticket_output_tokens") or 0))
                if len(batch) < 1000:
                    break
                seq = batch[-1].seq + 1
            self._relay_counted = counted
        return self._relay_counted

    async def account_relay(self, node_id: str, when: str) -> int:
        """`model.usage` events (node `node_id`; `counted`: before, after the node
        or at the ticket's end) for what the relay counted and the ticket has not
        yet, added to the ticket's tokens; returns how many were added."""
        tid = self.ticket.id
        if not self._relay_cap or self.host.lease_lost(tid):
            return 0
        counted = self._counted()
        try:
            usage = await self.credentials.relay_usage(tid, self._mcp_seen + 1)
        except AfeError as exc:
            log.warning("ticket %s: could not read the model relay's usage (counted at the next look): %s",
                        tid, exc.message)
            return 0
        self._record_mcp_calls(node_id, usage)
        added = 0
        for m in usage.models:
            i0, o0 = counted.get(m.model, (0, 0))
            di, do = max(0, m.input_tokens - i0), max(0, m.output_tokens - o0)
            if di or do:
                added += di + do
                counted[m.model] = (m.input_tokens, m.output_tokens)
                self.record_usage(node_id, m.model, di, do, relay=self._relay_id, counted=when,
                                  ticket_input_tokens=m.input_tokens, ticket_output_tokens=m.output_tokens,
                                  budget_tokens=usage.budget_tokens)
        if added:
            self.add_tokens(added)
        return added

    def _record_mcp_calls(self, node_id: str, usage: Any) -> None:
        """An `mcp.call` event for each MCP call the relay made since the last look (R43): names,
        digests, outcome and sizes, never the arguments or the result (R36); also in the run record."""
        calls = list(getattr(usage, "mcp_calls", ()))
        if not calls and not getattr(usage, "mcp_calls_total", 0):
            return
        first = calls[0].seq if calls else usage.mcp_calls_total + 1
        if first > self._mcp_seen + 1:      # the relay kept only its latest calls: say how many were lost
            self.emit("mcp.call", {"server": "", "tool": "", "outcome": "not_recorded", "node": node_id,
                                   "via": "relay", "relay": self._relay_id, "seq": first - 1,
                                   "missed": first - 1 - self._mcp_seen})
        for c in calls:
            if c.seq <= self._mcp_seen:
                continue
            # the payload of services/common/mcpcall.py, with the relay's own fields (who made the call
            # is unknown to the relay: the node is the one that ran, or ended, before this look)
            self.emit("mcp.call", {"server": c.server, "tool": c.tool, "arguments_sha256": c.arguments_sha256,
                                   "outcome": c.outcome, "request_bytes": c.request_bytes,
                                   "response_bytes": c.response_bytes, "duration_ms": c.duration_ms,
                                   **({"reason": c.reason[:300]} if c.reason else {}), "node": node_id,
                                   "via": "relay", "relay": self._relay_id, "seq": c.seq,
                                   "tool_sha256": c.tool_sha256, "at_ms": c.at_ms})
            self._mcp_seen = c.seq
        self._mcp_seen = max(self._mcp_seen, first - 1)
