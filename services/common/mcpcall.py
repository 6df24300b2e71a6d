"""The record of one MCP tool call (R43): the `mcp.call` event of a ticket.

Every call to a tool of a remote McpServer is recorded the same way whoever
made it (an agent through the credential broker's relay, or afe's own model
node through the broker's CallMcpTool): the server, the tool, the SHA-256 of
the arguments as canonical JSON, the outcome and the sizes. Never the
arguments or the result themselves: both may hold anything (R36).

`arguments_sha256` is the digest of `json.dumps(arguments, sort_keys=True,
separators=(",", ":"), ensure_ascii=True)`, so the same arguments give the
same digest on either path (services/credentials/mcptools/filter.py computes it
over what the relay forwards).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

EVENT = "mcp.call"
# ok: the tool answered; tool_error: it answered with isError; refused: afe did not let the call
# through (not granted); timeout: no answer in the server's time; unreachable: the server could not
# be reached; no_answer: the connection ended without an answer (the relay); error: anything else (a
# refused credential, an answer too large, a protocol error).
OUTCOMES = ("ok", "tool_error", "refused", "timeout", "unreachable", "no_answer", "error")


def arguments_sha256(arguments: Any) -> str:
    return hashlib.sha256(json.dumps(arguments, sort_keys=True, separators=(",", ":"),
                                     ensure_ascii=True).encode()).hexdigest()


def call_payload(*, server: str, tool: str, arguments: Any, outcome: str, request_bytes: int,
                 response_bytes: int, duration_ms: int, reason: str = "", **extra: Any) -> dict[str, Any]:
    """The payload of an `mcp.call` event; `reason` is afe's own words (never the server's),
    `extra` names who called (node, via)."""
    if outcome not in OUTCOMES:
        raise ValueError(f"unknown MCP call outcome {outcome!r}")
    return {"server": server, "tool": tool, "arguments_sha256": arguments_sha256(arguments), "outcome": outcome,
            "request_bytes": int(request_bytes), "response_bytes": int(response_bytes),
            "duration_ms": int(duration_ms), **({"reason": reason} if reason else {}), **extra}
