"""Speaks ACP the way Claude Code (`@zed-industries/claude-code-acp`) does
where it differs from `good`:

- `terminal/create` with the whole command line in `command` and no `args`
  (a shell line with a pipe and `&&`), next to an argv call whose argument
  holds the same characters (not interpreted: no shell);
- `session/request_permission` without a kind: the kind came earlier, in the
  `tool_call` (or `tool_call_update`) update with the same `toolCallId`.

Prompt `die` instead: writes a few lines on stderr, one holding the value
of ACP_TEST_KEY (an agent printing its key in an error), and exits 1.
The results go into the final message as `REPORT {json}`.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from _base import BaseAgent, prompt_text
from acp import RequestError, run_agent, start_tool_call, update_agent_message_text, update_tool_call
from acp.schema import PermissionOption, PromptResponse, ToolCallUpdate

OPTIONS = [PermissionOption(option_id="allow", name="Allow", kind="allow_once"),
           PermissionOption(option_id="reject", name="Reject", kind="reject_once")]
SHELL_LINE = "printf 'b\\na\\n' | sort && echo \"shell=$0 uid=$(id -u)\" && echo ran > shell.txt"


class ClaudeLikeAgent(BaseAgent):
    async def _terminal(self, sid: str, command: str, args: list[str] | None = None) -> dict:
        c = self.conn
        try:
            term = await c.create_terminal(sid, command, args, cwd="/workspace")
            ex = await c.wait_for_terminal_exit(sid, term.terminal_id)
            out = await c.terminal_output(sid, term.terminal_id)
            await c.release_terminal(sid, term.terminal_id)
            return {"ok": True, "exit_code": ex.exit_code, "output": out.output}
        except RequestError as exc:
            return {"ok": False, "code": exc.code, "message": str(exc)}

    async def _ask(self, sid: str, tool_call_id: str, kind: str | None = None) -> str:
        perm = await self.conn.request_permission(
            sid, ToolCallUpdate(tool_call_id=tool_call_id, kind=kind), OPTIONS)
        return getattr(perm.outcome, "option_id", None) or perm.outcome.outcome

    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any) -> PromptResponse:
        c, sid = self.conn, session_id
        if prompt_text(prompt).strip() == "die":
            sys.stderr.write("claude-like: starting\n")
            sys.stderr.write(f"Error: 401 invalid x-api-key: {os.environ.get('ACP_TEST_KEY', '')}\n")
            sys.stderr.write("claude-like: giving up\n")
            sys.stderr.flush()
            os._exit(1)
        report: dict[str, Any] = {}
        # Claude Code's Bash tool: the whole line in `command`, no `args`.
        await c.session_update(sid, start_tool_call("b1", "Run tests", kind="execute", status="in_progress"))
        report["shell_line"] = await self._terminal(sid, SHELL_LINE)
        report["shell_line_empty_args"] = await self._terminal(sid, "echo a && echo b", [])
        # With args it stays an argv: the same characters are not interpreted.
        report["argv"] = await self._terminal(sid, "printf", ["%s\\n", "a | sort && echo b"])
        await c.session_update(sid, update_tool_call("b1", status="completed"))

        # Permissions that name only the tool call id.
        await c.session_update(sid, start_tool_call("f1", "Fetch https://example.com", kind="fetch"))
        report["fetch_announced"] = await self._ask(sid, "f1")
        report["never_announced"] = await self._ask(sid, "u1")
        await c.session_update(sid, start_tool_call("c1", "Look something up", kind="other"))
        await c.session_update(sid, update_tool_call("c1", kind="fetch"))
        report["kind_from_update"] = await self._ask(sid, "c1")
        await c.session_update(sid, start_tool_call("k1", "Fetch, then edit", kind="fetch"))
        report["kind_in_request_wins"] = await self._ask(sid, "k1", kind="edit")

        await c.session_update(sid, update_agent_message_text("REPORT " + json.dumps(report)))
        return PromptResponse(stop_reason="end_turn")


if __name__ == "__main__":
    asyncio.run(run_agent(ClaudeLikeAgent()))
