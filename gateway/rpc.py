"""JSON-RPC 2.0 over the /rpc WebSocket.

Each text frame is one request object (batches are refused). Every request
is validated: envelope, method name, params against the method's pydantic
model (`services/common/schema/rpc.py`, shared with the CLI; the ticket
limits are those the scheduler applies). The method's handler takes that
model (`_handler`), so its signature says which params it reads.
Failures become stable error codes (`error.code` number and
`error.data.code` name) with a redacted message; tracebacks stay in the log.

`tickets.watch` answers `{"subscription": "w1"}` and then sends
notifications `tickets.event` {subscription, event} and finally
`tickets.watch_end` {subscription, error|null}; `tickets.unwatch` stops one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import WSMsgType, web
from pydantic import BaseModel

from services.common import errors
from services.common.observability import telemetry
from services.common.schema.rpc import (
    METHODS,
    ApproveParams,
    CreateParams,
    FollowUpParams,
    ListParams,
    NoParams,
    PullParams,
    RejectParams,
    RetryParams,
    TicketParams,
    UnwatchParams,
    WatchParams,
    validate_params,
)
from services.common.secrecy.redact import Redactor

from .auth import Authenticator, Principal
from .backend import SchedulerBackend
from .convert import JsonObject

log = logging.getLogger(__name__)

MAX_MESSAGE = 256 * 1024
MAX_IN_FLIGHT = 16
MAX_WATCHES = 16
CLOSE_AUTH = 4401  # the session ended (token rotated or cookie expired)

PARSE_ERROR = (-32700, "parse_error")
INVALID_REQUEST = (-32600, "invalid_request")
METHOD_NOT_FOUND = (-32601, "method_not_found")
INVALID_PARAMS = (-32602, "invalid_params")
INTERNAL = (-32603, "internal_error")

# AfeError code -> (JSON-RPC code, stable name). The one place errors are mapped.
ERROR_CODES: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": INVALID_PARAMS,
    "NOT_FOUND": (-32001, "not_found"),
    "ALREADY_EXISTS": (-32002, "already_exists"),
    "FAILED_PRECONDITION": (-32003, "failed_precondition"),
    "PERMISSION_DENIED": (-32004, "permission_denied"),
    "UNAUTHENTICATED": (-32005, "unauthenticated"),
    "UNAVAILABLE": (-32006, "unavailable"),
    "DEADLINE_EXCEEDED": (-32007, "deadline_exceeded"),
    "RESOURCE_EXHAUSTED": (-32008, "resource_exhausted"),
    "CANCELLED": (-32009, "cancelled"),
    "INTERNAL": INTERNAL,
}


def error_body(exc: BaseException, redactor: Redactor) -> JsonObject:
    if isinstance(exc, errors.AfeError):
        code, name = ERROR_CODES.get(exc.code, INTERNAL)
        message = exc.message
        if exc.code == "UNAVAILABLE":
            message = "the scheduler is not reachable right now; try again shortly"
        elif exc.code == "INTERNAL":
            message = "internal error (details are in the server log)"
    else:
        code, name = INTERNAL
        message = "internal error (details are in the server log)"
    return {"code": code, "message": redactor.redact(message), "data": {"code": name}}


@dataclass
class _Request:
    id: str | int | None
    method: str
    params: Any


# A refused request: (its error code, the message).
_Problem = tuple[tuple[int, str], str]

_P = TypeVar("_P", bound=BaseModel)
# A method's handler: its validated params (validate_params) -> the reply's `result`.
_Handler = Callable[[BaseModel], Awaitable[JsonObject]]


def _as(model: type[_P], params: BaseModel) -> _P:
    """`params` as the model a handler takes: the one METHODS names for its method."""
    if not isinstance(params, model):
        raise TypeError(f"params validated as {type(params).__name__}; the handler takes {model.__name__}")
    return params


def _handler(model: type[_P], call: Callable[[_P], Awaitable[JsonObject]]) -> _Handler:
    """The handler of a method whose params are `model` (type-checked against `call`)."""
    async def run(params: BaseModel) -> JsonObject:
        return await call(_as(model, params))
    return run


class RpcConnection:
    def __init__(self, ws: web.WebSocketResponse, principal: Principal, backend: SchedulerBackend,
                 auth: Authenticator, redactor: Redactor) -> None:
        self.ws = ws
        self.principal = principal
        self.backend = backend
        self.auth = auth
        self.redactor = redactor
        self._send_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._watches: dict[str, asyncio.Task[None]] = {}
        self._next_watch = 0
        self._closer: asyncio.Future[bool] | None = None
        self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        # Every method of METHODS but tickets.watch (`_watch`), with the model METHODS names for it.
        self._handlers: dict[str, _Handler] = {
            "tickets.create": _handler(CreateParams, self._create),
            "tickets.list": _handler(ListParams, self._list),
            "tickets.get": _handler(TicketParams, lambda p: self.backend.get_ticket(p.id)),
            "tickets.diff": _handler(TicketParams, lambda p: self.backend.ticket_diff(p.id)),
            "tickets.records": _handler(TicketParams, lambda p: self.backend.run_records(p.id)),
            "keys.get": _handler(NoParams, lambda p: self.backend.signing_key()),
            "tickets.cancel": _handler(TicketParams, lambda p: self.backend.cancel_ticket(
                p.id, self.principal.name)),
            "tickets.approve": _handler(ApproveParams, lambda p: self.backend.approve_ticket(
                p.id, self.principal.name, p.sha, p.accept_harness_change)),
            "tickets.reject": _handler(RejectParams, lambda p: self.backend.reject_ticket(
                p.id, self.principal.name, p.reason)),
            "tickets.followup": _handler(FollowUpParams, lambda p: self.backend.followup_ticket(
                p.id, self.principal.name, p.instruction)),
            "tickets.retry": _handler(RetryParams, lambda p: self.backend.retry_ticket(
                p.id, self.principal.name, p.from_node)),
            "tickets.updateBranch": _handler(TicketParams, lambda p: self.backend.update_ticket_branch(
                p.id, self.principal.name)),
            "tickets.unwatch": _handler(UnwatchParams, self._unwatch),
            "pulls.get": _handler(PullParams, lambda p: self.backend.get_pull(p.workspace, p.number)),
            "workflows.list": _handler(NoParams, lambda p: self.backend.list_workflows()),
            "workspaces.list": _handler(NoParams, lambda p: self.backend.list_workspaces()),
            "session.info": _handler(NoParams, self._session_info),
        }

    # -- sending -----------------------------------------------------------
    async def _send(self, doc: JsonObject) -> None:
        if self.ws.closed:
            return
        async with self._send_lock:
            with contextlib.suppress(ConnectionResetError, RuntimeError):
                await self.ws.send_str(json.dumps(doc, separators=(",", ":")))

    async def _reply(self, req_id: Any, result: Any) -> None:
        await self._send({"jsonrpc": "2.0", "id": req_id, "result": result})

    async def _error(self, req_id: Any, code: tuple[int, str], message: str) -> None:
        await self._send({"jsonrpc": "2.0", "id": req_id,
                          "error": {"code": code[0], "message": message, "data": {"code": code[1]}}})

    # -- the loop ----------------------------------------------------------
    async def serve(self) -> None:
        try:
            async for msg in self.ws:
                if not self.auth.still_valid(self.principal):
                    self.close_for_auth()
                    break
                if msg.type == WSMsgType.TEXT:
                    await self._dispatch(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    await self._error(None, INVALID_REQUEST, "send JSON-RPC requests as text frames")
                elif msg.type == WSMsgType.ERROR:
                    break
        finally:
            for t in list(self._tasks):
                t.cancel()
            for t in list(self._tasks):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            if self._closer is not None:
                # Keep the handler alive until the close frame is out.
                with contextlib.suppress(Exception):
                    await self._closer

    def close_for_auth(self) -> asyncio.Future[bool]:
        """Close with 4401 (the session ended); safe to call from any task."""
        if self._closer is None:
            self._closer = asyncio.ensure_future(
                self.ws.close(code=CLOSE_AUTH, message=b"session ended; log in again"))
        return self._closer

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _dispatch(self, raw: str) -> None:
        try:
            doc = json.loads(raw)
        except ValueError:
            await self._error(None, PARSE_ERROR, "the message is not valid JSON")
            return
        req = self._envelope(doc)
        if not isinstance(req, _Request):
            code, message = req
            self.auth.metrics.requests.labels("invalid", code[1]).inc()
            rid = doc.get("id") if isinstance(doc, dict) else None
            if isinstance(rid, bool) or not isinstance(rid, (str, int)) or (isinstance(rid, str) and len(rid) > 64):
                rid = None
            await self._error(rid, code, message)
            return
        if self._slots.locked():
            await self._error(req.id, ERROR_CODES["RESOURCE_EXHAUSTED"],
                              f"at most {MAX_IN_FLIGHT} requests may be in flight on one connection")
            return
        await self._slots.acquire()
        self._spawn(self._run(req))

    @staticmethod
    def _envelope(doc: Any) -> _Request | _Problem:
        if isinstance(doc, list):
            return INVALID_REQUEST, "batches are not supported; send one request per message"
        if not isinstance(doc, dict):
            return INVALID_REQUEST, "a request must be a JSON object"
        if doc.get("jsonrpc") != "2.0":
            return INVALID_REQUEST, "'jsonrpc' must be \"2.0\""
        extra = set(doc) - {"jsonrpc", "id", "method", "params"}
        if extra:
            return INVALID_REQUEST, f"unknown member(s): {', '.join(sorted(map(repr, extra)))}"
        rid = doc.get("id")
        if "id" not in doc or isinstance(rid, bool) or not isinstance(rid, (str, int)) \
                or (isinstance(rid, str) and len(rid) > 64):
            return INVALID_REQUEST, "'id' must be a string (at most 64 characters) or an integer"
        method = doc.get("method")
        if not isinstance(method, str):
            return INVALID_REQUEST, "'method' must be a string"
        if method not in METHODS:
            return METHOD_NOT_FOUND, f"unknown method {method[:64]!r}; known: " + ", ".join(sorted(METHODS))
        return _Request(rid, method, doc.get("params"))

    async def _run(self, req: _Request) -> None:
        # Each JSON-RPC call starts its own trace (tickets.create -> scheduler -> brokers).
        name = req.method if req.method in METHODS else "unknown"
        with telemetry.span(f"rpc {name}", root=True, attributes={"rpc.method": name}):
            await self._run_call(req)

    async def _run_call(self, req: _Request) -> None:
        outcome = "ok"
        try:
            try:
                params = validate_params(req.method, req.params)
                if req.method == "tickets.watch":
                    await self._watch(req.id, _as(WatchParams, params))
                    return
                result = await self._handlers[req.method](params)
            except asyncio.CancelledError:
                raise
            except errors.AfeError as exc:
                outcome = ERROR_CODES.get(exc.code, INTERNAL)[1]
                log.info("rpc %s -> %s", req.method, exc.code)
                await self._send({"jsonrpc": "2.0", "id": req.id, "error": error_body(exc, self.redactor)})
                return
            except Exception as exc:
                outcome = INTERNAL[1]
                log.exception("rpc %s failed", req.method)
                await self._send({"jsonrpc": "2.0", "id": req.id, "error": error_body(exc, self.redactor)})
                return
            await self._reply(req.id, result)
        finally:
            self._slots.release()
            self.auth.metrics.requests.labels(req.method, outcome).inc()

    # -- methods -----------------------------------------------------------
    async def _create(self, p: CreateParams) -> JsonObject:
        return await self.backend.create_ticket(workspace=p.workspace, workflow=p.workflow,
                                                title=p.title, body=p.body, inputs=p.inputs,
                                                principal=self.principal.name)

    async def _list(self, p: ListParams) -> JsonObject:
        return await self.backend.list_tickets(states=p.states, workspace=p.workspace,
                                               page_size=p.page_size, page_token=p.page_token)

    async def _session_info(self, p: NoParams) -> JsonObject:
        return {"principal": self.principal.name,
                "expires_at": self.principal.session.expires_at if self.principal.session else None}

    async def _unwatch(self, p: UnwatchParams) -> JsonObject:
        task = self._watches.pop(p.subscription, None)
        if task is None:
            raise errors.NotFound(f"no subscription {p.subscription!r} on this connection")
        task.cancel()
        return {"ok": True}

    async def _watch(self, req_id: Any, p: WatchParams) -> None:
        if len(self._watches) >= MAX_WATCHES:
            raise errors.ResourceExhausted(f"at most {MAX_WATCHES} watches may be open on one connection")
        await self.backend.get_ticket(p.id)  # NotFound answers the request itself
        self._next_watch += 1
        sub = f"w{self._next_watch}"
        await self._reply(req_id, {"subscription": sub})
        self._watches[sub] = self._spawn(self._pump(sub, p))

    async def _pump(self, sub: str, p: WatchParams) -> None:
        error = None
        try:
            async for event in self.backend.watch_ticket(p.id, p.from_seq, p.follow):
                await self._send({"jsonrpc": "2.0", "method": "tickets.event",
                                  "params": {"subscription": sub, "event": event}})
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not isinstance(exc, errors.AfeError):
                log.exception("watch of %s failed", p.id)
            error = error_body(exc, self.redactor)
        finally:
            self._watches.pop(sub, None)
        await self._send({"jsonrpc": "2.0", "method": "tickets.watch_end",
                          "params": {"subscription": sub, "error": error}})
