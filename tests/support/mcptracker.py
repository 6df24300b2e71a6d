"""A real MCP server for the MCP relay's tests (R43): the official `mcp`
Python SDK's `MCPServer` over Streamable HTTP, served by uvicorn on the
host's loopback in a thread of the test process (or in a process of its
own: `python -m tests.support.mcptracker PORT TOKEN`). It requires the
credential the way real servers do: a bearer token through the SDK's own
auth (`TokenVerifier`), or with `header="X-Api-Key"` that header, checked
in front of the app. A request without it gets 401.

    with tracker(token="canary-...") as srv:
        srv.url          # http://127.0.0.1:PORT/mcp
        srv.calls        # [(tool, arguments)] the server ran
        srv.requests     # [(method, {header: value})] of every HTTP request it got

Tools: `get_issue(number)`, `search_issues(query)`, `delete_issue(number)`
(a write no test grants), `whoami()` (answers with the server's own token:
an upstream that echoes its credential), `big(size)` (a text of `size`
bytes) and `slow(seconds)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Tracker:
    url: str
    token: str
    header: str | None = None
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)


def app(srv: Tracker, work_s: float = 0.0) -> Any:
    """The ASGI app. `work_s`: how long get_issue takes (the tracker's own lookup)."""
    from mcp.server.auth.provider import AccessToken
    from mcp.server.auth.settings import AuthSettings
    from mcp.server.mcpserver import MCPServer
    from starlette.responses import JSONResponse

    class Verifier:
        async def verify_token(self, token: str) -> AccessToken | None:
            return AccessToken(token=token, client_id="afe", scopes=[]) if token == srv.token else None

    base = srv.url.rsplit("/", 1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auth = {} if srv.header else {"token_verifier": Verifier(), "auth": AuthSettings(
            issuer_url=base, resource_server_url=srv.url, validate_token_resource=False)}
        server = MCPServer("tracker", **auth)

    @server.tool(description="Read one issue of the tracker by its number.")
    async def get_issue(number: int) -> str:
        srv.calls.append(("get_issue", {"number": number}))
        if work_s:
            await asyncio.sleep(work_s)
        return f"Issue {number}: the login page returns 500 when the password is empty."

    @server.tool(description="Search the tracker's issues.")
    def search_issues(query: str) -> str:
        srv.calls.append(("search_issues", {"query": query}))
        return f"1 issue matches {query!r}: #7"

    @server.tool(description="Delete an issue for good.")
    def delete_issue(number: int) -> str:
        srv.calls.append(("delete_issue", {"number": number}))
        return f"deleted issue {number}"

    @server.tool(description="Who the tracker thinks you are.")
    def whoami() -> str:
        srv.calls.append(("whoami", {}))
        return f"authenticated with token {srv.token}"

    @server.tool(description="A result of `size` bytes.")
    def big(size: int) -> str:
        srv.calls.append(("big", {"size": size}))
        return "x" * size

    @server.tool(description="Answer after `seconds` seconds.")
    async def slow(seconds: float) -> str:
        srv.calls.append(("slow", {"seconds": seconds}))
        await asyncio.sleep(seconds)
        return "late"

    inner = server.streamable_http_app()

    async def outer(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            srv.requests.append((scope["method"], headers))
            if srv.header and headers.get(srv.header.lower()) != srv.token:
                await JSONResponse({"error": "invalid_token"}, status_code=401)(scope, receive, send)
                return
        await inner(scope, receive, send)

    return outer


@contextlib.contextmanager
def tracker(token: str, header: str | None = None, work_s: float = 0.0) -> Iterator[Tracker]:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = Tracker(url=f"http://127.0.0.1:{port}/mcp", token=token, header=header)
    server = uvicorn.Server(uvicorn.Config(app(srv, work_s), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test MCP server did not start")
        time.sleep(0.02)
    try:
        yield srv
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def main(port: int, token: str, work_s: float) -> None:
    """A process of its own (bench/bench_mcp.py): serves until killed."""
    import uvicorn

    srv = Tracker(url=f"http://127.0.0.1:{port}/mcp", token=token)
    uvicorn.run(app(srv, work_s), host="127.0.0.1", port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
