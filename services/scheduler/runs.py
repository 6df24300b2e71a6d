"""One ticket's workflow run: the node graph from `needs` (independent
branches in parallel), per-node timeout and retries, and the node kinds
(run, model, agent, builtin:commit|open_pr|approval|merge).

The ticket's text is data: it is substituted into prompts and PR text by
`templates.render` and never into commands, tools, egress or config.
"""

from __future__ import annotations

import asyncio
import logging
import time

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services.common.config import Agent, Config, Node, Workflow, Workspace
from services.common.errors import (
    AfeError,
    DeadlineExceeded,
    FailedPrecondition,
    PeerUnavailable,
    ResourceExhausted,
    Unavailable,
)
from services.common.relayenv import relay_env

from . import templates
from .events import now_ms
from .model_loop import run_model_node
from .store import (
    FAILED,
    N_CANCELLED,
    N_FAILED,
    N_PENDING,
    N_RUNNING,
    N_SKIPPED,
    N_SUCCEEDED,
    N_WAITING,
    RUNNING,
    SUCCEEDED,
    WAITING_APPROVAL,
    ApprovalRecord,
    PullRequestRecord,
    TicketRecord,
)
from .tools import Toolbox

log = logging.getLogger(__name__)

OUTPUT_KEEP = 64 * 1024          # characters of a node's output kept in the store
RUN_OUTPUT_CAP = 4 * 1024 * 1024  # bytes of a run node's output the broker streams
CHUNK_EVENT = 8 * 1024           # characters per node.output event
WAITING_KINDS = ("builtin:merge", "builtin:approval")
SANDBOX_KINDS = ("run", "model", "agent")
# How long preparation and a builtin step (commit, push, open_pr, merge) wait
# for a broker that went away: `afe up` restarts a dead child after 1 s, 2 s,
# 4 s, ... (R37). An engine may set `broker_retry_s` (0: fail at once).
BROKER_RETRY_S = 60.0


class NodeFailed(Exception):
    def __init__(self, node_id: str, reason: str) -> None:
        super().__init__(reason)
        self.node_id = node_id
        self.reason = reason


class Rejected(FailedPrecondition):
    """A person rejected the change: not retried."""


class CommandFailed(FailedPrecondition):
    """A `run` command exited non-zero."""


NESTED_REPOS_SHOWN = 20          # nested repository paths named in an event or a PR body


def nested_repositories_warning(paths) -> str:
    """One line for people (event, PR description): the workspace held other git
    repositories, committed as plain files. Paths are sandbox-made: each is shown
    as inline code with backticks and line breaks removed, and the list is bounded."""
    shown = ["`" + "".join(ch for ch in p[:200] if ch not in "`\r\n") + "`"
             for p in list(paths)[:NESTED_REPOS_SHOWN]]
    more = f" and {len(paths) - len(shown)} more" if len(paths) > len(shown) else ""
    return (f"the workspace holds {len(paths)} other git "
            f"repositor{'y' if len(paths) == 1 else 'ies'} ({', '.join(shown)}{more}), committed as plain "
            "files, not as submodules; review them before merging")


def _keep(text: str) -> str:
    if len(text) <= OUTPUT_KEEP:
        return text
    return f"[{len(text) - OUTPUT_KEEP} characters cut]...\n" + text[-OUTPUT_KEEP:]


def sandbox_spec(config: Config, workflow: Workflow, workspace: Workspace) -> spb.SandboxSpec:
    """The workspace's sandbox settings plus the env NAMES of the agents this
    workflow uses, and only those (R9). An agent's own image wins."""
    sb = workspace.sandbox
    env_names: set[str] = set()
    image = sb.image
    for n in workflow.nodes:
        if n.kind == "agent" and n.agent in config.agents:
            agent = config.agents[n.agent]
            env_names.update(agent.env)
            if agent.image:
                image = agent.image
    return spb.SandboxSpec(
        image=image,
        limits=spb.Limits(cpus=sb.limits.cpus, memory_bytes=sb.limits.memory_bytes, pids=sb.limits.pids,
                          disk_bytes=sb.limits.disk_bytes),
        egress=list(sb.egress), env_names=sorted(env_names), relay=bool(relay_models(config, workflow)))


def relay_models(config: Config, workflow: Workflow) -> list[str]:
    """The Models the workflow's agents reach through the ticket's relay (R32)."""
    return sorted({config.agents[n.agent].model or "" for n in workflow.nodes
                   if n.kind == "agent" and n.agent in config.agents and config.agents[n.agent].model})


class TicketRun:
    def __init__(self, engine, ticket: TicketRecord, resumed: bool) -> None:
        self.engine = engine
        self.ticket = ticket
        self.resumed = resumed
        self.config = engine.config
        self.workflow = engine.config.workflows[ticket.workflow]
        self.workspace = engine.config.workspaces[ticket.workspace]
        self.store = engine.store
        self.events = engine.events
        self.sandbox = engine.sandbox
        self.credentials = engine.credentials
        self.outputs: dict[str, str] = {}
        self._ws_ready = False
        self._sb_ready = False
        self._relay_cap = ""
        self._prep_lock = asyncio.Lock()
        self._ancestors = self._compute_ancestors()

    def emit(self, type_: str, payload: dict) -> None:
        self.events.append(self.ticket.id, type_, payload)

    def _compute_ancestors(self) -> dict[str, set[str]]:
        by_id = {n.id: n for n in self.workflow.nodes}
        memo: dict[str, set[str]] = {}

        def anc(nid: str) -> set[str]:
            if nid not in memo:
                memo[nid] = set()
                out: set[str] = set()
                for dep in by_id[nid].needs:
                    out.add(dep)
                    out |= anc(dep)
                memo[nid] = out
            return memo[nid]

        return {n.id: anc(n.id) for n in self.workflow.nodes}

    def render(self, template: str, node_id: str) -> str:
        t = self.ticket
        visible = {k: v for k, v in self.outputs.items() if k in self._ancestors[node_id]}
        return templates.render(template, {"id": t.id, "title": t.title, "body": t.body, "inputs": t.inputs},
                                visible)

    # ---- the graph ------------------------------------------------------------

    async def execute(self) -> tuple[str, str]:
        tid = self.ticket.id
        records = {r.node_id: r for r in self.store.node_runs(tid)}
        declared = [n.id for n in self.workflow.nodes]
        if sorted(declared) != sorted(records):
            raise FailedPrecondition(
                f"workflow {self.workflow.name!r} changed since this ticket was created (nodes "
                f"{', '.join(sorted(records))} became {', '.join(sorted(declared))}); create a new ticket")
        for r in records.values():
            if r.state in (N_RUNNING, N_WAITING):
                # It was running when the scheduler stopped: run it again.
                self.store.update_node(tid, r.node_id, state=N_PENDING)
                self.emit("node.resumed", {"node": r.node_id, "was": r.state})
                r.state = N_PENDING
            elif r.state == N_SUCCEEDED:
                self.outputs[r.node_id] = r.output
        if self.resumed:
            self.emit("ticket.resumed", {})
        nodes = {n.id: n for n in self.workflow.nodes}
        running: dict[asyncio.Task, str] = {}
        failure: NodeFailed | None = None
        try:
            while True:
                if failure is None:
                    for nid, node in nodes.items():
                        r = records[nid]
                        if r.state != N_PENDING or any(t == nid for t in running.values()):
                            continue
                        dep_states = [records[d].state for d in node.needs]
                        if any(s in (N_FAILED, N_SKIPPED, N_CANCELLED) for s in dep_states):
                            self._set_node(nid, N_SKIPPED, error="a node it needs did not succeed")
                            r.state = N_SKIPPED
                            continue
                        if all(s == N_SUCCEEDED for s in dep_states):
                            r.state = N_RUNNING
                            running[asyncio.create_task(self.run_node(node, r.attempt))] = nid
                if not running:
                    break
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    nid = running.pop(task)
                    if task.cancelled():   # stopped because another node failed
                        records[nid].state = N_CANCELLED
                        continue
                    exc = task.exception()
                    if exc is None:
                        records[nid].state = N_SUCCEEDED
                        self.outputs[nid] = task.result()
                    elif isinstance(exc, NodeFailed):
                        records[nid].state = N_FAILED
                        if failure is None:
                            failure = exc
                            for other in running:
                                other.cancel()
                    else:
                        raise exc
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
        if failure is not None:
            for nid, r in records.items():
                if r.state == N_PENDING:
                    self._set_node(nid, N_SKIPPED, error=f"node {failure.node_id} failed")
            return FAILED, f"node {failure.node_id} failed: {failure.reason}"
        return SUCCEEDED, ""

    def _set_node(self, node_id: str, state: str, **fields: object) -> None:
        self.store.update_node(self.ticket.id, node_id, state=state, **fields)

    async def run_node(self, node: Node, attempt: int) -> str:
        tid = self.ticket.id
        kind = node.label
        tries = 0
        while True:
            tries += 1
            attempt += 1
            started = time.monotonic()
            self.store.update_node(tid, node.id, state=N_RUNNING, attempt=attempt, started_at_ms=now_ms(),
                                   finished_at_ms=0, error="")
            self.emit("node.started", {"node": node.id, "kind": kind, "attempt": attempt})
            outcome = "error"
            try:
                if node.kind in SANDBOX_KINDS:
                    await self.ensure_sandbox()  # preparation does not count against the node's timeout
                if kind in WAITING_KINDS:
                    out = await self._dispatch(node)
                else:
                    try:
                        async with asyncio.timeout(node.timeout_s):
                            out = await self._dispatch(node)
                    except TimeoutError:
                        outcome = "timeout"
                        raise DeadlineExceeded(
                            f"timed out after {node.timeout_s:g}s (the node's timeout)") from None
                out = out or ""
                self.store.update_node(tid, node.id, state=N_SUCCEEDED, finished_at_ms=now_ms(),
                                       output=self.engine.redactor.redact(_keep(out)))
                self.emit("node.finished", {"node": node.id, "state": N_SUCCEEDED, "output": out[-4000:]})
                self.engine.node_metric(kind, "ok", time.monotonic() - started)
                return out
            except asyncio.CancelledError:
                self.store.update_node(tid, node.id, state=N_CANCELLED, finished_at_ms=now_ms(),
                                       error="cancelled")
                if not self.engine._stopping:
                    self.emit("node.finished", {"node": node.id, "state": N_CANCELLED})
                    self.engine.node_metric(kind, "cancelled", time.monotonic() - started)
                else:  # the scheduler is stopping: the node runs again on the next start
                    self.store.update_node(tid, node.id, state=N_RUNNING)
                raise
            except Exception as exc:
                if isinstance(exc, AfeError):
                    reason = exc.message
                else:
                    log.error("node %s: internal error", node.id, exc_info=exc)
                    reason = "internal error (details are in the scheduler log)"
                reason = self.engine.redactor.redact(reason)
                self.engine.node_metric(kind, outcome, time.monotonic() - started)
                retry = (tries <= node.retries and not isinstance(exc, (ResourceExhausted, Rejected)))
                if retry:
                    self.emit("node.retry", {"node": node.id, "attempt": attempt, "error": reason})
                    continue
                self.store.update_node(tid, node.id, state=N_FAILED, finished_at_ms=now_ms(), error=reason)
                self.emit("node.finished", {"node": node.id, "state": N_FAILED, "error": reason})
                raise NodeFailed(node.id, reason) from None

    async def _dispatch(self, node: Node) -> str:
        if node.kind == "run":
            return await self.node_run(node)
        if node.kind == "model":
            return await self.node_model(node)
        if node.kind == "agent":
            return await self.node_agent(node)
        if node.kind == "builtin":
            fn = getattr(self, f"builtin_{node.uses}", None)
            if fn is None:
                raise FailedPrecondition(f"unknown builtin {node.uses!r}")
            return await fn(node)
        raise FailedPrecondition(f"unknown node kind {node.kind!r}")

    # ---- preparation ------------------------------------------------------------

    def _broker_retry_s(self) -> float:
        return float(getattr(self.engine, "broker_retry_s", BROKER_RETRY_S))

    async def _retry_unavailable(self, what: str, fn, retry_on: type[Unavailable] = Unavailable):
        """Call `fn` until it stops raising `retry_on`, for at most `_broker_retry_s()` seconds."""
        delay, deadline = 0.2, time.monotonic() + self._broker_retry_s()
        while True:
            try:
                return await fn()
            except retry_on as exc:
                if time.monotonic() + delay > deadline:
                    raise type(exc)(f"{what}: {exc.message}; afe retried for {self._broker_retry_s():g} s "
                                    "(see `afe status` and the broker's log)") from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _step(self, node: Node, step: str, fn):
        """One credential broker call of a builtin step (commit, push, open_pr,
        merge) that survives a broker crash (R37): while the broker is away
        (`PeerUnavailable`: not running, or its connection closed mid-call) the
        call is made again, with back-off, for up to `_broker_retry_s()` seconds,
        whatever the node's `retries`. Each step is idempotent in the broker
        (keyed by ticket and step: the branch `afe/<ticket>`, its one PR, the
        approved head), so a call that landed before the crash is not repeated."""
        delay, started = 0.5, time.monotonic()
        limit = self._broker_retry_s()
        away = False
        while True:
            try:
                out = await fn()
            except PeerUnavailable:
                waited = time.monotonic() - started
                if waited + delay > limit:
                    raise PeerUnavailable(
                        f"the credential broker went away during {step} and did not come back within "
                        f"{limit:g} s; check that `afe up` is running and see the credential broker's log, "
                        "then retry the ticket") from None
                if not away:
                    away = True
                    self.emit("broker.retry", {"node": node.id, "step": step, "broker": "credentials",
                                               "message": f"the credential broker went away during {step}; "
                                                          "retrying (afe up restarts it)"})
                await asyncio.sleep(delay)
                delay = min(delay * 2, 4.0)
                continue
            if away:
                self.emit("broker.recovered", {"node": node.id, "step": step, "broker": "credentials",
                                               "after_s": round(time.monotonic() - started, 1)})
            return out

    async def ensure_workspace(self) -> None:
        async with self._prep_lock:
            if self._ws_ready:
                return
            tid, ws = self.ticket.id, self.workspace.name
            r = await self._retry_unavailable("preparing the workspace",
                                              lambda: self.credentials.prepare(tid, ws), PeerUnavailable)
            self._ws_ready = True
            self.emit("workspace.ready", {"base_sha": r.base_sha, "branch": r.branch})

    def sandbox_spec(self) -> spb.SandboxSpec:
        return sandbox_spec(self.config, self.workflow, self.workspace)

    async def ensure_sandbox(self) -> None:
        await self.ensure_workspace()
        async with self._prep_lock:
            if self._sb_ready:
                return
            spec = self.sandbox_spec()
            if spec.relay:   # the relay's folder must exist before the sandbox mounts it (R32)
                await self.open_relay(None)
            s = await self._retry_unavailable("creating the sandbox",
                                              lambda: self.sandbox.create(self.ticket.id, spec))
            self._sb_ready = True
            self.emit("sandbox.ready", {"image": s.image, "egress": list(spec.egress),
                                        "network": bool(s.network)})

    # ---- the model relay (R32) ----------------------------------------------------

    async def open_relay(self, node: Node | None) -> int:
        """Open (idempotent: again after a broker restart) the ticket's relay
        with the budget for `node`: what the Workflow's maxTokens leaves for
        the ticket, and at most the node's max_tokens. Returns the tokens the
        relay had counted before."""
        tid = self.ticket.id
        usage = await self._retry_unavailable("reading the model relay's usage",
                                              lambda: self.credentials.relay_usage(tid), PeerUnavailable)
        limits = []
        if self.workflow.max_tokens:
            t = self.store.get_ticket(tid)
            limits.append(self.workflow.max_tokens - (t.tokens_used if t else 0))
        if node is not None and node.max_tokens:
            limits.append(node.max_tokens)
        if limits and min(limits) <= 0:
            raise ResourceExhausted(f"the ticket's token budget of {self.workflow.max_tokens} is spent; raise "
                                    f"maxTokens on workflow {self.workflow.name!r} to allow more")
        budget = usage.total_tokens + min(limits) if limits else 0
        models = relay_models(self.config, self.workflow)
        r = await self._retry_unavailable("opening the model relay",
                                          lambda: self.credentials.open_relay(tid, models, budget), PeerUnavailable)
        if r.capability != self._relay_cap:
            self.engine.redactor.register(r.capability)   # a placeholder, but no event needs to show it
            self._relay_cap = r.capability
        return usage.total_tokens

    def agent_env(self, agent: Agent) -> dict[str, str]:
        """The agent process's literal environment: its fixed settings and,
        for an agent with a Model, the relay's base URL and capability."""
        env = dict(getattr(agent, "fixed_env", ()) or ())
        if agent.model:
            m = self.config.models[agent.model]
            env.update(relay_env(agent.relay_env, provider=m.provider, model_name=m.name, model_id=m.model,
                                 capability=self._relay_cap))
        return env

    async def record_relay_usage(self, node: Node, before: dict[str, tuple[int, int]]) -> None:
        """`model.usage` events for what the node's agent used, added to the ticket's tokens."""
        tid = self.ticket.id
        try:
            usage = await self.credentials.relay_usage(tid)
        except AfeError as exc:
            log.warning("ticket %s: could not read the model relay's usage: %s", tid, exc.message)
            return
        added = 0
        for m in usage.models:
            i0, o0 = before.get(m.model, (0, 0))
            di, do = m.input_tokens - i0, m.output_tokens - o0
            if di or do:
                added += di + do
                self.emit("model.usage", {"node": node.id, "model": m.model, "input_tokens": di,
                                          "output_tokens": do, "ticket_input_tokens": m.input_tokens,
                                          "ticket_output_tokens": m.output_tokens,
                                          "budget_tokens": usage.budget_tokens})
        if added:
            t = self.store.get_ticket(tid)
            self.store.update_ticket(tid, tokens_used=(t.tokens_used if t else 0) + added)

    def uses_sandbox(self) -> bool:
        return any(n.kind in SANDBOX_KINDS for n in self.workflow.nodes)

    # ---- node kinds ---------------------------------------------------------------

    async def node_run(self, node: Node) -> str:
        await self.ensure_sandbox()
        out: list[str] = []
        code, timed_out, truncated = -1, False, False
        async for ev in self.sandbox.exec(self.ticket.id, ["bash", "-lc", node.run or ""],
                                          timeout_ms=int(node.timeout_s * 1000),
                                          output_cap_bytes=RUN_OUTPUT_CAP):
            which = ev.WhichOneof("event")
            if which in ("stdout", "stderr"):
                text = getattr(ev, which).decode("utf-8", errors="replace")
                out.append(text)
                for i in range(0, len(text), CHUNK_EVENT):
                    self.emit("node.output", {"node": node.id, "stream": which, "text": text[i:i + CHUNK_EVENT]})
            elif which == "exit":
                code, timed_out, truncated = ev.exit.code, ev.exit.timed_out, ev.exit.truncated
        text = "".join(out)
        if truncated:
            text += "\n[output cut]"
        if timed_out:
            raise DeadlineExceeded(f"the command timed out after {node.timeout_s:g}s")
        if code != 0:
            tail = text[-2000:].strip()
            raise CommandFailed(f"the command exited with code {code}" + (f":\n{tail}" if tail else "")
                                + self._disk_full_hint(text))
        return text

    def _disk_full_hint(self, output: str) -> str:
        """R34: a command that hit the workspace's disk cap says which limit it hit."""
        if "No space left on device" not in output:
            return ""
        cap = self.workspace.sandbox.limits.disk_bytes
        size = next((f"{cap // u}{n}" for n, u in (("g", 1024 ** 3), ("m", 1024 ** 2)) if cap % u == 0), str(cap))
        return (f"\nthe sandbox ran out of disk space: the workspace holds at most {size} "
                f"(sandbox.limits.disk of workspace {self.workspace.name!r}; /tmp holds 256m); "
                "write less or raise sandbox.limits.disk")

    async def node_model(self, node: Node) -> str:
        await self.ensure_sandbox()
        model = self.config.models[node.model or ""]

        async def on_output(stream: str, text: str) -> None:
            self.emit("node.output", {"node": node.id, "stream": stream, "text": text})

        toolbox = Toolbox(self.sandbox, self.ticket.id, node.tools, on_output)

        def add_tokens(n: int) -> int:
            t = self.store.get_ticket(self.ticket.id)
            total = (t.tokens_used if t else 0) + n
            self.store.update_ticket(self.ticket.id, tokens_used=total)
            return total

        return await run_model_node(
            ticket_id=self.ticket.id, node=node, model=model, prompt=self.render(node.prompt, node.id),
            toolbox=toolbox, credentials=self.credentials, emit=self.emit, add_tokens=add_tokens,
            ticket_budget=self.workflow.max_tokens)

    async def node_agent(self, node: Node) -> str:
        try:
            from services.scheduler.acp.runner import run_agent_node
        except ImportError:
            raise FailedPrecondition("ACP support not installed: this afe cannot run `agent` nodes") from None
        await self.ensure_sandbox()
        agent = self.config.agents[node.agent or ""]

        async def emit(type_: str, payload: dict) -> None:
            self.emit(type_, {"node": node.id, **payload})

        before: dict[str, tuple[int, int]] | None = None
        if agent.model:
            await self.open_relay(node)
            usage = await self.credentials.relay_usage(self.ticket.id)
            before = {m.model: (m.input_tokens, m.output_tokens) for m in usage.models}
        try:
            return await run_agent_node(ticket_id=self.ticket.id, node=node, agent=agent,
                                        prompt=self.render(node.prompt, node.id), sandbox=self.sandbox.stub,
                                        emit=emit, env=self.agent_env(agent))
        finally:
            if before is not None:
                await asyncio.shield(self.record_relay_usage(node, before))

    # ---- builtins -----------------------------------------------------------------

    async def _commit(self, node: Node, default_message: str):
        await self.ensure_workspace()
        frozen = False
        if self.uses_sandbox():
            await self.ensure_sandbox()
        if self._sb_ready:
            await self.sandbox.freeze(self.ticket.id, True)
            frozen = True
        try:
            message = self.render(str(node.with_.get("message") or default_message), node.id)
            return await self._step(node, "commit", lambda: self.credentials.commit(
                self.ticket.id, self.workspace.name, message))
        finally:
            if frozen:
                await asyncio.shield(self.sandbox.freeze(self.ticket.id, False))

    def _default_message(self) -> str:
        return f"{self.ticket.title}\n\nafe ticket {self.ticket.id}"

    def _commit_done(self, node: Node, r) -> None:
        self.emit("commit.done", {"node": node.id, "sha": r.sha, "changed": r.changed,
                                  "files_changed": r.files_changed})
        if r.nested_repositories:
            self.emit("commit.warning", {"node": node.id, "sha": r.sha, "kind": "nested_repository",
                                         "paths": list(r.nested_repositories)[:NESTED_REPOS_SHOWN],
                                         "count": len(r.nested_repositories),
                                         "message": nested_repositories_warning(r.nested_repositories)})

    async def builtin_commit(self, node: Node) -> str:
        r = await self._commit(node, self._default_message())
        self._commit_done(node, r)
        return r.sha


    async def builtin_open_pr(self, node: Node) -> str:
        tid, ws = self.ticket.id, self.workspace.name
        c = await self._commit(node, self._default_message())
        self._commit_done(node, c)
        p = await self._step(node, "push", lambda: self.credentials.push(tid, ws))
        self.emit("push.done", {"node": node.id, "branch": p.branch, "sha": p.sha})
        title = self.render(str(node.with_.get("title") or "{{ticket.title}}"), node.id)
        body = self.render(str(node.with_.get("body") or
                               "{{ticket.body}}\n\n---\nOpened by afe for ticket {{ticket.id}}."), node.id)
        if c.nested_repositories:
            body += "\n\n> [!WARNING]\n> " + nested_repositories_warning(c.nested_repositories)
        pr = await self._step(node, "open_pr", lambda: self.credentials.open_pr(tid, ws, title, body))
        known = self.store.get_pr(tid)
        rec = PullRequestRecord(tid, pr.number, pr.url, pr.head_branch, pr.base_branch, pr.head_sha,
                                pr.state or "open", pr.merge_sha)
        if known is not None and known.state == "merged":
            rec.state, rec.merge_sha = known.state, known.merge_sha
        self.store.put_pr(rec)
        self.emit("pr.opened", {"node": node.id, "number": pr.number, "url": pr.url,
                                "head_branch": pr.head_branch, "base_branch": pr.base_branch,
                                "head_sha": pr.head_sha, "existing": known is not None})
        return pr.url or pr.number

    async def _await_approval(self, node: Node, sha: str, pr: PullRequestRecord | None) -> ApprovalRecord:
        """Park the ticket in waiting_approval until a person decides."""
        tid = self.ticket.id
        engine = self.engine
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        engine._waiters[tid] = fut
        try:
            t = self.store.get_ticket(tid)
            self._set_node(node.id, N_WAITING)
            if not (t and t.state == WAITING_APPROVAL and t.awaiting_sha == sha):
                self.store.update_ticket(tid, state=WAITING_APPROVAL, awaiting_sha=sha, updated_at_ms=now_ms())
                self.emit("ticket.state", {"state": WAITING_APPROVAL})
                self.emit("approval.requested", {"node": node.id, "sha": sha,
                                                 "pr": pr.number if pr else "", "url": pr.url if pr else ""})
                engine._transition_metric(WAITING_APPROVAL)
            engine._running.discard(tid)
            engine._kick()
            rec = await fut
        finally:
            if engine._waiters.get(tid) is fut:
                del engine._waiters[tid]
        self._set_node(node.id, N_RUNNING)
        return rec

    async def _approval_for(self, node: Node, sha: str, pr: PullRequestRecord | None) -> ApprovalRecord:
        appr = self.store.latest_approval(self.ticket.id)
        t = self.store.get_ticket(self.ticket.id)
        decided = appr is not None and appr.sha == sha and (t is not None and t.state == RUNNING)
        if not decided or appr is None:
            appr = await self._await_approval(node, sha, pr)
        if not appr.granted:
            why = f": {appr.reason}" if appr.reason else ""
            raise Rejected(f"rejected by {appr.principal}{why}")
        return appr

    async def builtin_approval(self, node: Node) -> str:
        pr = self.store.get_pr(self.ticket.id)
        appr = await self._approval_for(node, pr.head_sha if pr else "", pr)
        return f"approved by {appr.principal}"

    async def builtin_merge(self, node: Node) -> str:
        tid, ws = self.ticket.id, self.workspace.name
        pr = self.store.get_pr(tid)
        if pr is None:
            raise FailedPrecondition("builtin:merge needs a pull request: put builtin:open_pr in its `needs`")
        if pr.state == "merged":
            return pr.merge_sha  # recorded: never merge twice
        current = await self._step(node, "merge", lambda: self.credentials.get_pr(ws, pr.number))
        if current.state == "merged":
            pr.state, pr.merge_sha = "merged", current.merge_sha
            self.store.put_pr(pr)
            self.emit("merge.done", {"node": node.id, "number": pr.number, "merge_sha": pr.merge_sha,
                                     "already_merged": True})
            return pr.merge_sha
        if current.head_sha and current.head_sha != pr.head_sha:
            pr.head_sha = current.head_sha
            self.store.put_pr(pr)
        while True:
            appr = await self._approval_for(node, pr.head_sha, pr)
            # The branch may have moved while it waited: a person approved
            # `appr.sha`, so only that SHA may be merged (R16); ask again.
            current = await self._step(node, "merge", lambda: self.credentials.get_pr(ws, pr.number))
            if current.head_sha and current.head_sha != appr.sha and current.state != "merged":
                self.emit("approval.stale", {"node": node.id, "approved_sha": appr.sha,
                                             "head_sha": current.head_sha})
                pr.head_sha = current.head_sha
                self.store.put_pr(pr)
                continue
            break
        r = await self._step(node, "merge", lambda: self.credentials.merge(
            tid, ws, pr.number, appr.principal, appr.sha, appr.at_ms, str(node.with_.get("method") or "")))
        pr.state, pr.merge_sha = "merged", r.merge_sha
        self.store.put_pr(pr)
        self.emit("merge.done", {"node": node.id, "number": pr.number, "sha": appr.sha,
                                 "merge_sha": r.merge_sha, "principal": appr.principal,
                                 "already_merged": r.already_merged})
        return r.merge_sha
