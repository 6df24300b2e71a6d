"""Asks for a 1 MiB file 50 times, then stops reading its stdin for good
(the whole agent blocks): the answers pile up on the engine's side."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from _base import BaseAgent
from acp import run_agent


class DeafAgent(BaseAgent):
    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any):
        Path("/workspace/big.txt").write_text("x" * (1024 * 1024))
        os.set_blocking(1, True)
        out = sys.stdout.buffer
        for i in range(50):
            out.write(json.dumps({"jsonrpc": "2.0", "id": f"r{i}", "method": "fs/read_text_file",
                                  "params": {"sessionId": session_id, "path": "/workspace/big.txt"}}).encode()
                      + b"\n")
        out.flush()
        time.sleep(3600)  # noqa: ASYNC251 - blocking on purpose: nothing reads stdin any more


if __name__ == "__main__":
    asyncio.run(run_agent(DeafAgent()))
