"""Starts a long command in a terminal, then fires 200 concurrent
terminal/wait_for_exit requests at it: more requests in flight than the
engine holds for one agent."""

from __future__ import annotations

import asyncio
from typing import Any

from _base import BaseAgent
from acp import run_agent


class SwarmAgent(BaseAgent):
    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any):
        c, sid = self.conn, session_id
        term = await c.create_terminal(sid, "sleep", ["600"], cwd="/workspace")
        await asyncio.gather(*(c.wait_for_terminal_exit(sid, term.terminal_id) for _ in range(200)),
                             return_exceptions=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(run_agent(SwarmAgent()))
