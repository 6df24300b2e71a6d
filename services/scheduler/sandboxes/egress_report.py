"""Blocked egress attempts, reported to people (the PR description, the
final GitHub comment): the host names the ticket's egress proxy refused
(R11), as the sandbox broker's DeniedEgress lists them.

The names come from a sandbox-made log: the broker keeps only clean host
names, and they are shown here as inline code with backticks and line
breaks removed, clipped and bounded again, whatever the event store holds.
"""

from __future__ import annotations

import json
from typing import Any

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb

EVENT = "egress.denied"
HOSTS_SHOWN = 50
_HOST_MAX = 253
_EVENTS_SCANNED = 20000        # the newest events of a ticket searched for the latest EVENT


def payload(r: spb.DeniedEgressResponse) -> dict[str, Any]:
    """The EVENT's payload: [{host, count}], truncated."""
    return {"hosts": [{"host": h.host, "count": int(h.count)} for h in list(r.hosts)[:HOSTS_SHOWN]],
            "truncated": bool(r.truncated) or len(r.hosts) > HOSTS_SHOWN}


def record_payload(r: spb.DeniedEgressResponse) -> dict[str, Any]:
    """For the run record (R42): the refused hosts as `payload`, and the hosts the
    proxy let through with counts (`allowed`, `allowed_truncated`)."""
    return {**payload(r), "allowed": [{"host": _name(h.host), "count": int(h.count)} for h in r.allowed],
            "allowed_truncated": bool(r.allowed_truncated)}


_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789.-[]:")


def _name(text: object) -> str:
    """A host name as the broker gives it; any other character is dropped."""
    return "".join(ch for ch in str(text).lower()[:_HOST_MAX] if ch in _HOST_CHARS)


def section(data: dict[str, Any] | None, heading: str = "### Blocked egress attempts") -> str:
    """A markdown section listing the refused hosts with counts; "" when none."""
    hosts = [h for h in (data or {}).get("hosts") or [] if isinstance(h, dict)][:HOSTS_SHOWN]
    rows = []
    for h in hosts:
        name = _name(h.get("host", ""))
        count = h.get("count", 0)
        if name:
            n = count if isinstance(count, int) and count > 0 else 0
            rows.append(f"- `{name}` ({n} time{'' if n == 1 else 's'})")
    if not rows:
        return ""
    more = "\n- … and more hosts" if (data or {}).get("truncated") else ""
    return (f"{heading}\n\nThe sandbox's egress proxy refused requests to these hosts; if the work needs "
            "one, add it to the Workspace's `sandbox.egress`.\n\n" + "\n".join(rows) + more)


def latest(store: Any, ticket_id: str) -> dict[str, Any] | None:
    """The payload of the ticket's newest EVENT (the newest events searched, bounded)."""
    seq = store.last_seq(ticket_id)
    floor = max(1, seq - _EVENTS_SCANNED)
    while seq >= floor:
        start = max(floor, seq - 999)
        for ev in reversed(store.events(ticket_id, start, limit=seq - start + 1)):
            if ev.type == EVENT:
                try:
                    data = json.loads(ev.payload_json)
                except ValueError:
                    return None
                return data if isinstance(data, dict) else None
        seq = start - 1
    return None
