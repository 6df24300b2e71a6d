"""Blocked egress attempts, reported to people (the PR description, the
final GitHub comment): the host names the ticket's egress proxy refused
(R11) and the requests egress rules refused (R44), as the sandbox broker's
DeniedEgress lists them; and every request, for the run record.

The names come from a sandbox-made log: the broker keeps only clean host
names, and they are shown here as inline code with backticks and line
breaks removed, clipped and bounded again, whatever the event store holds.
"""

from __future__ import annotations

import json
import re
from typing import Any

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb

EVENT = "egress.denied"
HOSTS_SHOWN = 50
_HOST_MAX = 253
_EVENTS_SCANNED = 20000        # the newest events of a ticket searched for the latest EVENT


def payload(r: spb.DeniedEgressResponse) -> dict[str, Any]:
    """The EVENT's payload: [{host, count}], truncated, and the refused requests
    (R44: method, host, path without its query, why, the rules, count)."""
    refused = [q for q in r.requests if q.denied]
    return {"hosts": [{"host": h.host, "count": int(h.count)} for h in list(r.hosts)[:HOSTS_SHOWN]],
            "truncated": bool(r.truncated) or len(r.hosts) > HOSTS_SHOWN,
            "requests": [{"method": _method(q.method), "host": _name(q.host), "path": _path(q.path),
                          "reason": _word(q.reason), "rule": _rule(q.rule), "count": int(q.count)}
                         for q in refused[:REQUESTS_SHOWN]],
            "requests_truncated": bool(r.requests_truncated) or len(refused) > REQUESTS_SHOWN}


def record_payload(r: spb.DeniedEgressResponse) -> dict[str, Any]:
    """For the run record (R42, R44): the refused hosts as `payload`, the hosts the
    proxy let through with counts (`allowed`, `allowed_truncated`), and every
    request allowed or refused (`all_requests`: method, host, the digest of the
    path, status, verdict, reason, rules, bytes each way, count)."""
    return {**payload(r), "allowed": [{"host": _name(h.host), "count": int(h.count)} for h in r.allowed],
            "allowed_truncated": bool(r.allowed_truncated),
            "all_requests": [{"method": _method(q.method), "host": _name(q.host),
                              "path_sha256": q.path_sha256 if _SHA256.fullmatch(q.path_sha256) else "",
                              "status": int(q.status), "denied": bool(q.denied), "reason": _word(q.reason),
                              "rule": _rule(q.rule), "bytes_out": int(q.bytes_out), "bytes_in": int(q.bytes_in),
                              "count": int(q.count)} for q in r.requests],
            "all_requests_truncated": bool(r.requests_truncated)}


REQUESTS_SHOWN = 200           # refused requests in the event
_PATH_MAX = 512
_SHA256 = re.compile(r"[0-9a-f]{64}")
_METHOD = re.compile(r"[A-Z][A-Z0-9_-]{0,19}")
_WORD = re.compile(r"[a-z-]{0,20}")
_RULE = re.compile(r"[A-Za-z0-9._\[\],-]{0,200}")


def _method(text: str) -> str:
    return text if _METHOD.fullmatch(text) else "?"


def _word(text: str) -> str:
    return text if _WORD.fullmatch(text) else ""


def _rule(text: str) -> str:
    return text if _RULE.fullmatch(text) else ""


def _path(text: str) -> str:
    """A logged path (the broker keeps visible ASCII only), clipped; anything else dropped."""
    return "".join(ch for ch in str(text)[:_PATH_MAX] if 0x21 <= ord(ch) <= 0x7E)


_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789.-[]:")


def _name(text: object) -> str:
    """A host name as the broker gives it; any other character is dropped."""
    return "".join(ch for ch in str(text).lower()[:_HOST_MAX] if ch in _HOST_CHARS)


def section(data: dict[str, Any] | None, heading: str = "### Blocked egress attempts") -> str:
    """A markdown section listing the refused hosts with counts, and the requests
    egress rules refused (R44); "" when none."""
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
    text = (f"{heading}\n\nThe sandbox's egress proxy refused requests to these hosts; if the work needs "
            "one, add it to the Workspace's `sandbox.egress`.\n\n" + "\n".join(rows) + more)
    # Which rule refused what, by method and host: never the path, which is sandbox-made
    # text a pull request would publish (afe's own events and the CLI show it).
    counts: dict[tuple[str, str, str, str], int] = {}
    for q in [q for q in (data or {}).get("requests") or [] if isinstance(q, dict)][:REQUESTS_SHOWN]:
        name, rule = _name(q.get("host", "")), _rule(str(q.get("rule", "")))
        if not name or not rule:
            continue
        key = (_method(str(q.get("method", ""))), name, rule, _word(str(q.get("reason", ""))) or "refused")
        counts[key] = counts.get(key, 0) + (q.get("count", 0) if isinstance(q.get("count"), int) else 0)
    refused = [f"- `{method} {name}` refused by `{rule}` ({reason}; {n} time{'' if n == 1 else 's'})"
               for (method, name, rule, reason), n in counts.items()]
    if refused:
        text += ("\n\nRequests the Workspace's egress rules refused (`afe ticket watch ID` lists their paths):\n\n"
                 + "\n".join(refused)
                 + ("\n- … and more requests" if (data or {}).get("requests_truncated") else ""))
    return text


def latest(store: Any, ticket_id: str) -> dict[str, Any] | None:
    """The payload of the ticket's newest EVENT (the newest events searched, bounded)."""
    seq = store.events.last_seq(ticket_id)
    floor = max(1, seq - _EVENTS_SCANNED)
    while seq >= floor:
        start = max(floor, seq - 999)
        for ev in reversed(store.events.read(ticket_id, start, limit=seq - start + 1)):
            if ev.type == EVENT:
                try:
                    data = json.loads(ev.payload_json)
                except ValueError:
                    return None
                return data if isinstance(data, dict) else None
        seq = start - 1
    return None
