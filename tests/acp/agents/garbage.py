"""Answers initialize and session/new, then writes lines that are not
JSON-RPC instead of answering the prompt: text, an array, an object with
a bad id, a message without jsonrpc."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from _base import BaseAgent
from acp import run_agent

LINES = [
    b"this is not json\n",
    b"[1, 2, 3]\n",
    b'{"jsonrpc":"2.0","id":{"evil":1},"result":{}}\n',
    b'{"id":1,"result":{}}\n',
    b"\x00\xff\xfe garbage\n",
]


class GarbageAgent(BaseAgent):
    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any):
        os.set_blocking(1, True)
        out = sys.stdout.buffer
        for _ in range(3):
            for line in LINES:
                out.write(line)
        out.flush()
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(run_agent(GarbageAgent()))
