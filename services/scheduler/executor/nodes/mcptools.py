"""The MCP tools of a model node (docs/MCP.md, R43): `tools: [read_file,
mcp:tracker/get_issue]`.

The scheduler holds no MCP token and never speaks to an MCP server: the
credential broker lists the node's granted tools (its own manifests say
which, ListMcpTools) and makes each call (CallMcpTool) with the token only it
holds. Here the tools become the model's: each is offered as
`mcp__<server>__<tool>` (the characters a model API accepts in a tool name:
letters, digits, `_` and `-`, at most 64), with the server's description and
input schema.

Everything the server says is untrusted text (R36): its descriptions and its
results reach the model only inside quoted blocks (quoting.py). A call of a
tool outside the grant is refused here, and again by the broker. Every call
is an `mcp.call` event (services/common/mcpcall.py: server, tool, the
arguments' digest, outcome, sizes), never with the arguments or the result.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.common import mcpcall
from services.common.config.model import McpServer, Node
from services.common.errors import (
    AfeError,
    DeadlineExceeded,
    FailedPrecondition,
    PeerUnavailable,
    PermissionDenied,
    Unavailable,
)

from ...sandboxes.brokers import CredentialBroker
from ...store.base import LeaseLost
from .. import quoting
from .tools import ToolDef

PREFIX = "mcp__"
CALL_EVENT = "mcp.call"                         # mcpcall.EVENT, spelled out for the UI's event scan
NAME_MAX = 64                                   # a tool name the model APIs accept: [A-Za-z0-9_-]{1,64}
NOT_A_NAME = re.compile(r"[^A-Za-z0-9_-]")
CALL_MARGIN_S = 15.0                            # the broker's own time beyond the server's timeout


def model_tool_name(server: str, tool: str, taken: set[str]) -> str:
    """The name the model calls `tool` of `server` by: `mcp__server__tool`, other characters
    as `_`, cut to NAME_MAX with a digest when too long or already taken."""
    name = NOT_A_NAME.sub("_", f"{PREFIX}{server}__{tool}")
    if len(name) > NAME_MAX or name in taken:
        digest = hashlib.sha256(f"{server}/{tool}".encode()).hexdigest()[:8]
        name = f"{name[:NAME_MAX - 9]}_{digest}"
    return name


@dataclass(frozen=True)
class McpTool:
    server: str
    tool: str
    spec: ToolDef


class NodeMcpTools:
    """The MCP tools of one model node of one ticket. `fence()` is the ticket's
    fence, checked against this scheduler's lease first (R37)."""

    def __init__(self, credentials: CredentialBroker, ticket_id: str, workflow: str, node: Node,
                 servers: dict[str, McpServer], fence: Callable[[], int],
                 emit: Callable[[str, dict[str, Any]], None]) -> None:
        self.credentials = credentials
        self.ticket_id = ticket_id
        self.workflow = workflow
        self.node = node
        self.servers = servers
        self.fence = fence
        self.emit = emit
        self.tools: dict[str, McpTool] = {}

    async def load(self) -> None:
        """Ask the broker for the node's granted tools; a granted tool the server does not
        offer fails the node (as a typo in the manifest would)."""
        if not self.node.mcp:
            return
        r = await self.credentials.list_mcp_tools(self.ticket_id, self.workflow, self.node.id)
        if r.missing:
            names = ", ".join(f"mcp:{m.server}/{m.tool}" for m in r.missing)
            raise FailedPrecondition(f"node {self.node.id} is granted {names}, which the server does not offer; "
                                     "fix tools: in the workflow (`afe check --online` lists what each MCP "
                                     "server offers)")
        for t in r.tools:
            name = model_tool_name(t.server, t.name, set(self.tools))
            self.tools[name] = McpTool(t.server, t.name, ToolDef(name, _description(t.server, t.name, t.description),
                                                                 _schema(t.input_schema_json)))

    def specs(self) -> list[ToolDef]:
        return [t.spec for t in self.tools.values()]

    def owns(self, name: str) -> bool:
        return name.startswith(PREFIX)

    async def call(self, name: str, args: dict[str, Any]) -> tuple[str, bool]:
        """Run one call of `name` (an `mcp__…` name) through the broker: (text for the model, ok)."""
        started = time.monotonic()
        arguments_json = json.dumps(args, ensure_ascii=False)
        sent = len(arguments_json.encode("utf-8"))
        ref = self.tools.get(name)
        if ref is None:
            server, _, tool = name[len(PREFIX):].partition("__")
            reason = f"{name} is not one of the MCP tools granted to node {self.node.id}"
            self._record(server, tool, args, "refused", sent, 0, started, reason)
            granted = ", ".join(self.tools) or "none"
            return f"error: tool {name!r} is not available to this node (its MCP tools: {granted})", False
        manifest = self.servers.get(ref.server)
        timeout = (manifest.timeout_s if manifest else 60.0) + CALL_MARGIN_S
        try:
            r = await self.credentials.call_mcp_tool(self.ticket_id, self.workflow, self.node.id, ref.server,
                                                     ref.tool, arguments_json, self.fence(), timeout)
        except LeaseLost:
            raise
        except AfeError as exc:
            outcome, reason = _failed(exc)
            self._record(ref.server, ref.tool, args, outcome, sent, 0, started, reason)
            return "error: " + quoting.quote(exc.message, source=f"the credential broker (calling {ref.tool} of "
                                             f"the MCP server {ref.server})"), False
        self._record(ref.server, ref.tool, args, "tool_error" if r.is_error else "ok", sent, r.bytes, started)
        text = quoting.quote(r.text, source=f"the MCP server {ref.server} (the result of its tool {ref.tool}"
                             + (", cut" if r.truncated else "") + ")")
        return (("the tool reported an error:\n" + text) if r.is_error else text), not r.is_error

    def _record(self, server: str, tool: str, args: dict[str, Any], outcome: str, sent: int, received: int,
                started: float, reason: str = "") -> None:
        self.emit(CALL_EVENT, mcpcall.call_payload(
            server=server[:64], tool=tool[:128], arguments=args, outcome=outcome, request_bytes=sent,
            response_bytes=received, duration_ms=round((time.monotonic() - started) * 1000), reason=reason,
            node=self.node.id, via="broker"))


def _failed(exc: AfeError) -> tuple[str, str]:
    """(outcome, afe's reason) of a failed call; the reason never quotes the server."""
    if isinstance(exc, PermissionDenied):
        return "refused", "the credential broker refused the call: the tool is not granted to this node"
    if isinstance(exc, DeadlineExceeded):
        return "timeout", "no answer within the server's timeout"
    if isinstance(exc, PeerUnavailable):
        return "error", "the credential broker could not be reached"
    if isinstance(exc, Unavailable):
        return "unreachable", "the MCP server could not be reached"
    return "error", f"the call failed ({exc.code.lower()})"


def _description(server: str, tool: str, text: str) -> str:
    head = f"Tool {tool} of the MCP server {server}."
    if not text.strip():
        return head
    return head + " Its description, from the server:\n" + quoting.quote(
        text, source=f"the MCP server {server} (its description of the tool {tool})")


def _schema(text: str) -> dict[str, Any]:
    try:
        schema = json.loads(text)
    except ValueError:
        return {"type": "object"}
    return schema if isinstance(schema, dict) and schema.get("type") == "object" else {"type": "object"}
