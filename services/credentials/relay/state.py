"""The relay's per-ticket state (R32, R43): capability, declared models,
budget and usage, the MCP servers and tools granted and the MCP calls made
(the latest `MCP_CALLS_KEPT`), kept as one file per ticket in the broker's
private folder so a restarted broker serves the same capability, budget and
grants, and the scheduler still reads every call it has not yet recorded."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from services.common.layout import check_ticket_id
from services.credentials.relay.limits import TicketLoad
from services.credentials.relay.usage import Usage

log = logging.getLogger(__name__)

MCP_CALLS_KEPT = 1000       # MCP calls a ticket's relay remembers until the scheduler has read them

# One MCP call as the relay records it: RelayMcpCall's fields and its `seq`, a JSON line on disk.
McpCall = dict[str, Any]


@dataclass
class TicketRelay:
    ticket_id: str
    capability: str
    models: tuple[str, ...]
    budget: int
    usage: dict[str, Usage] = field(default_factory=dict)
    closed: bool = False
    runner: web.AppRunner | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    load: TicketLoad = field(default_factory=TicketLoad)   # connections and body bytes held now
    mcp: dict[str, tuple[str, ...]] = field(default_factory=dict)   # MCP server -> the tools granted (R43)
    mcp_calls: list[McpCall] = field(default_factory=list)   # the latest MCP calls (RelayMcpCall fields)
    mcp_seq: int = 0                                       # MCP calls so far (the last one's seq)

    @property
    def used(self) -> int:
        return sum(u.total for u in self.usage.values())

    def state(self) -> dict[str, Any]:
        return {"capability": self.capability, "models": list(self.models), "budget": self.budget,
                "usage": {k: [u.input_tokens, u.output_tokens, u.requests, u.refused]
                          for k, u in self.usage.items()},
                "mcp": {k: list(v) for k, v in self.mcp.items()}}

    def add_mcp_call(self, call: McpCall) -> McpCall:
        """Number `call` and keep it (the oldest are forgotten past MCP_CALLS_KEPT)."""
        self.mcp_seq += 1
        call = {**call, "seq": self.mcp_seq}
        self.mcp_calls.append(call)
        del self.mcp_calls[:-MCP_CALLS_KEPT]
        return call


class RelayStates:
    """The state files, `<state_dir>/<ticket>.json` (0600, written atomically), and each
    ticket's MCP calls, `<state_dir>/<ticket>.mcp.jsonl` (0600, one line appended per call, so
    recording a call costs one small write; rewritten with the latest calls when it grows)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._calls_paths: dict[str, Path] = {}

    def path(self, ticket_id: str) -> Path:
        return self.state_dir / f"{check_ticket_id(ticket_id)}.json"

    def calls_path(self, ticket_id: str) -> Path:
        got = self._calls_paths.get(ticket_id)
        if got is None:
            if len(self._calls_paths) > 4096:
                self._calls_paths.clear()
            got = self._calls_paths[ticket_id] = self.state_dir / f"{check_ticket_id(ticket_id)}.mcp.jsonl"
        return got

    def append_call(self, t: TicketRelay, call: McpCall) -> None:
        path = self.calls_path(t.ticket_id)
        if t.mcp_seq % (2 * MCP_CALLS_KEPT) == 0:        # compact: only the calls still kept
            self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.writelines(json.dumps(c) + "\n" for c in t.mcp_calls)
            os.replace(tmp, path)
            return
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags, 0o600)
        except FileNotFoundError:       # the folder is made on the first save, not looked for on each call
            self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, flags, 0o600)
        try:
            os.write(fd, (json.dumps(call) + "\n").encode())
        finally:
            os.close(fd)

    def _calls(self, ticket_id: str) -> list[McpCall]:
        try:
            lines = self.calls_path(ticket_id).read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines[-MCP_CALLS_KEPT:]:
            try:
                c = json.loads(line)
            except ValueError:       # a line cut by a crash
                continue
            if isinstance(c, dict) and isinstance(c.get("seq"), int):
                out.append(c)
        return out

    def save(self, t: TicketRelay) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.path(t.ticket_id)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(t.state(), f)
        os.replace(tmp, path)

    def load(self, ticket_id: str) -> TicketRelay | None:
        try:
            doc = json.loads(self.path(ticket_id).read_text())
            usage = {k: Usage(*[int(x) for x in v]) for k, v in doc.get("usage", {}).items()}
            mcp = {str(k): tuple(str(x) for x in v) for k, v in (doc.get("mcp") or {}).items()}
            calls = self._calls(ticket_id)
            return TicketRelay(ticket_id, str(doc["capability"]), tuple(doc["models"]), int(doc["budget"]), usage,
                               mcp=mcp, mcp_calls=calls, mcp_seq=max((c["seq"] for c in calls), default=0))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("relay state of ticket %s is unreadable; a new capability is made", ticket_id)
            return None
