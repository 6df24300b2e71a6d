"""Answers initialize and session/new, then never answers the prompt.

When session/cancel arrives it writes /workspace/.cancel-received (so the
test can see the engine cancelled before killing) and keeps hanging.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from _base import BaseAgent
from acp import run_agent, update_agent_message_text


class SilentAgent(BaseAgent):
    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any):
        await self.conn.session_update(session_id, update_agent_message_text("thinking forever"))
        await asyncio.Event().wait()

    async def cancel(self, session_id: str, **kwargs: Any) -> None:
        Path("/workspace/.cancel-received").write_text(session_id)


if __name__ == "__main__":
    asyncio.run(run_agent(SilentAgent()))
