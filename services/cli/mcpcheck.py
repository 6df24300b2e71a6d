"""`afe check --online` and `afe doctor`: which tools each remote McpServer
offers, asked from this host (never from a sandbox) with the same client the
credential broker uses (services/common/mcpclient.py) and the token from
this shell's environment, as `afe check --online` reads a repository with
the Workspace's tokenEnv. `AFE_CA_FILE` and the proxy variables count as for
the broker, so what this lists, `afe up` can reach.

A grant (a Workflow's `mcp:`, a model node's `mcp:SERVER/TOOL`) naming a tool
the server does not offer is a problem; so are an unset tokenEnv, an
unreachable server and a refused token, each in one line saying what to
check. The tools' names are the server's text: shown escaped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from services.common.config.model import Config, McpServer
from services.common.errors import AfeError
from services.common.provenance.verification import shown
from services.common.secrecy.childenv import proxy_env

SHOW_TOOLS = 20     # tool names printed per server


@dataclass
class ServerReport:
    server: McpServer
    tools: list[str] = field(default_factory=list)
    problem: str = ""          # why it could not be listed ("" when listed)
    unset: bool = False        # its tokenEnv is not set in this shell (not contacted)

    @property
    def ok(self) -> bool:
        return not self.problem


async def list_servers(config: Config, environ: Mapping[str, str]) -> list[ServerReport]:
    """Each remote McpServer's tools, or why they could not be listed."""
    from services.common.mcpclient import McpClient

    ca = environ.get("AFE_CA_FILE")
    client = McpClient(lambda name: environ.get(name) or None, ca_file=Path(ca) if ca else None,
                       proxies=proxy_env(environ))
    out: list[ServerReport] = []
    for s in sorted(config.mcp_servers.values(), key=lambda s: s.name):
        if not s.remote:
            continue
        if s.token_env and not environ.get(s.token_env):
            out.append(ServerReport(s, problem=f"{s.token_env} is not set in this shell; export it and retry",
                                    unset=True))
            continue
        try:
            out.append(ServerReport(s, tools=[t.name for t in await client.list_tools(s)]))
        except AfeError as exc:
            out.append(ServerReport(s, problem=shown(exc.message, 600)))
    return out


def tools_line(r: ServerReport) -> str:
    names = [shown(n, 128) for n in r.tools]
    more = f" and {len(names) - SHOW_TOOLS} more" if len(names) > SHOW_TOOLS else ""
    listed = ", ".join(names[:SHOW_TOOLS]) + more if names else "none"
    return f"MCP server {r.server.name} ({r.server.url}): {len(names)} tool(s) reachable: {listed}"


def grant_problems(config: Config, reports: list[ServerReport]) -> list[str]:
    """Granted tools a reachable server does not offer."""
    offered = {r.server.name: set(r.tools) for r in reports if r.ok}
    out: list[str] = []
    for wf in sorted(config.workflows.values(), key=lambda w: w.name):
        for g in wf.mcp:
            for tool in g.tools:
                if g.server in offered and tool not in offered[g.server]:
                    out.append(f"{wf.source} mcp.{g.server}: {tool!r} is not a tool of McpServer {g.server} "
                               "(see the tools it offers above); fix the name or remove it")
        for n in wf.nodes:
            for g in n.mcp:
                for tool in g.tools:
                    if g.server in offered and tool not in offered[g.server]:
                        out.append(f"{wf.source} node {n.id} tools: mcp:{g.server}/{tool} is not a tool of "
                                   f"McpServer {g.server} (see the tools it offers above); fix the name or "
                                   "remove it")
    return out


def check_mcp_servers(config: Config, *, online: bool, environ: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(problems, lines) for `afe check`: with `online`, each remote server's tools."""
    lines: list[str] = []
    for s in sorted(config.mcp_servers.values(), key=lambda s: s.name):
        if not s.remote:
            lines.append(f"  note: MCP server {s.name} runs inside the sandbox (command:); afe check does not "
                         "start it")
        elif not online:
            lines.append(f"  note: MCP server {s.name}: {s.url} not contacted; `afe check --online` lists its tools")
    if not online or not any(s.remote for s in config.mcp_servers.values()):
        return [], lines
    reports = asyncio.run(list_servers(config, environ))
    problems = [f"{r.server.source} McpServer {r.server.name}: {r.problem}" for r in reports if not r.ok]
    lines.extend(f"  {tools_line(r)}" for r in reports if r.ok)
    return problems + grant_problems(config, reports), lines
