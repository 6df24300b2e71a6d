"""The credential broker as an MCP client (docs/MCP.md, R43): the tools of a
remote `kind: McpServer` listed and called with the official `mcp` SDK's
client (Streamable HTTP, or HTTP+SSE where the manifest says `transport: sse`).

It serves afe's own model nodes (the credential broker's ListMcpTools / CallMcpTool,
services/credentials/broker.py) and `afe check --online` / `afe doctor` (services/cli/mcpcheck.py,
with the token from the operator's shell). The token is added here, as
`Authorization: Bearer <token>` or the manifest's `header:`; nobody else
sees it. Each operation is one MCP session:

- only the manifest's URL: the SDK follows a redirect only on the endpoint's
  own origin (same scheme, host and port), never to another host;
- bounded: the whole operation by the server's `timeout`, each response
  body by MAX_RESPONSE_BYTES (counted as it arrives), the arguments sent by
  MAX_ARGUMENTS_BYTES, a listing by MAX_TOOLS / MAX_LIST_PAGES, a
  description and a schema by their own caps, the text handed back by
  MAX_RESULT_CHARS;
- the server's answers are untrusted text (R36): returned as data, never
  logged (a log line names the server and the kind of failure only).

A failure is an `AfeError` saying what to check: unreachable (`Unavailable`),
a refused credential (`FailedPrecondition`), no answer in time
(`DeadlineExceeded`), an answer too large (`ResourceExhausted`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx2

from services.common.config.model import McpServer
from services.common.errors import (
    AfeError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from services.common.host.proxies import proxy_for

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_RESPONSE_BYTES = 4 * 1024 * 1024     # one HTTP response body (a JSON answer or an SSE stream)
MAX_ARGUMENTS_BYTES = 64 * 1024          # a tools/call's arguments, as JSON
MAX_TOOLS = 500                          # tools kept of one listing
MAX_LIST_PAGES = 20                      # tools/list pages read
MAX_DESCRIPTION_CHARS = 2000             # of one tool's description
MAX_SCHEMA_BYTES = 32 * 1024             # of one tool's input schema, as JSON
MAX_RESULT_CHARS = 32 * 1024             # of the text a call hands back
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ToolInfo:
    """A tool as the server lists it (untrusted text, bounded)."""
    name: str
    description: str
    input_schema_json: str                # a JSON object schema ({"type": "object"} when the server's was unusable)


@dataclass(frozen=True)
class ToolResult:
    text: str                             # the result's content as text (untrusted), at most MAX_RESULT_CHARS
    is_error: bool                        # the tool said it failed (isError)
    bytes: int                            # the size of the result as the server sent it (its JSON)
    truncated: bool


@dataclass
class _Wire:
    """What the HTTP layer saw during one operation: the answers' statuses and
    whether a body passed the cap (the SDK reports both only vaguely)."""
    limit: int
    statuses: list[int] = field(default_factory=list)
    too_large: bool = False


class _CappedStream(httpx2.AsyncByteStream):
    """A response body that stops with an error once it passes `wire.limit` bytes."""

    def __init__(self, inner: Any, wire: _Wire) -> None:
        self.inner = inner
        self.wire = wire

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in self.inner:
            seen += len(chunk)
            if seen > self.wire.limit:
                self.wire.too_large = True
                raise httpx2.ReadError(f"the answer passed {self.wire.limit} bytes")
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


def _transport(wire: _Wire, verify: ssl.SSLContext | bool, proxy: str | None) -> httpx2.AsyncBaseTransport:
    class CappedTransport(httpx2.AsyncBaseTransport):
        def __init__(self) -> None:
            self.inner = httpx2.AsyncHTTPTransport(verify=verify, proxy=proxy, trust_env=False,
                                                   limits=httpx2.Limits(max_connections=4))

        async def handle_async_request(self, request: Any) -> Any:
            response = await self.inner.handle_async_request(request)
            wire.statuses.append(response.status_code)
            return httpx2.Response(status_code=response.status_code, headers=response.headers,
                                   stream=_CappedStream(response.stream, wire), extensions=response.extensions)

        async def aclose(self) -> None:
            await self.inner.aclose()

    return CappedTransport()


class McpClient:
    """Lists and calls the tools of remote McpServers with their tokens (`tokens`:
    tokenEnv NAME -> value, the broker's secrets or, for `afe check --online`,
    the operator's shell). `ca_file` and `proxies` as the broker's other HTTPS."""

    def __init__(self, tokens: Callable[[str], str | None], *, ca_file: Path | None = None,
                 proxies: Mapping[str, str] | None = None, max_response_bytes: int = MAX_RESPONSE_BYTES) -> None:
        self._tokens = tokens
        self.ca_file = ca_file
        self.proxies = dict(proxies or {})
        self.max_response_bytes = max_response_bytes

    # -- the two operations -------------------------------------------------------
    async def list_tools(self, server: McpServer) -> list[ToolInfo]:
        async def op(client: Any) -> list[ToolInfo]:
            out: list[ToolInfo] = []
            cursor: str | None = None
            for _ in range(MAX_LIST_PAGES):
                page = await client.list_tools(cursor=cursor)
                out.extend(_tool_info(t) for t in page.tools[:MAX_TOOLS - len(out)])
                cursor = page.next_cursor
                if not cursor or len(out) >= MAX_TOOLS:
                    break
            return out

        return await self._session(server, "tools/list", op)

    async def call_tool(self, server: McpServer, tool: str, arguments: dict[str, Any]) -> ToolResult:
        size = len(json.dumps(arguments, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        if size > MAX_ARGUMENTS_BYTES:
            raise InvalidArgument(f"the arguments of {tool} are {size} bytes; an MCP call takes at most "
                                  f"{MAX_ARGUMENTS_BYTES}")

        async def op(client: Any) -> ToolResult:
            return _tool_result(await client.call_tool(tool, arguments))

        return await self._session(server, "tools/call", op)

    # -- one session ------------------------------------------------------------
    async def _session(self, server: McpServer, what: str, op: Callable[[Any], Awaitable[T]]) -> T:
        from mcp import Client

        if not server.remote or not server.url:
            raise FailedPrecondition(f"MCP server {server.name} runs inside the sandbox (command:); only a "
                                     "remote server (url:) is reached from the host")
        credential: dict[str, str] = {}
        if server.token_env:
            token = self._tokens(server.token_env)
            if not token:
                raise FailedPrecondition(f"MCP server {server.name}: {server.token_env} is not set; export it "
                                         "where afe runs (afe up hands it to the credential broker only)")
            name, value = server.auth_header(token)
            credential[name] = value
        wire = _Wire(self.max_response_bytes)
        verify: ssl.SSLContext | bool = True
        if server.url.startswith("https://"):
            verify = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        timeout = httpx2.Timeout(min(CONNECT_TIMEOUT_S, server.timeout_s), read=server.timeout_s)

        def make_http(headers: dict[str, str] | None = None, timeout: Any = timeout, auth: Any = None) -> Any:
            # the SDK's factory signature (sse_client); the credential header is set last, so it wins
            return httpx2.AsyncClient(headers={**(headers or {}), **credential}, timeout=timeout,
                                      transport=_transport(wire, verify, proxy_for(server.url, self.proxies)),
                                      trust_env=False, follow_redirects=False)

        try:
            async with asyncio.timeout(server.timeout_s):
                if server.transport == "sse":
                    from mcp.client.sse import sse_client

                    transport: AbstractAsyncContextManager[Any] = sse_client(
                        server.url, timeout=min(CONNECT_TIMEOUT_S, server.timeout_s),
                        sse_read_timeout=server.timeout_s, httpx_client_factory=make_http)
                    async with Client(transport, cache=None) as client:
                        return await op(client)
                from mcp.client.streamable_http import streamable_http_client

                async with make_http() as http, Client(streamable_http_client(
                        server.url, http_client=http, max_sse_event_size=self.max_response_bytes),
                        cache=None) as client:
                    return await op(client)
        except TimeoutError:
            err: AfeError = DeadlineExceeded(f"MCP server {server.name} did not answer {what} within "
                                             f"{server.timeout_s:g} s (its timeout:); check the server, or "
                                             "raise timeout: in its manifest")
        except Exception as exc:  # noqa: BLE001 - the SDK's and the HTTP layer's failures, grouped by anyio
            err = _failure(server, what, _leaf(exc), wire)
        log.warning("MCP server %s: %s failed (%s)", server.name, what, type(err).__name__)
        raise err


def _leaf(exc: BaseException) -> BaseException:
    """The first real failure inside anyio's exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _failure(server: McpServer, what: str, exc: BaseException, wire: _Wire) -> AfeError:
    from mcp import MCPError

    name = f"MCP server {server.name}"
    if isinstance(exc, AfeError):
        return exc
    if wire.too_large:
        return ResourceExhausted(f"{name} sent an answer to {what} over {wire.limit} bytes; afe stops reading "
                                 "there. Ask for less (narrower arguments), or fix the server")
    refused = [s for s in wire.statuses if s in (401, 403)]
    if refused:
        cred = f"the token in {server.token_env}" if server.token_env else "no token (the manifest has no tokenEnv:)"
        return FailedPrecondition(f"{name} refused the request (HTTP {refused[0]}) with {cred}; check the "
                                  "token's value and what it may access"
                                  + ("" if server.token_env else ", or add tokenEnv:"))
    moved = [s for s in wire.statuses if 300 <= s < 400]
    if moved:
        return FailedPrecondition(f"{name} answered {what} with a redirect (HTTP {moved[0]}) off {server.url}; afe "
                                  "follows none that leaves the server's origin (the token goes nowhere else): "
                                  "set url: to the server's real MCP endpoint")
    bad = [s for s in wire.statuses if s >= 400]
    if bad:
        return Unavailable(f"{name} answered {what} with HTTP {bad[0]} at {server.url}; check the url: (the "
                           "server's MCP endpoint) and the server")
    if isinstance(exc, httpx2.TimeoutException):
        return DeadlineExceeded(f"{name} did not answer {what} within {server.timeout_s:g} s at {server.url}")
    if isinstance(exc, (httpx2.ConnectError, httpx2.NetworkError, httpx2.ProxyError, OSError)):
        hint = "; if a private CA signed its certificate, set AFE_CA_FILE" if "certificate" in str(exc).lower() else ""
        return Unavailable(f"cannot reach {name} at {server.url} ({type(exc).__name__}); check the url:, the "
                           f"network and that the server runs{hint}")
    if isinstance(exc, MCPError):
        # the server's own words are untrusted: bounded and returned as data, never logged
        message = _clean(exc.error.message[:300])
        return FailedPrecondition(f"{name} answered {what} with an MCP error: {message}")
    if isinstance(exc, httpx2.HTTPError):
        return Unavailable(f"{name}: {what} failed ({type(exc).__name__}) at {server.url}")
    return Unavailable(f"{name}: {what} failed ({type(exc).__name__}); check that {server.url} is an MCP "
                       f"endpoint speaking {'HTTP+SSE' if server.transport == 'sse' else 'Streamable HTTP'}")


def _clean(text: str) -> str:
    """`text` as valid UTF-8 (JSON may escape a lone surrogate, which protobuf cannot carry)."""
    return text.encode("utf-8", "replace").decode("utf-8")


def _tool_info(tool: Any) -> ToolInfo:
    schema = tool.input_schema if isinstance(tool.input_schema, dict) else {}
    text = json.dumps(schema, ensure_ascii=False)
    if schema.get("type") != "object" or len(text.encode("utf-8", "surrogatepass")) > MAX_SCHEMA_BYTES:
        text = json.dumps({"type": "object"})
    description = (tool.description or "")[:MAX_DESCRIPTION_CHARS]
    return ToolInfo(name=_clean(str(tool.name)[:200]), description=_clean(description),
                    input_schema_json=_clean(text))


def _tool_result(result: Any) -> ToolResult:
    parts: list[str] = []
    for block in result.content or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource":
            res = block.resource
            text = getattr(res, "text", None)
            parts.append(text if isinstance(text, str) else
                         f"[binary resource {res.uri} ({res.mime_type or 'no type'}) omitted]")
        elif kind == "resource_link":
            parts.append(f"[resource link {block.uri}]")
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} ({block.mime_type}), {len(block.data)} base64 characters, omitted]")
        else:
            parts.append(f"[{kind or 'unknown'} content omitted]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    text = "\n".join(parts)
    size = len(result.model_dump_json(by_alias=True, exclude_none=True).encode("utf-8", "surrogatepass"))
    truncated = len(text) > MAX_RESULT_CHARS
    if truncated:
        text = text[:MAX_RESULT_CHARS] + f"\n... [{len(text) - MAX_RESULT_CHARS} characters cut]"
    return ToolResult(text=_clean(text), is_error=bool(result.is_error), bytes=size, truncated=truncated)
