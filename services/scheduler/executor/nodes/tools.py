"""The fixed, safe tool set a `model` node may use. Every tool runs through
the sandbox broker against the ticket's workspace: file tools on the host
with the broker's path checks (R17-R19), `run` inside the sandbox (R4).
The node's MCP tools (`mcp:SERVER/TOOL`, offered as `mcp__SERVER__TOOL`)
run through the credential broker (mcptools.py, R43).

A tool's failure (bad path, missing file, non-zero exit) is returned to the
model as text; it does not fail the node.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from services.common.errors import AfeError, InvalidArgument

from ...sandboxes.brokers import SandboxBroker

OUTPUT_CAP = 32 * 1024       # characters of a tool result handed back to the model
RUN_OUTPUT_CAP = 64 * 1024   # bytes of command output the broker keeps
RUN_TIMEOUT_S = 300


@dataclass(frozen=True)
class ToolDef:
    name: str
    description: str
    schema: dict[str, Any]


class ExtraTools(Protocol):
    """Tools a node has besides afe's own: its MCP tools (mcptools.py's NodeMcpTools)."""

    def specs(self) -> list[ToolDef]: ...
    def owns(self, name: str) -> bool: ...
    async def call(self, name: str, args: dict[str, Any]) -> tuple[str, bool]: ...


def _obj(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


TOOLS: dict[str, ToolDef] = {
    "read_file": ToolDef("read_file", "Read a text file of the workspace (path relative to its root).",
                         _obj({"path": {"type": "string"}}, ["path"])),
    "write_file": ToolDef("write_file", "Write (create or replace) a file of the workspace.",
                          _obj({"path": {"type": "string"}, "content": {"type": "string"}},
                               ["path", "content"])),
    "list_dir": ToolDef("list_dir", "List a directory of the workspace ('.' is the root).",
                        _obj({"path": {"type": "string"}}, [])),
    "search": ToolDef("search", "Search the workspace's files for a text (or a regex with regex=true).",
                      _obj({"pattern": {"type": "string"}, "path": {"type": "string"},
                            "regex": {"type": "boolean"}}, ["pattern"])),
    "run": ToolDef("run", "Run a shell command in the sandbox, in the workspace root. "
                   "Returns the exit code and the output.",
                   _obj({"command": {"type": "string"}, "timeout_s": {"type": "integer"}}, ["command"])),
}


def cap(text: str, limit: int = OUTPUT_CAP) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [{len(text) - limit} characters cut]"


def _str(args: dict[str, Any], key: str, default: str | None = None) -> str:
    v = args.get(key, default)
    if not isinstance(v, str):
        raise InvalidArgument(f"argument {key!r} must be a string")
    return v


def valid_text(text: str) -> str:
    """`text` with anything that is not valid UTF-8 (lone surrogates) replaced,
    so it can go into a protobuf string (the conversation sent to the model)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _not_utf8(args: dict[str, Any]) -> str | None:
    """The name of the first argument holding a string that is not valid UTF-8
    (a key included), or None. Iterative: the JSON is the model's."""
    stack: list[tuple[str, object]] = [(k, v) for k, v in args.items()]
    for key in args:
        if valid_text(key) != key:
            return valid_text(key)
    while stack:
        top, value = stack.pop()
        if isinstance(value, str):
            if valid_text(value) != value:
                return valid_text(top)
        elif isinstance(value, dict):
            for k, v in value.items():
                if valid_text(k) != k:
                    return valid_text(top)
                stack.append((top, v))
        elif isinstance(value, list):
            stack.extend((top, v) for v in value)
    return None


class Toolbox:
    """Executes tool calls for one ticket; `allowed` is the node's tool list."""

    def __init__(self, sandbox: SandboxBroker, ticket_id: str, allowed: tuple[str, ...],
                 on_output: Callable[[str, str], Awaitable[None]] | None = None,
                 mcp: ExtraTools | None = None) -> None:
        self.sandbox = sandbox
        self.ticket_id = ticket_id
        self.allowed = tuple(t for t in allowed if t in TOOLS)
        self.on_output = on_output
        self.mcp = mcp          # the node's MCP tools, loaded (mcptools.py)

    def specs(self) -> list[ToolDef]:
        return [TOOLS[t] for t in self.allowed] + (self.mcp.specs() if self.mcp is not None else [])

    async def call(self, name: str, arguments_json: str) -> tuple[str, bool]:
        """Run one call; returns (result text, ok)."""
        mcp = self.mcp if self.mcp is not None and self.mcp.owns(name) else None
        if name not in self.allowed and mcp is None:
            return f"error: tool {name!r} is not available to this node", False
        try:
            args = json.loads(arguments_json or "{}")
            if not isinstance(args, dict):
                raise InvalidArgument("arguments must be a JSON object")
        except (ValueError, InvalidArgument, RecursionError):
            return "error: the arguments are not a JSON object", False
        bad = _not_utf8(args)
        if bad is not None:
            # JSON may escape a lone surrogate ("\udc80"): such a string cannot cross
            # gRPC (protobuf strings are UTF-8) nor name a file. A tool error, not a failed node.
            return (f"error: argument {bad!r} is not valid UTF-8 text (it holds a lone surrogate "
                    "escape such as \\udc80); use only valid Unicode characters in tool arguments"), False
        if mcp is not None:
            return await mcp.call(name, args)
        try:
            return valid_text(await getattr(self, "_" + name)(args)), True
        except AfeError as exc:
            return valid_text(f"error: {exc.message}"), False

    async def _read_file(self, args: dict[str, Any]) -> str:
        r = await self.sandbox.read_file(self.ticket_id, _str(args, "path"), OUTPUT_CAP)
        text = r.content.decode("utf-8", errors="replace")
        return text + (f"\n... [file is {r.size} bytes; cut]" if r.truncated else "")

    async def _write_file(self, args: dict[str, Any]) -> str:
        size = await self.sandbox.write_file(self.ticket_id, _str(args, "path"),
                                             _str(args, "content").encode("utf-8"))
        return f"wrote {size} bytes to {args['path']}"

    async def _list_dir(self, args: dict[str, Any]) -> str:
        r = await self.sandbox.list_dir(self.ticket_id, _str(args, "path", "."))
        lines = []
        for e in r.entries:
            lines.append(e.name + "/" if e.type == 2 else f"{e.name} ({e.size} bytes)")
        if r.truncated:
            lines.append("... [listing cut]")
        return "\n".join(lines) or "(empty)"

    async def _search(self, args: dict[str, Any]) -> str:
        r = await self.sandbox.search(self.ticket_id, _str(args, "pattern"), _str(args, "path", ""),
                                      bool(args.get("regex", False)))
        lines = [f"{m.path}:{m.line}: {m.text}" for m in r.matches]
        if r.truncated:
            lines.append("... [more matches cut]")
        return cap("\n".join(lines) or "no matches")

    async def _run(self, args: dict[str, Any]) -> str:
        command = _str(args, "command")
        timeout = args.get("timeout_s", RUN_TIMEOUT_S)
        if not isinstance(timeout, int) or timeout <= 0:
            timeout = RUN_TIMEOUT_S
        timeout = min(timeout, RUN_TIMEOUT_S)
        chunks: list[str] = []
        code, timed_out = -1, False
        async for ev in self.sandbox.exec(self.ticket_id, ["bash", "-lc", command],
                                          timeout_ms=timeout * 1000, output_cap_bytes=RUN_OUTPUT_CAP):
            which = ev.WhichOneof("event")
            if which in ("stdout", "stderr"):
                text = getattr(ev, which).decode("utf-8", errors="replace")
                chunks.append(text)
                if self.on_output:
                    await self.on_output(which, text)
            elif which == "exit":
                code, timed_out = ev.exit.code, ev.exit.timed_out
        head = f"exit code {code}" + (" (timed out)" if timed_out else "")
        return cap(head + "\n" + "".join(chunks))
