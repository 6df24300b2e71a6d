"""The engine's side of an ACP session: what the agent may ask of us.

`SandboxClient` implements the SDK's `Client` interface. Every request is
served inside the ticket's sandbox boundary:

- `fs/read_text_file`, `fs/write_text_file`: only paths under /workspace,
  mapped to workspace-relative paths and served by the sandbox broker's file
  tools, which refuse `..`, absolute paths and every symlink (R17-R19);
- `terminal/*`: commands run in the sandbox (`terminals.py`, R4);
- `session/request_permission`: answered by the node's policy — allow unless
  the tool kind is in the node's `deny` list. A request without a kind
  (Claude Code sends none) takes the kind the agent announced for the same
  `toolCallId` in a `tool_call` / `tool_call_update` update (`ToolCalls`,
  bounded per session); a kind in the request itself wins. The same deny
  list also refuses the matching requests outright (`read` -> fs reads,
  `edit` -> fs writes, `execute` -> terminals), so an agent that skips
  asking gains nothing there. What `deny` cannot stop: tools an agent runs
  by itself (its own shell, its own web fetch) without asking (docs/ACP.md).

Every decision becomes an event. Refusals are ACP errors the agent sees;
they never end the node. Broker calls are bounded in number (a semaphore)
and size (read cap).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

from acp import RequestError
from acp.schema import (
    AllowedOutcome,
    CreateTerminalResponse,
    DeniedOutcome,
    KillTerminalResponse,
    ReadTextFileResponse,
    ReleaseTerminalResponse,
    RequestPermissionResponse,
    TerminalExitStatus,
    TerminalOutputResponse,
    WaitForTerminalExitResponse,
    WriteTextFileResponse,
)

from services._gen.afe.sandbox.v1 import sandbox_pb2
from services.common.errors import AfeError, PermissionDenied
from services.common.rpc.grpcutil import rpc_errors

from .events import EventLog, block_text, clip, update_event
from .paths import workspace_relative
from .terminals import Terminal, Terminals

log = logging.getLogger(__name__)

MAX_READ_BYTES = 4 * 1024 * 1024
MAX_WRITE_BYTES = 4 * 1024 * 1024
MAX_CONCURRENT_CALLS = 8
MAX_TOOL_CALLS = 1024       # tool calls whose kind/title a session remembers (oldest forgotten first)
MAX_TOOL_CALL_ID = 256      # longer ids are not remembered

# Error codes for refusals. ACP reuses JSON-RPC codes; -32002 is the
# conventional "resource not found"; refusals use a server-defined code.
CODE_REFUSED = -32001
CODE_NOT_FOUND = -32002


def _refusal(exc: AfeError) -> RequestError:
    code = CODE_NOT_FOUND if exc.code == "NOT_FOUND" else CODE_REFUSED
    if exc.code in ("INVALID_ARGUMENT",):
        return RequestError.invalid_params({"details": clip(exc.message, 500)})
    return RequestError(code, clip(exc.message, 500), {"code": exc.code})


class ToolCalls:
    """The kind and title an agent announced per `toolCallId`, so a later
    permission request that names only the id can be judged by its kind.
    Bounded: at most `limit` ids (the least recently announced go first)."""

    def __init__(self, limit: int = MAX_TOOL_CALLS) -> None:
        self._limit = limit
        self._calls: OrderedDict[str, tuple[str | None, str | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._calls)

    def note(self, tool_call_id: Any, kind: str | None, title: str | None) -> None:
        """Remember what an update says; an update without a kind or title keeps the earlier one."""
        if not isinstance(tool_call_id, str) or len(tool_call_id) > MAX_TOOL_CALL_ID:
            return
        old_kind, old_title = self._calls.pop(tool_call_id, (None, None))
        self._calls[tool_call_id] = (kind or old_kind, clip(title) if title else old_title)
        while len(self._calls) > self._limit:
            self._calls.popitem(last=False)

    def get(self, tool_call_id: Any) -> tuple[str | None, str | None]:
        if not isinstance(tool_call_id, str):
            return None, None
        return self._calls.get(tool_call_id, (None, None))


class SandboxClient:
    def __init__(self, *, ticket_id: str, sandbox: Any, events: EventLog,
                 terminals: Terminals, deny: tuple[str, ...] = ()) -> None:
        self._ticket = ticket_id
        self._sandbox = sandbox
        self._events = events
        self._terminals = terminals
        self._deny = frozenset(deny)
        self._calls = asyncio.Semaphore(MAX_CONCURRENT_CALLS)
        self.tool_calls = ToolCalls()
        self.session_id: str | None = None
        self.wrong_session = 0

    # -- helpers -------------------------------------------------------------

    def _check_session(self, session_id: str) -> None:
        if self.session_id is None or session_id != self.session_id:
            raise RequestError.invalid_params({"details": "unknown sessionId"})

    def _check_kind(self, kind: str, what: str) -> None:
        if kind in self._deny:
            raise PermissionDenied(f"{what} is denied by this node's policy (deny: {kind})")

    # -- session/update --------------------------------------------------------

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        if self.session_id is None:
            return      # sent before we saw session/new's answer (e.g. available commands)
        if session_id != self.session_id:
            self.wrong_session += 1
            if self.wrong_session == 1:
                self._events.record("agent.protocol_error",
                                    {"reason": "session/update for an unknown sessionId was ignored"})
            return
        kind = getattr(update, "session_update", None)
        if kind in ("tool_call", "tool_call_update"):
            self.tool_calls.note(update.tool_call_id, update.kind, update.title)
        if kind == "agent_message_chunk":
            self._events.chunk("agent.message", block_text(update.content))
        elif kind == "agent_thought_chunk":
            self._events.chunk("agent.thought", block_text(update.content))
        else:
            mapped = update_event(update)
            if mapped is not None:
                self._events.end_message()
                self._events.record(*mapped)

    # -- permissions -------------------------------------------------------------

    async def request_permission(self, session_id: str, tool_call: Any, options: list[Any],
                                 **kwargs: Any) -> RequestPermissionResponse:
        self._check_session(session_id)
        known_kind, known_title = self.tool_calls.get(tool_call.tool_call_id)
        kind = tool_call.kind or known_kind or "other"
        title = tool_call.title or known_title or ""
        denied = kind in self._deny
        wanted = ("reject_once", "reject_always") if denied else ("allow_once", "allow_always")
        chosen = None
        for want in wanted:
            chosen = next((o for o in options if o.kind == want), None)
            if chosen is not None:
                break
        self._events.record("agent.permission", {
            "tool_call_id": clip(tool_call.tool_call_id), "kind": kind,
            "title": clip(title), "decision": "deny" if denied else "allow",
            "option_id": clip(chosen.option_id) if chosen else None})
        if chosen is None:
            return RequestPermissionResponse(outcome=DeniedOutcome(outcome="cancelled"))
        return RequestPermissionResponse(outcome=AllowedOutcome(outcome="selected", option_id=chosen.option_id))

    # -- files -------------------------------------------------------------------

    async def read_text_file(self, session_id: str, path: str, line: int | None = None,
                             limit: int | None = None, **kwargs: Any) -> ReadTextFileResponse:
        self._check_session(session_id)
        try:
            self._check_kind("read", "reading files")
            rel = workspace_relative(path)
            async with self._calls, rpc_errors():
                resp = await self._sandbox.ReadFile(sandbox_pb2.ReadFileRequest(
                    ticket_id=self._ticket, path=rel, max_bytes=MAX_READ_BYTES))
        except AfeError as exc:
            self._events.record("agent.fs", {"op": "read", "path": clip(path), "ok": False,
                                             "error": clip(exc.message, 300)})
            raise _refusal(exc) from None
        text = resp.content.decode("utf-8", "replace")
        if line is not None or limit is not None:
            lines = text.splitlines(keepends=True)
            first = max((line or 1) - 1, 0)
            text = "".join(lines[first: first + limit] if limit is not None else lines[first:])
        self._events.record("agent.fs", {"op": "read", "path": clip(path), "ok": True,
                                         "bytes": len(resp.content), "truncated": resp.truncated})
        return ReadTextFileResponse(content=text)

    async def write_text_file(self, session_id: str, path: str, content: str,
                              **kwargs: Any) -> WriteTextFileResponse:
        self._check_session(session_id)
        data = content.encode("utf-8", "surrogatepass") if isinstance(content, str) else b""
        try:
            self._check_kind("edit", "writing files")
            rel = workspace_relative(path)
            if len(data) > MAX_WRITE_BYTES:
                raise PermissionDenied(f"file content is larger than {MAX_WRITE_BYTES} bytes")
            async with self._calls, rpc_errors():
                await self._sandbox.WriteFile(sandbox_pb2.WriteFileRequest(
                    ticket_id=self._ticket, path=rel, content=data, create_parents=True))
        except AfeError as exc:
            self._events.record("agent.fs", {"op": "write", "path": clip(path), "ok": False,
                                             "error": clip(exc.message, 300)})
            raise _refusal(exc) from None
        self._events.record("agent.fs", {"op": "write", "path": clip(path), "ok": True, "bytes": len(data)})
        return WriteTextFileResponse()

    # -- terminals -----------------------------------------------------------------

    async def create_terminal(self, session_id: str, command: str, args: list[str] | None = None,
                              env: list[Any] | None = None, cwd: str | None = None,
                              output_byte_limit: int | None = None, **kwargs: Any) -> CreateTerminalResponse:
        self._check_session(session_id)
        shown = clip(" ".join([command, *(args or [])]), 300)
        try:
            self._check_kind("execute", "running commands")
            term = await self._terminals.create(command, args, env, cwd, output_byte_limit)
        except AfeError as exc:
            self._events.record("agent.terminal", {"op": "create", "command": shown, "ok": False,
                                                   "error": clip(exc.message, 300)})
            raise _refusal(exc) from None
        self._events.record("agent.terminal", {"op": "create", "terminal_id": term.id, "command": shown,
                                               "shell": not args, "cwd": clip(cwd or "/workspace"), "ok": True,
                                               "env": [clip(v.name, 64) for v in (env or [])]})
        return CreateTerminalResponse(terminal_id=term.id)

    def _term(self, session_id: str, terminal_id: str) -> Terminal:
        self._check_session(session_id)
        try:
            return self._terminals.get(terminal_id)
        except AfeError as exc:
            raise _refusal(exc) from None

    @staticmethod
    def _status(term: Terminal) -> TerminalExitStatus | None:
        st = term.exit_status()
        return TerminalExitStatus(**st) if st is not None else None

    async def terminal_output(self, session_id: str, terminal_id: str, **kwargs: Any) -> TerminalOutputResponse:
        term = self._term(session_id, terminal_id)
        return TerminalOutputResponse(output=term.text(), truncated=term.truncated,
                                      exit_status=self._status(term))

    async def wait_for_terminal_exit(self, session_id: str, terminal_id: str,
                                     **kwargs: Any) -> WaitForTerminalExitResponse:
        term = self._term(session_id, terminal_id)
        await term.done.wait()
        st = term.exit_status() or {}
        self._events.record("agent.terminal", {"op": "exit", "terminal_id": term.id,
                                               "exit_code": st.get("exit_code"), "signal": st.get("signal"),
                                               "output_bytes": len(term.output), "truncated": term.truncated})
        return WaitForTerminalExitResponse(**st)

    async def kill_terminal(self, session_id: str, terminal_id: str, **kwargs: Any) -> KillTerminalResponse:
        term = self._term(session_id, terminal_id)
        self._terminals.kill(term.id)
        self._events.record("agent.terminal", {"op": "kill", "terminal_id": term.id})
        return KillTerminalResponse()

    async def release_terminal(self, session_id: str, terminal_id: str,
                               **kwargs: Any) -> ReleaseTerminalResponse:
        term = self._term(session_id, terminal_id)
        self._terminals.release(term.id)
        self._events.record("agent.terminal", {"op": "release", "terminal_id": term.id})
        return ReleaseTerminalResponse()

    # -- everything else -------------------------------------------------------------

    async def ext_method(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self._events.record("agent.protocol_error", {"reason": f"unsupported method _{clip(method, 80)}"})
        raise RequestError.method_not_found(f"_{clip(method, 80)}")

    async def ext_notification(self, method: str, params: dict[str, Any]) -> None:
        return None
