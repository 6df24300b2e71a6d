"""A small "coding agent" for the end-to-end workflow on the demo repository:
reads calc.py, fixes add(), runs the tests in a terminal, reports."""

from __future__ import annotations

import asyncio
from typing import Any

from _base import BaseAgent
from acp import run_agent, start_tool_call, update_agent_message_text, update_tool_call
from acp.schema import PermissionOption, PromptResponse, ToolCallUpdate


class FixerAgent(BaseAgent):
    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any) -> PromptResponse:
        c, sid = self.conn, session_id
        src = (await c.read_text_file(sid, "/workspace/calc.py")).content
        await c.session_update(sid, start_tool_call("edit", "Fix add() in calc.py", kind="edit"))
        await c.request_permission(sid, ToolCallUpdate(tool_call_id="edit", kind="edit", title="Edit calc.py"),
                                   [PermissionOption(option_id="ok", name="Allow", kind="allow_once")])
        await c.write_text_file(sid, "/workspace/calc.py", src.replace("return a - b", "return a + b"))
        await c.session_update(sid, update_tool_call("edit", status="completed"))
        term = await c.create_terminal(sid, "python3", ["-m", "unittest", "-q"], cwd="/workspace")
        ex = await c.wait_for_terminal_exit(sid, term.terminal_id)
        await c.release_terminal(sid, term.terminal_id)
        await c.session_update(sid, update_agent_message_text(
            f"Fixed add() in calc.py; unittest exit code {ex.exit_code}."))
        return PromptResponse(stop_reason="end_turn")


if __name__ == "__main__":
    asyncio.run(run_agent(FixerAgent()))
