"""The CLI's exit codes, its one error type and its JSON-RPC client of the gateway's /rpc WebSocket."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from typing import Any, Self

EXIT_OK = 0             # done / the ticket succeeded
EXIT_FAILED = 1         # the ticket failed (watch), or an unexpected server error
EXIT_USAGE = 2          # bad arguments (also invalid params reported by the server)
EXIT_REFUSED = 3        # not found, or refused in this state (e.g. approve a ticket that is not waiting)
EXIT_CONNECT = 4        # cannot reach the gateway/scheduler, or the token was refused
EXIT_CANCELLED = 5      # the ticket was cancelled (watch)
EXIT_WAITING = 6        # the ticket waits for approval (watch --until-waiting)

_BY_ERROR = {
    "invalid_params": EXIT_USAGE, "invalid_request": EXIT_USAGE, "method_not_found": EXIT_USAGE,
    "not_found": EXIT_REFUSED, "failed_precondition": EXIT_REFUSED, "already_exists": EXIT_REFUSED,
    "permission_denied": EXIT_REFUSED, "resource_exhausted": EXIT_REFUSED,
    "unavailable": EXIT_CONNECT, "unauthenticated": EXIT_CONNECT, "deadline_exceeded": EXIT_CONNECT,
}


class CliError(Exception):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class RpcClient:
    """One /rpc WebSocket with the bearer token."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url.rstrip("/")
        self._token = token
        self._ids = itertools.count(1)
        self._session: Any = None
        self._ws: Any = None
        self._backlog: list[dict[str, Any]] = []

    def __repr__(self) -> str:
        return f"RpcClient({self.url})"

    async def __aenter__(self) -> Self:
        import aiohttp

        ws_url = ("wss" if self.url.startswith("https:") else "ws") + self.url[self.url.index(":"):] + "/rpc"
        self._session = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())
        try:
            self._ws = await self._session.ws_connect(
                ws_url, headers={"Authorization": f"Bearer {self._token}"}, max_msg_size=32 * 1024 * 1024,
                heartbeat=30)
        except aiohttp.WSServerHandshakeError as exc:
            await self._session.close()
            if exc.status in (401, 403, 429):
                # 429: a wrong token from an address with many failures lately; a right one always passes.
                busy = ", and many wrong tokens came from this address lately" if exc.status == 429 else ""
                raise CliError(f"the gateway refused the token{busy} (was it rotated? set AFE_TOKEN or check "
                               "<data>/ui-token)", EXIT_CONNECT) from None
            raise CliError(f"the gateway refused the connection (HTTP {exc.status})", EXIT_CONNECT) from None
        except (aiohttp.ClientError, OSError) as exc:
            await self._session.close()
            raise CliError(f"cannot connect to the gateway at {self.url} ({exc.__class__.__name__}); "
                           "is `afe up` running? (set --url or AFE_URL)", EXIT_CONNECT) from None
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()

    async def _next(self) -> dict[str, Any]:
        import aiohttp

        msg = await self._ws.receive()
        if msg.type != aiohttp.WSMsgType.TEXT:
            if msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 4401:
                raise CliError("the session ended: the token was rotated", EXIT_CONNECT)
            raise CliError("the gateway closed the connection", EXIT_CONNECT)
        doc: dict[str, Any] = json.loads(msg.data)   # a JSON-RPC message is an object
        return doc

    async def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        rid = next(self._ids)
        await self._ws.send_str(json.dumps({"jsonrpc": "2.0", "id": rid, "method": method,
                                            "params": params or {}}))
        while True:
            doc = await self._next()
            if doc.get("id") == rid:
                break
            if "method" in doc:
                self._backlog.append(doc)
        if "error" in doc:
            err = doc["error"]
            name = (err.get("data") or {}).get("code", "internal_error")
            raise CliError(f"{err.get('message', 'error')} ({name})", _BY_ERROR.get(name, EXIT_FAILED))
        result: dict[str, Any] = doc["result"]   # every /rpc method answers an object
        return result

    async def watch(self, ticket_id: str, from_seq: int = 1,
                    follow: bool = True) -> AsyncIterator[dict[str, Any]]:
        sub = (await self.call("tickets.watch", {"id": ticket_id, "from_seq": from_seq,
                                                 "follow": follow}))["subscription"]
        while True:
            doc = self._backlog.pop(0) if self._backlog else await self._next()
            params = doc.get("params") or {}
            if params.get("subscription") != sub:
                continue
            if doc.get("method") == "tickets.watch_end":
                err = params.get("error")
                if err:
                    name = (err.get("data") or {}).get("code", "internal_error")
                    raise CliError(f"{err.get('message')} ({name})", _BY_ERROR.get(name, EXIT_FAILED))
                return
            yield params["event"]
