"""Streams an update, then dies in the middle of the prompt (exit code 3)."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from _base import BaseAgent
from acp import run_agent, update_agent_message_text


class CrashAgent(BaseAgent):
    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any):
        await self.conn.session_update(session_id, update_agent_message_text("about to crash"))
        await asyncio.sleep(0.2)
        sys.stderr.write("crash agent: giving up\n")
        sys.stderr.flush()
        os._exit(3)


if __name__ == "__main__":
    asyncio.run(run_agent(CrashAgent()))
