"""Floods: many tool-call updates (more than the event limit), megabytes on
stderr, then one JSON-RPC line far larger than the message cap."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from _base import BaseAgent
from acp import run_agent, start_tool_call


class FloodAgent(BaseAgent):
    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any):
        for i in range(1500):
            await self.conn.session_update(session_id, start_tool_call(f"f{i}", f"flood {i}", kind="other"))
        chunk = "E" * 65536 + "\n"
        for _ in range(64):                       # 4 MiB of stderr
            sys.stderr.write(chunk)
        sys.stderr.flush()
        os.set_blocking(1, True)                  # the SDK made stdout non-blocking
        out = sys.stdout.buffer
        out.write(b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"sess-1","x":"')
        block = b"A" * (1024 * 1024)
        for _ in range(64):                       # 64 MiB, no newline
            out.write(block)
            out.flush()
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(run_agent(FloodAgent()))
