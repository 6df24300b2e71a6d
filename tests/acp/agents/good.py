"""A well-behaved agent that exercises everything the engine serves.

On session/prompt it streams a thought, a plan and message chunks; asks a
permission before writing; writes /workspace/hello.txt and reads it back;
runs a command through terminal/*; makes symlinks from inside the sandbox
and then tries /etc/passwd, /workspace/../x and the symlinks; calls an
unknown method. Each result goes into its final message as
`REPORT {json}` so the tests can check what the agent saw.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from typing import Any

from _base import BaseAgent, prompt_text
from acp import (
    RequestError,
    plan_entry,
    run_agent,
    start_tool_call,
    update_agent_message_text,
    update_agent_thought_text,
    update_plan,
    update_tool_call,
)
from acp.schema import PermissionOption, PromptResponse, ToolCallUpdate


def _err(exc: BaseException) -> dict:
    if isinstance(exc, RequestError):
        return {"ok": False, "code": exc.code, "message": str(exc)}
    return {"ok": False, "code": None, "message": f"{type(exc).__name__}: {exc}"}


class GoodAgent(BaseAgent):
    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any) -> PromptResponse:
        c, sid = self.conn, session_id
        caps = self.client_capabilities
        report: dict[str, Any] = {
            "cwd": self.cwd,
            # Which variables reached the agent (names only; a value as a hash).
            "env_names": sorted(os.environ),
            "key_sha256": hashlib.sha256(os.environ["ACP_TEST_KEY"].encode()).hexdigest()
            if "ACP_TEST_KEY" in os.environ else None,
            "caps": {"read": bool(caps and caps.fs and caps.fs.read_text_file),
                     "write": bool(caps and caps.fs and caps.fs.write_text_file),
                     "terminal": bool(caps and caps.terminal)},
        }
        text = prompt_text(prompt)
        if text.startswith("refuse:"):
            await c.session_update(sid, update_agent_message_text("I will not do that."))
            return PromptResponse(stop_reason="refusal")
        await c.session_update(sid, update_agent_thought_text("reading the task"))
        await c.session_update(sid, update_plan([
            plan_entry("write hello.txt", priority="high", status="in_progress"),
            plan_entry("run a command", priority="medium", status="pending")]))
        await c.session_update(sid, update_agent_message_text("Working "))
        await c.session_update(sid, update_agent_message_text("on it."))

        # Permission, then a write through fs/write_text_file.
        await c.session_update(sid, start_tool_call("t1", "Write hello.txt", kind="edit", status="pending"))
        perm = await c.request_permission(
            sid, ToolCallUpdate(tool_call_id="t1", kind="edit", title="Write hello.txt"),
            [PermissionOption(option_id="yes", name="Allow", kind="allow_once"),
             PermissionOption(option_id="no", name="Reject", kind="reject_once")])
        outcome = perm.outcome
        report["permission"] = getattr(outcome, "option_id", None) or outcome.outcome
        content = f"hello from the agent: {text}\n"
        try:
            await c.write_text_file(sid, "/workspace/hello.txt", content)
            report["write"] = {"ok": True}
        except Exception as exc:  # noqa: BLE001 - report whatever the client answered
            report["write"] = _err(exc)
        await c.session_update(sid, update_tool_call("t1", status="completed"))
        try:
            got = await c.read_text_file(sid, "/workspace/hello.txt")
            report["read"] = {"ok": True, "same": got.content == content}
        except Exception as exc:  # noqa: BLE001 - report whatever the client answered
            report["read"] = _err(exc)

        # A command in the sandbox, through terminal/*.
        await c.session_update(sid, start_tool_call("t2", "Run a command", kind="execute", status="in_progress"))
        try:
            term = await c.create_terminal(
                sid, "bash", ["-c", ("cat hello.txt; id -u; echo key=${ACP_TEST_KEY:+set}; "
                                     "ln -s /etc/passwd link; ln -s hello.txt inlink; exit 7")],
                cwd="/workspace")
            ex = await c.wait_for_terminal_exit(sid, term.terminal_id)
            out = await c.terminal_output(sid, term.terminal_id)
            await c.release_terminal(sid, term.terminal_id)
            report["terminal"] = {"ok": True, "exit_code": ex.exit_code, "output": out.output}
        except Exception as exc:  # noqa: BLE001 - report whatever the client answered
            report["terminal"] = _err(exc)
        await c.session_update(sid, update_tool_call("t2", status="completed"))

        # Attacks: each must be refused.
        attacks = {}
        for name, path in (("etc_passwd", "/etc/passwd"), ("dotdot", "/workspace/../x"),
                           ("symlink_out", "/workspace/link"), ("symlink_in", "/workspace/inlink"),
                           ("relative", "hello.txt")):
            try:
                got = await c.read_text_file(sid, path)
                attacks[name] = {"ok": True, "content": got.content[:200]}
            except Exception as exc:  # noqa: BLE001 - report whatever the client answered
                attacks[name] = _err(exc)
        try:
            await c.write_text_file(sid, "/workspace/inlink", "overwritten through a symlink\n")
            attacks["write_symlink"] = {"ok": True}
        except Exception as exc:  # noqa: BLE001 - report whatever the client answered
            attacks["write_symlink"] = _err(exc)
        try:
            await c.write_text_file(sid, "/workspace/../escape.txt", "escaped\n")
            attacks["write_dotdot"] = {"ok": True}
        except Exception as exc:  # noqa: BLE001 - report whatever the client answered
            attacks["write_dotdot"] = _err(exc)
        report["attacks"] = attacks

        # A method the client does not serve.
        try:
            await c._conn.send_request("evil/method", {"x": 1})
            report["unknown_method"] = {"ok": True}
        except Exception as exc:  # noqa: BLE001 - report whatever the client answered
            report["unknown_method"] = _err(exc)

        await c.session_update(sid, update_plan([
            plan_entry("write hello.txt", priority="high", status="completed"),
            plan_entry("run a command", priority="medium", status="completed")]))
        await c.session_update(sid, update_agent_message_text("Done. "))
        await c.session_update(sid, update_agent_message_text("REPORT " + json.dumps(report)))
        return PromptResponse(stop_reason="end_turn")


if __name__ == "__main__":
    asyncio.run(run_agent(GoodAgent()))
