"""kind: McpServer — a Model Context Protocol server that agents (through a
Workflow's `mcp:`) and model nodes (`tools: [mcp:SERVER/TOOL]`) may use.

Two shapes (docs/MCP.md):

- remote: `url` (https://, or http:// to this machine) spoken to over
  Streamable HTTP (`transport: http`, the default) or the older HTTP+SSE
  (`transport: sse`), with an optional credential named by `tokenEnv`, sent
  by the credential broker's relay as `Authorization: Bearer <token>` or, with
  `header: X-Api-Key`, as that header. The credential never enters a sandbox
  (R43): only the credential broker receives the variable.
- local: `command` (an argv) run inside the ticket's sandbox over stdio. It
  gets no secret, so `tokenEnv` (and any `env`) is refused with it.

`McpServerManifest` declares the fields; `load` checks one document and adds
a `config.McpServer`. Which tools a workflow may call is the Workflow's and
the node's business (workflow.py); that the servers exist and which form
each grant takes is checked once every document is read (`grant_problems`)."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from services.common.config.model import MCP_ALL_TOOLS, MCP_TRANSPORTS, McpServer

from .document import Doc, check_api_url
from .text import ENV_NAME_RE, NAME_RE, fields_of, show

if TYPE_CHECKING:
    from .collected import Collected as Loader

DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 600.0
# A header name is an HTTP token (RFC 9110 5.1, 5.6.2).
HEADER_RE = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$")
# Headers the relay itself owns: the message's framing and routing, the MCP session's own, and the
# default credential header (written by leaving `header:` out).
RESERVED_HEADERS = frozenset(h.lower() for h in (
    "Host", "Content-Length", "Content-Type", "Content-Encoding", "Transfer-Encoding", "Connection",
    "Keep-Alive", "Upgrade", "TE", "Trailer", "Proxy-Authorization", "Proxy-Connection", "Accept",
    "Accept-Encoding", "Mcp-Session-Id", "Mcp-Protocol-Version", "Last-Event-ID", "Cookie"))


class McpServerManifest(BaseModel):
    """An MCP server: remote (url:, reached through the credential broker's relay) or local
    (command:, run inside the sandbox, no secret). Write url: or command:."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True,
                              json_schema_extra={"oneOf": [{"required": ["url"]}, {"required": ["command"]}]})
    kind: Literal["McpServer"]
    name: Annotated[str, StringConstraints(pattern=NAME_RE.pattern)]
    transport: Literal["http", "sse", "stdio"] | None = Field(
        None, description="http (Streamable HTTP, the default with url:), sse (an older server that still "
        "needs HTTP+SSE) or stdio (the default with command:)")
    url: str | None = Field(None, description="the server's MCP endpoint: https://, or http:// to localhost")
    tokenEnv: Annotated[str, StringConstraints(pattern=ENV_NAME_RE.pattern)] | None = Field(
        None, description="the NAME of the variable holding the server's credential; only the credential "
        "broker receives it (R43)")
    header: str | None = Field(None, description="the header that carries the token (e.g. X-Api-Key); "
                               "default: Authorization: Bearer <token>")
    command: list[Annotated[str, StringConstraints(min_length=1)]] | None = Field(
        None, min_length=1, description="a stdio server: its argv inside the sandbox (the image must have it)")
    timeout: float = Field(DEFAULT_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S,
                           description="seconds per request through the relay")


def load(loader: Loader, doc: Doc, d: Mapping[str, Any], name: str | None) -> None:
    if "env" in d:
        doc.error("env", "an MCP server gets no variable from afe's environment: a stdio server runs inside "
                  "the sandbox, where no secret goes (R43); remove env:. A server that needs a credential "
                  "is remote: write url: and tokenEnv: (the credential broker's relay adds it)")
    checked = {k: v for k, v in d.items() if k != "env"}
    doc.fields(checked, "", fields_of(McpServerManifest), (),
               hint=" (url: for a remote server, command: for a stdio server in the sandbox)")
    transport = doc.choice(d, "transport", "transport", MCP_TRANSPORTS)
    url = doc.text(d, "url", "url", None)
    command = doc.str_list(d, "command", "command", nonempty="command" in d, unique=False)
    token_env = doc.env_name(d, "tokenEnv", "tokenEnv")
    header = doc.text(d, "header", "header", None)
    timeout = doc.number(d, "timeout", "timeout", DEFAULT_TIMEOUT_S)
    if timeout > MAX_TIMEOUT_S:
        doc.error("timeout", f"at most {MAX_TIMEOUT_S:g} seconds; lower it")
        timeout = DEFAULT_TIMEOUT_S
    remote = "url" in d
    if remote and "command" in d:
        doc.error("command", "a server is remote (url:) or runs in the sandbox (command:), not both; remove "
                  "one of them")
        return
    if not remote and "command" not in d:
        doc.error("url", "required field is missing; add url: https://… (a remote MCP server, reached "
                  "through the relay) or command: [argv] (a stdio server run inside the sandbox)")
        return
    if remote:
        if url is not None:
            _check_url(doc, url)
        elif d.get("url") is None:
            doc.error("url", "is empty; write the server's MCP endpoint, e.g. https://mcp.example.com/mcp")
        if transport == "stdio":
            doc.error("transport", "stdio is for a server run inside the sandbox (command:); a url: server "
                      "speaks http (Streamable HTTP, the default) or sse")
        if header is not None:
            _check_header(doc, header, token_env)
        transport = transport or "http"
    else:
        if transport is not None and transport != "stdio":
            doc.error("transport", f"{transport} needs url:; a command: server speaks stdio (leave transport: "
                      "out)")
        if "tokenEnv" in d:
            doc.error("tokenEnv", "a stdio server runs inside the sandbox, where no credential may go (R43); "
                      "remove tokenEnv, or run the server remotely (url: and tokenEnv:) so the credential "
                      "broker's relay adds it")
        if "header" in d:
            doc.error("header", "only a remote server with tokenEnv: sends a credential header; remove it")
        if "timeout" in d:
            doc.error("timeout", "only a remote server's requests go through the relay; remove it")
        transport = "stdio"
    if doc.named and name is not None:
        loader.mcp_servers[name] = McpServer(
            name=name, transport=transport, url=(url or "") if remote else "",
            token_env=token_env if remote else None, header=header if remote else None,
            command=() if remote else command, timeout_s=timeout, source=doc.where)


def _check_url(doc: Doc, url: str) -> None:
    """Like a Model's baseUrl (https://, or http:// to this machine, no user@), plus no #fragment."""
    before = len(doc.errors)
    check_api_url(doc, url, "url")
    if len(doc.errors) != before:
        return
    parts = urllib.parse.urlsplit(url)
    if parts.fragment or url.endswith("#"):
        doc.error("url", "must not have a #fragment; write the server's endpoint, e.g. https://mcp.example.com/mcp")


def _check_header(doc: Doc, header: str, token_env: str | None) -> None:
    if token_env is None:
        doc.error("header", "names the header that carries the token of tokenEnv:, which is missing; add "
                  "tokenEnv: <the NAME of the variable holding it> or remove header:")
    elif not HEADER_RE.match(header):
        doc.error("header", f"{show(header)} is not a header name; write one such as X-Api-Key (letters, "
                  "digits, '-')")
    elif header.lower() == "authorization":
        doc.error("header", "leave header: out to send Authorization: Bearer <token> (the default); name "
                  "another header (e.g. X-Api-Key) to send the token there as it is")
    elif header.lower() in RESERVED_HEADERS:
        doc.error("header", f"{header} is a header the relay sets itself; name the header your server reads "
                  "the token from, e.g. X-Api-Key")


def grant_problems(loader: Loader, declared: Collection[str]) -> list[str]:
    """A Workflow's `mcp:` (its agents' grants) and a model node's `tools: [mcp:...]` name
    McpServers of this folder (`declared`: every McpServer document's name, loaded or not); a
    remote server's tools are listed (the relay passes only those), a stdio server's are `all`
    (it runs in the sandbox, beside the agent, unfiltered); a model node's servers are remote."""
    out: list[str] = []
    defined = ", ".join(sorted(loader.mcp_servers)) or "none"
    for wf in loader.workflows.values():
        where = wf.source
        if wf.mcp and not any(n.kind == "agent" for n in wf.nodes):
            out.append(f"{where} mcp: grants MCP tools to this workflow's agent nodes, and it has none; a "
                       "model node lists its own in tools: [mcp:SERVER/TOOL]")
        for g in wf.mcp:
            p = f"mcp.{g.server}"
            s = loader.mcp_servers.get(g.server)
            if s is None:
                if g.server not in declared:
                    out.append(f"{where} {p}: no McpServer named {show(g.server)}; defined: {defined}")
            elif s.remote and g.tools == (MCP_ALL_TOOLS,):
                out.append(f"{where} {p}: list the tools the agents may call, e.g. {g.server}: [get_issue]; "
                           f"the relay passes only listed tools of a remote server (R43), so "
                           f"{MCP_ALL_TOOLS!r} is not accepted for it")
            elif s.transport == "sse":
                out.append(f"{where} {p}: McpServer {show(g.server)} speaks the older HTTP+SSE (transport: sse), "
                           "which the relay does not serve to agents; agents reach servers that speak Streamable "
                           "HTTP (transport: http). A model node can use it: tools: [mcp:"
                           f"{g.server}/TOOL]")
            elif not s.remote and g.tools != (MCP_ALL_TOOLS,):
                out.append(f"{where} {p}: McpServer {show(g.server)} runs inside the sandbox (command:), where "
                           f"afe cannot filter its tools; write {g.server}: {MCP_ALL_TOOLS} to let the agents "
                           "start it, or remove it")
        index: dict[Any, int] = {}
        for i, r in enumerate(loader._raw_nodes.get(wf.name, [])):
            if isinstance(r, dict):
                index.setdefault(r.get("id"), i)
        for n in wf.nodes:
            for g in n.mcp:
                p = f"nodes[{index.get(n.id, '?')}].tools: mcp:{g.server}/…"
                s = loader.mcp_servers.get(g.server)
                if s is None:
                    if g.server not in declared:
                        out.append(f"{where} {p}: no McpServer named {show(g.server)}; defined: {defined}")
                elif not s.remote:
                    out.append(f"{where} {p}: McpServer {show(g.server)} runs inside the sandbox (command:), "
                               "for agents only; a model node reaches MCP servers through the credential "
                               "broker: give it a remote server (url:)")
    return out
