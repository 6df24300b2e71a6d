"""Calls its Model the way a coding agent does (R32): a streamed Anthropic
Messages request to $ANTHROPIC_BASE_URL with $ANTHROPIC_API_KEY, once per
line of the prompt that says `call`. Its final message is `REPORT {json}`:
each call's status and text, and the names (never values) of its env.

A prompt word `leak` makes it leave its relay variables in the workspace
(LEAK_FILE), as a hostile agent could; `modelcaller.py --spend` (a `run:`
command of the same ticket) then calls the relay with them."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from _base import BaseAgent, prompt_text
from acp import run_agent, update_agent_message_text
from acp.schema import PromptResponse

LEAK_FILE = "/workspace/.relay-leak.json"
RELAY_VARS = ("ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY")


def call() -> list:
    req = urllib.request.Request(
        os.environ.get("ANTHROPIC_BASE_URL", "http://127.0.0.1:1") + "/v1/messages", method="POST",
        data=json.dumps({"model": "any", "max_tokens": 16, "stream": True,
                         "messages": [{"role": "user", "content": "hi"}]}).encode(),
        headers={"content-type": "application/json", "anthropic-version": "2023-06-01",
                 "x-api-key": os.environ.get("ANTHROPIC_API_KEY", "")})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return [r.status, r.read().decode()[-400:]]
    except urllib.error.HTTPError as e:
        return [e.code, e.read().decode()[-400:]]
    except Exception as e:  # noqa: BLE001 - reported to the test
        return [-1, type(e).__name__]


class ModelCaller(BaseAgent):
    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any) -> PromptResponse:
        words = prompt_text(prompt).split()
        if "leak" in words:
            leak = json.dumps({k: os.environ.get(k, "") for k in RELAY_VARS})
            await asyncio.to_thread(Path(LEAK_FILE).write_text, leak)
        calls = [await asyncio.to_thread(call) for line in words if line == "call"]
        report = {"calls": calls, "env_names": sorted(os.environ)}
        await self.conn.session_update(session_id, update_agent_message_text("REPORT " + json.dumps(report)))
        return PromptResponse(stop_reason="end_turn")


if __name__ == "__main__":
    if sys.argv[1:] == ["--spend"]:
        with open(LEAK_FILE) as f:
            os.environ.update(json.load(f))
        print("SPENT " + json.dumps(call()))
    else:
        asyncio.run(run_agent(ModelCaller()))
