"""The in-toto Statement v1 of a ticket's run for one head (R42): built from
the config, the store and the ticket's events; signed by the credential
broker (run_record.py). Predicate type `attestation.PREDICATE_TYPE`
(docs/GUIDE.md "The run record" lists its fields).

No secret goes in (the relay capability and tokens never reach the store
or events; the broker refuses a statement holding one it knows). Untrusted
text (the ticket's title and body, follow-ups, sandbox output, the agent's
command lines) goes in only as SHA-256 digests; names from the manifests,
host names the egress proxy logged and the paths the verification names
(harness changes, binary files, shadowing names: what a reviewer must read)
go in as JSON strings, clipped, and the whole statement is ASCII-only
canonical JSON (every other character escaped).

The record tells who made its head (`head.pushed_by`): afe's run (a
`push.done` of builtin:open_pr, or the merge of the base that `afe ticket
update-branch` pushed) or not (a person's push to the ticket's branch). A head
afe did not push carries none of the run's commands, prompts, agents, models
or usage as its own: those go under `afe_run`, attributed to the last head
afe pushed.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from services.common.config import presets
from services.common.config.model import Config, Workflow, Workspace
from services.common.provenance import attestation

from ...store.base import ApprovalRecord, PullRequestRecord, TicketRecord
from ...store.store import Store

EVENTS_SCANNED = 50_000        # a ticket's events read for the record, at most
_EXIT = re.compile(r"exited with code (-?\d+)")
_SHA = re.compile(r"[0-9a-f]{40}")         # fullmatch
PUSHED_SHOWN = 50              # the heads afe pushed, named in the record (the latest)
TEXT_MAX = 500                 # characters of one string of the verification kept
LIST_MAX = 200                 # entries of one list of the verification kept
COUNT_KEYS = ("ran", "passed", "failed", "errors", "skipped", "deselected")
# what the run made, attributed to the head only when afe's run pushed it
RUN_KEYS = ("prompts", "usage", "commands", "agent_commands", "agents", "models", "mcp_calls")
MCP_CALLS_KEPT = 1000          # MCP calls named in the record (the first; `omitted` counts the rest)
MCP_CALL_KEYS = ("node", "via", "server", "tool", "arguments_sha256", "outcome", "request_bytes",
                 "response_bytes", "duration_ms")


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def subject_name(ws: Workspace, ticket_id: str) -> str:
    repo = ws.forge.repo if ws.forge.type == "github" and ws.forge.repo else f"afe-workspace/{ws.name}"
    return f"git+{repo}@afe/{ticket_id}"


def statement(config: Config, store: Store, t: TicketRecord, sha: str, *, pr: PullRequestRecord | None,
              verification: dict[str, Any] | None, denied: dict[str, Any] | None,
              decision: ApprovalRecord | None = None) -> dict[str, Any]:
    wf = config.workflows[t.workflow]
    ws = config.workspaces[t.workspace]
    events = _events(store, t.id)
    predicate: dict[str, Any] = {
        "kind": "decision" if decision is not None else "request",
        "ticket": {"id": t.id, "workspace": t.workspace, "principal": t.principal,
                   "title_sha256": digest(t.title), "body_sha256": digest(t.body),
                   "followups_sha256": [digest(f.text) for f in store.followups.followups(t.id, 0)],
                   "created_at_ms": t.created_at_ms},
        "repository": {"forge": ws.forge.type, "repo": ws.forge.repo, "base_branch": ws.base_branch,
                       "branch": f"afe/{t.id}", "pull_request": pr.number if pr else "",
                       "pull_request_url": pr.url if pr else ""},
        "workflow": _workflow(store, t, wf),
        "agents": _agents(config, wf),
        "models": _models(config, wf),
        "prompts": [{"node": p.get("node", ""), "sha256": p.get("sha256", ""), "bytes": p.get("bytes", 0)}
                    for p in _payloads(events, "node.prompt_digest")],
        "egress": _egress(ws, denied),
        "usage": _usage(events),
        "commands": _commands(store, t, wf, events),
        "agent_commands": _agent_commands(events),
        "mcp_calls": _mcp_calls(events),
        "verification": verification_record(verification),
    }
    pushed = afe_pushed(store, t.id)
    by_afe = sha in pushed
    predicate["head"] = {"sha": sha, "pushed_by": "afe" if by_afe else "person",
                         "afe_head": pushed[-1] if pushed else "", "afe_pushed": pushed[-PUSHED_SHOWN:]}
    if not by_afe:     # a person's push: the run made another head (or none)
        predicate["afe_run"] = {"head": pushed[-1] if pushed else "",
                                **{k: predicate[k] for k in RUN_KEYS}}
        for k in RUN_KEYS:
            predicate[k] = {"models": [], "total_tokens": 0, "cost_usd": 0.0} if k == "usage" else []
    if decision is not None:
        predicate["decision"] = {"principal": decision.principal, "granted": decision.granted,
                                 "sha": decision.sha, "at_ms": decision.at_ms,
                                 "reason_sha256": digest(decision.reason) if decision.reason else "",
                                 "accepted_harness_change": _strings(
                                     getattr(decision, "accepted_harness_change", None) or [])}
    return {"_type": attestation.STATEMENT_TYPE,
            "subject": [{"name": subject_name(ws, t.id), "digest": {"gitCommit": sha}}],
            "predicateType": attestation.PREDICATE_TYPE, "predicate": predicate}


def _events(store: Store, ticket_id: str) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    seq = 1
    while len(out) < EVENTS_SCANNED:
        batch = store.events.read(ticket_id, seq, limit=1000)
        if not batch:
            break
        for ev in batch:
            try:
                payload = json.loads(ev.payload_json)
            except ValueError:
                continue
            out.append((ev.type, payload if isinstance(payload, dict) else {}))
        seq = batch[-1].seq + 1
    return out


def afe_pushed(store: Store, ticket_id: str) -> list[str]:
    """The heads afe's run pushed to the ticket's branch, oldest first, each once: builtin:open_pr's
    `push.done`, and the merge of the base an update of the branch pushed (`ticket.reopened` with
    `branch_updated`). Every event of the ticket is read (not only the first EVENTS_SCANNED)."""
    out: list[str] = []
    seq = 1
    while True:
        batch = store.events.read(ticket_id, seq, limit=1000)
        if not batch:
            return out
        for ev in batch:
            if ev.type not in ("push.done", "ticket.reopened"):
                continue
            try:
                p = json.loads(ev.payload_json)
            except ValueError:
                continue
            if not isinstance(p, dict) or (ev.type == "ticket.reopened" and not p.get("branch_updated")):
                continue
            sha = str(p.get("sha" if ev.type == "push.done" else "head_sha") or "").lower()
            if _SHA.fullmatch(sha):
                if sha in out:
                    out.remove(sha)
                out.append(sha)
        seq = batch[-1].seq + 1


def verification_record(v: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the record holds of a verification (the `approval.requested` summary, R41): the
    contract's keys, each present only when the summary has it, with its type enforced, strings
    clipped and lists bounded (`omitted` counts what was left out). None: no `verify:`."""
    if not isinstance(v, dict):
        return None
    out: dict[str, Any] = {"passed": v.get("passed") is True}
    omitted: dict[str, int] = {}
    for k in ("sha", "base_sha", "merge_sha"):
        if k in v:
            out[k] = str(v[k]).lower() if _SHA.fullmatch(str(v[k] or "").lower()) else ""
    for k in ("base_branch", "error"):
        if k in v:
            out[k] = _text(v[k])
    for k in ("base_paths", "reasons", "harness_changes", "binary_files", "shadowing"):
        if k in v:
            items = v[k] if isinstance(v[k], list) else []
            out[k] = _strings(items)
            if len(items) > LIST_MAX:
                omitted[k] = len(items) - LIST_MAX
    if "commands" in v:
        cmds = v["commands"] if isinstance(v["commands"], list) else []
        out["commands"] = [_command(c) for c in cmds[:LIST_MAX] if isinstance(c, dict)]
        if len(cmds) > LIST_MAX:
            omitted["commands"] = len(cmds) - LIST_MAX
    for k in ("tests", "base_tests"):
        if k in v:
            out[k] = _counts(v[k])
    if omitted:
        out["omitted"] = omitted
    return out


def _command(c: dict[str, Any]) -> dict[str, Any]:
    code = c.get("exit_code")
    out: dict[str, Any] = {"command": _text(c.get("command", "")),
                           "exit_code": code if isinstance(code, int) and not isinstance(code, bool) else None,
                           "timed_out": c.get("timed_out") is True, "duration_ms": _int(c.get("duration_ms"))}
    if "counts" in c:
        out["counts"] = _counts(c["counts"])
    return out


def _counts(c: object) -> dict[str, Any] | None:
    if not isinstance(c, dict):
        return None
    out: dict[str, Any] = {k: _int(c.get(k)) for k in COUNT_KEYS}
    if "runner" in c:
        out["runner"] = _text(c["runner"], 40)
    return out


def _int(x: object) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) else 0


def _text(x: object, limit: int = TEXT_MAX) -> str:
    return str(x if x is not None else "")[:limit]


def _strings(items: list[Any]) -> list[str]:
    return [_text(x, 300) for x in items[:LIST_MAX]]


def _payloads(events: list[tuple[str, dict[str, Any]]], type_: str) -> list[dict[str, Any]]:
    return [p for t, p in events if t == type_]


def _workflow(store: Store, t: TicketRecord, wf: Workflow) -> dict[str, Any]:
    runs = {r.node_id: r for r in store.tickets.node_runs(t.id)}
    nodes = []
    for n in wf.nodes:
        r = runs.get(n.id)
        node: dict[str, Any] = {"id": n.id, "kind": n.kind, "needs": list(n.needs),
                                "state": r.state if r else "", "attempts": r.attempt if r else 0,
                                "rounds": r.rounds if r else 0}
        if n.kind == "builtin":
            node["uses"] = n.uses or ""
        if n.model:
            node["model"] = n.model
        if n.agent:
            node["agent"] = n.agent
        nodes.append(node)
    return {"name": wf.name, "nodes": nodes, "max_tokens": wf.max_tokens}


def _agents(config: Config, wf: Workflow) -> list[dict[str, Any]]:
    out = []
    for name in sorted({n.agent for n in wf.nodes if n.kind == "agent" and n.agent}):
        a = config.agents.get(name)
        if a is None:
            continue
        p = presets.PRESETS.get(a.preset or "")
        out.append({"name": a.name, "preset": a.preset or "", "version": p.version if p else "",
                    "package": p.package if p else "", "image": a.image or "", "model": a.model or "",
                    "env_names": sorted(a.env)})   # what entered the sandbox: names only (R9, R43)
    return out


def _models(config: Config, wf: Workflow) -> list[dict[str, Any]]:
    names = {n.model for n in wf.nodes if n.kind == "model" and n.model}
    names |= {config.agents[n.agent].model or "" for n in wf.nodes
              if n.kind == "agent" and n.agent in config.agents}
    out = []
    for name in sorted(x for x in names if x):
        m = config.models.get(name)
        if m is not None:
            out.append({"name": m.name, "provider": m.provider, "model": m.model})
    return out


# one egress request of the record (R44): egress_report.record_payload's keys, the path only as its digest
EGRESS_REQUEST_KEYS = ("method", "host", "path_sha256", "status", "denied", "reason", "rule", "bytes_out",
                       "bytes_in", "count")
EGRESS_REQUESTS_KEPT = 300     # distinct requests listed in a record (the refused first; the rest counted)


def _egress(ws: Workspace, denied: dict[str, Any] | None) -> dict[str, Any]:
    """The declared allow-list and rules, the hosts the proxy let through and those it refused, with
    counts, and every request (R44) (as the proxy's log has them; "not recorded" when the sandbox's
    proxy could not be read)."""
    def counted(key: str) -> list[dict[str, Any]]:
        return [{"host": str(h.get("host", "")), "count": int(h.get("count", 0) or 0)}
                for h in (denied or {}).get(key) or [] if isinstance(h, dict)]
    allowed: list[dict[str, Any]] | str = counted("allowed") if "allowed" in (denied or {}) else "not recorded"
    requests: list[dict[str, Any]] | str = "not recorded"
    omitted = {"entries": 0, "requests": 0}
    if "all_requests" in (denied or {}):      # R44: every request, its path only as a digest
        every = [{k: q.get(k) for k in EGRESS_REQUEST_KEYS}
                 for q in (denied or {}).get("all_requests") or [] if isinstance(q, dict)]
        # the refused first; past EGRESS_REQUESTS_KEPT the rest is counted, not listed
        every.sort(key=lambda q: not q.get("denied"))
        requests = every[:EGRESS_REQUESTS_KEPT]
        rest = every[EGRESS_REQUESTS_KEPT:]
        omitted = {"entries": len(rest), "requests": sum(int(q.get("count") or 0) for q in rest)}
    return {"allowed": sorted(ws.sandbox.egress), "allowed_private": sorted(ws.sandbox.egress_private),
            "allowed_counts": allowed, "allowed_truncated": bool((denied or {}).get("allowed_truncated")),
            "denied": counted("hosts"), "denied_truncated": bool((denied or {}).get("truncated")),
            "rules": [{"host": r.host, "name": r.name, "methods": list(r.methods), "paths": list(r.paths),
                       "ignore_case": r.ignore_case} for r in ws.sandbox.egress_rules],
            "requests": requests, "requests_omitted": omitted,
            "requests_truncated": bool((denied or {}).get("all_requests_truncated"))}


def _usage(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    per: dict[str, dict[str, Any]] = {}
    for p in _payloads(events, "model.usage"):
        m = per.setdefault(str(p.get("model", "")), {"model": str(p.get("model", "")), "input_tokens": 0,
                                                     "output_tokens": 0, "cost_usd": 0.0, "calls": 0})
        m["input_tokens"] += int(p.get("input_tokens", 0) or 0)
        m["output_tokens"] += int(p.get("output_tokens", 0) or 0)
        m["cost_usd"] = round(m["cost_usd"] + float(p.get("cost_usd", 0) or 0), 6)
        m["calls"] += 1
    models = [per[k] for k in sorted(per)]
    return {"models": models, "total_tokens": sum(m["input_tokens"] + m["output_tokens"] for m in models),
            "cost_usd": round(sum(m["cost_usd"] for m in models), 6)}


def _commands(store: Store, t: TicketRecord, wf: Workflow,
              events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The `run:` nodes' commands (the manifest's template) with each finished try's exit code."""
    runs = [n for n in wf.nodes if n.kind == "run"]
    out = []
    for n in runs:
        codes: list[int | None] = []
        for p in _payloads(events, "node.finished"):
            if p.get("node") != n.id:
                continue
            if p.get("state") == "succeeded":
                codes.append(0)
            elif p.get("state") == "failed":
                m = _EXIT.search(str(p.get("error", "")))
                codes.append(int(m.group(1)) if m else None)
        out.append({"node": n.id, "command": n.run or "", "command_sha256": digest(n.run or ""),
                    "exit_codes": codes})
    return out


def _mcp_calls(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each MCP call of the run (the `mcp.call` events, R43: an agent's through the relay, `via`
    relay; a model node's through the broker, `via` broker): server and tool names, the digest of
    the arguments, the outcome and sizes; never the arguments, the result or a reason's text. A
    call the relay could no longer name is an entry of outcome `not_recorded` with the count."""
    out: list[dict[str, Any]] = []
    for p in _payloads(events, "mcp.call"):
        entry = {k: (_int(p.get(k)) if k.endswith(("_bytes", "_ms")) else _text(p.get(k, ""), 200))
                 for k in MCP_CALL_KEYS}
        if p.get("outcome") == "not_recorded":
            entry["count"] = _int(p.get("missed"))
        out.append(entry)
    if len(out) > MCP_CALLS_KEPT:
        out[MCP_CALLS_KEPT - 1:] = [{"outcome": "omitted", "count": len(out) - MCP_CALLS_KEPT + 1}]
    return out


def _agent_commands(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The commands the ACP agents ran in terminals (the `agent.terminal` create and exit
    events), per node in order: the program's name (safe characters only), the digest of the
    command line as shown (the agent's text, so never the text itself) and how it ended
    (null when the agent never waited for its exit)."""
    out: list[dict[str, Any]] = []
    by_id: dict[tuple[str, str], dict[str, Any]] = {}
    for p in _payloads(events, "agent.terminal"):
        node, tid, op = str(p.get("node", "")), str(p.get("terminal_id", "")), p.get("op")
        if op == "create" and p.get("ok") and tid:
            command = str(p.get("command", ""))
            first = (command.split() or [""])[0].rsplit("/", 1)[-1][:64]
            entry = {"node": node, "program": "".join(ch for ch in first if ch.isalnum() or ch in "._+-"),
                     "command_sha256": digest(command), "exit_code": None, "signal": None}
            by_id[(node, tid)] = entry
            out.append(entry)
        elif op == "exit" and (node, tid) in by_id:
            by_id[(node, tid)].update(exit_code=p.get("exit_code"), signal=p.get("signal"))
    return out
