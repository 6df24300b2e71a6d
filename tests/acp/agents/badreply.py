"""Answers session/prompt with a result that does not follow the ACP schema."""

from __future__ import annotations

import asyncio
from typing import Any

from _base import BaseAgent
from acp import run_agent


class BadReplyAgent(BaseAgent):
    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any):
        return {"stopReason": "because I said so"}


if __name__ == "__main__":
    asyncio.run(run_agent(BadReplyAgent()))
