"""MCP tools of afe's own model nodes (docs/MCP.md, R43): the broker's
ListMcpTools and CallMcpTool.

A model node lists MCP tools next to afe's own (`tools: [read_file,
mcp:tracker/get_issue]`). It runs on the host, in the scheduler, which holds
no secret: the scheduler names the ticket, the workflow and the node, and the
broker reads the node's grant from its OWN manifests (the scheduler never
sends a URL, a token or a tool list), asks the server with the token only it
holds (services/common/mcpclient.py) and answers the granted tools. A call of a tool outside
the grant is refused before any server is contacted.

Per ticket: the ticket id is checked, each call is fenced like every side
effect of a ticket (R37, fencing/resource.py; a tool may write: create an issue, post
a message), and at most MAX_CALLS_PER_TICKET calls of one ticket run at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.common.config.model import Config, McpGrant, McpServer
from services.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from services.common.layout import check_ticket_id
from services.common.mcpclient import MAX_ARGUMENTS_BYTES, McpClient, ToolInfo, ToolResult
from services.credentials.fencing.resource import FenceGuard

MAX_CALLS_PER_TICKET = 4     # MCP calls of one ticket in flight at once


@dataclass(frozen=True)
class Listed:
    tools: list[tuple[str, ToolInfo]]          # (server, tool) the node may call and the server offers
    missing: list[tuple[str, str]]             # (server, tool) granted but not offered


class ModelNodeMcp:
    def __init__(self, config: Config, client: McpClient, fences: FenceGuard) -> None:
        self.config = config
        self.client = client
        self.fences = fences
        self._in_flight: dict[str, int] = {}

    def grants(self, workflow: str, node: str) -> tuple[McpGrant, ...]:
        """The MCP grant of a model node, from the broker's own manifests."""
        wf = self.config.workflows.get(workflow)
        if wf is None:
            raise NotFound(f"unknown workflow {workflow!r}; the manifests define: "
                           f"{', '.join(sorted(self.config.workflows)) or 'none'}")
        try:
            n = wf.node(node)
        except KeyError:
            raise NotFound(f"workflow {workflow!r} has no node {node!r}") from None
        if n.kind != "model":
            raise FailedPrecondition(f"node {node!r} of workflow {workflow!r} is a {n.kind} node; ListMcpTools "
                                     "and CallMcpTool serve model nodes (an agent reaches MCP servers through "
                                     "the relay)")
        return n.mcp

    def _server(self, name: str) -> McpServer:
        s = self.config.mcp_servers.get(name)
        if s is None or not s.remote:
            raise FailedPrecondition(f"McpServer {name!r} is not a remote server of these manifests; run "
                                     "`afe check`")
        return s

    async def list_tools(self, ticket_id: str, workflow: str, node: str) -> Listed:
        check_ticket_id(ticket_id)
        tools: list[tuple[str, ToolInfo]] = []
        missing: list[tuple[str, str]] = []
        for grant in self.grants(workflow, node):
            offered = {t.name: t for t in await self.client.list_tools(self._server(grant.server))}
            for tool in grant.tools:
                if tool in offered:
                    tools.append((grant.server, offered[tool]))
                else:
                    missing.append((grant.server, tool))
        return Listed(tools, missing)

    async def call_tool(self, ticket_id: str, workflow: str, node: str, server: str, tool: str,
                        arguments_json: str, fence: int = 0) -> ToolResult:
        check_ticket_id(ticket_id)
        grant = next((g for g in self.grants(workflow, node) if g.server == server), None)
        if grant is None or not grant.allows(tool):
            granted = ", ".join(f"mcp:{g.server}/{t}" for g in self.grants(workflow, node) for t in g.tools)
            raise PermissionDenied(f"tool {tool[:130]!r} of MCP server {server[:64]!r} is not granted to node "
                                   f"{node!r} of workflow {workflow!r} (it has: {granted or 'none'}); add "
                                   "mcp:SERVER/TOOL to the node's tools: to allow it")
        s = self._server(server)
        if len(arguments_json.encode("utf-8", "surrogatepass")) > MAX_ARGUMENTS_BYTES:
            raise InvalidArgument(f"the arguments of {tool} are over {MAX_ARGUMENTS_BYTES} bytes; an MCP call "
                                  "takes less")
        try:
            arguments = json.loads(arguments_json or "{}")
        except (ValueError, RecursionError):
            raise InvalidArgument("the arguments are not JSON; send a JSON object") from None
        if not isinstance(arguments, dict):
            raise InvalidArgument("the arguments must be a JSON object")
        if self._in_flight.get(ticket_id, 0) >= MAX_CALLS_PER_TICKET:
            raise ResourceExhausted(f"ticket {ticket_id} already has {MAX_CALLS_PER_TICKET} MCP calls under way; "
                                    "wait for one to end")
        self._in_flight[ticket_id] = self._in_flight.get(ticket_id, 0) + 1
        try:
            async with self.fences.hold(ticket_id, fence):
                return await self.client.call_tool(s, tool, arguments)
        finally:
            left = self._in_flight.pop(ticket_id, 1) - 1
            if left > 0:
                self._in_flight[ticket_id] = left
