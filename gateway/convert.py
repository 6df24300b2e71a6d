"""Scheduler messages <-> the JSON shapes /rpc speaks.

States travel as lowercase words (`waiting_approval`, `running`), times as
integer milliseconds, event payloads as parsed JSON objects.
"""

from __future__ import annotations

import json
import re
from typing import Any

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common import states
from services.common.states import NodeState, TicketState

# The words of services/common/states.py by proto number (the JSON-RPC contract: lowercase words).
TICKET_STATES = {s.proto: s.value for s in TicketState}
TICKET_STATE_BY_NAME = {v: k for k, v in TICKET_STATES.items()}
TERMINAL_STATES = frozenset(s.value for s in states.TERMINAL)
NODE_STATES = {s.proto: s.value for s in NodeState}
# The local forge's pull-request reference (services/credentials/forges/local.py): local:<workspace>/pulls/<n>.
LOCAL_PR = re.compile(r"local:([A-Za-z0-9][A-Za-z0-9_.-]{0,99})/pulls/([0-9]{1,20})")

# A JSON object of the shapes /rpc speaks (a ticket, a node, an event, a reply).
JsonObject = dict[str, Any]


def pr_url(ref: str, origin: str) -> str:
    """The URL people open for a pull request: the local forge's `local:demo/pulls/2`
    becomes the gateway's page `<origin>/pulls/demo/2`; a GitHub URL stays as it is."""
    m = LOCAL_PR.fullmatch(ref)
    if m and origin:
        return f"{origin}/pulls/{m.group(1)}/{m.group(2)}"
    return ref


def node(n: pb.NodeRun) -> JsonObject:
    return {
        "id": n.id,
        "kind": n.kind,
        "state": NODE_STATES.get(n.state, "unknown"),
        "needs": list(n.needs),
        "attempt": n.attempt,
        "started_at_ms": n.started_at_ms,
        "finished_at_ms": n.finished_at_ms,
        "output": n.output,
        "error": n.error,
    }


def pull_request(p: pb.PullRequest, origin: str = "") -> JsonObject | None:
    """`url` is what to open (pr_url); `ref` the forge's own reference."""
    if not (p.number or p.url):
        return None
    return {
        "number": p.number, "url": pr_url(p.url, origin), "ref": p.url, "head_branch": p.head_branch, "base_branch": p.base_branch,
        "head_sha": p.head_sha, "state": p.state, "merge_sha": p.merge_sha,
    }


def approval(a: pb.Approval) -> JsonObject | None:
    if not a.principal:
        return None
    return {"principal": a.principal, "sha": a.sha, "granted": a.granted, "at_ms": a.at_ms,
            "reason": a.reason}


def ticket(t: pb.Ticket, origin: str = "") -> JsonObject:
    """`origin`: the gateway's public origin, for the local forge's pull-request page."""
    return {
        "id": t.id,
        "workspace": t.workspace,
        "workflow": t.workflow,
        "title": t.title,
        "body": t.body,
        "inputs": dict(t.inputs),
        "state": TICKET_STATES.get(t.state, "unknown"),
        "created_at_ms": t.created_at_ms,
        "updated_at_ms": t.updated_at_ms,
        "nodes": [node(n) for n in t.nodes],
        "pr": pull_request(t.pr, origin) if t.HasField("pr") else None,
        "approval": approval(t.approval) if t.HasField("approval") else None,
        "error": t.error,
        "last_seq": t.last_seq,
        "awaiting_sha": t.awaiting_sha,
        "origin": _origin(t.origin) if t.HasField("origin") else None,
        "usage": {"tokens": t.tokens_used},
        "sandbox_runtime": t.sandbox_runtime,
    }


def _origin(o: pb.TicketOrigin) -> JsonObject:
    """Where a ticket came from and which of its texts are untrusted (R36), for the UI."""
    return {"source": o.source, "event": o.event, "url": o.url, "author": o.author, "trigger": o.trigger,
            "title_untrusted": o.title_untrusted, "body_untrusted": o.body_untrusted,
            "inputs": [{"name": i.name, "source": i.source, "untrusted": i.untrusted} for i in o.inputs]}


def event(e: pb.Event) -> JsonObject:
    try:
        payload = json.loads(e.payload_json) if e.payload_json else {}
    except ValueError:
        payload = {"text": e.payload_json}
    return {"ticket_id": e.ticket_id, "seq": e.seq, "type": e.type, "payload": payload, "at_ms": e.at_ms}


def workflow(w: pb.Workflow) -> JsonObject:
    return {"name": w.name, "workspace": w.workspace,
            "nodes": [{"id": n.id, "kind": n.kind, "needs": list(n.needs)} for n in w.nodes],
            "inputs": [{"name": i.name, "required": i.required, "default": i.default_value} for i in w.inputs]}


def workspace(w: pb.Workspace) -> JsonObject:
    return {"name": w.name, "repo": w.repo, "base_branch": w.base_branch, "forge": w.forge,
            "egress": list(w.egress), "forge_repo": w.forge_repo}
