"""Shared bits of the test agents (runs inside the sandbox, in /opt/acp)."""

from __future__ import annotations

from typing import Any

from acp import PROTOCOL_VERSION
from acp.schema import InitializeResponse, NewSessionResponse


class BaseAgent:
    """Answers initialize and session/new; subclasses implement prompt()."""

    session_id = "sess-1"

    def on_connect(self, conn: Any) -> None:
        self.conn = conn

    async def initialize(self, protocol_version: int, client_capabilities: Any = None,
                         client_info: Any = None, **kwargs: Any) -> InitializeResponse:
        self.client_capabilities = client_capabilities
        return InitializeResponse(protocol_version=PROTOCOL_VERSION)

    async def new_session(self, cwd: str, mcp_servers: Any = None, **kwargs: Any) -> NewSessionResponse:
        self.cwd = cwd
        return NewSessionResponse(session_id=self.session_id)

    async def cancel(self, session_id: str, **kwargs: Any) -> None:
        return None


def prompt_text(prompt: list[Any]) -> str:
    return "".join(getattr(b, "text", "") for b in prompt)
