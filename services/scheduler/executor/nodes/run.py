"""A `run` node: one shell command in the ticket's sandbox; its output
streams out as `node.output` events. Template values reach the command as
positional parameters, never as shell code (R36, templates.render_command).
A non-zero exit fails the node with the output's tail (and, when the disk cap
was hit, which limit, R34). What the ticket's model relay counted while it
ran is the ticket's (R32: a command that reaches the relay is counted too)."""

from __future__ import annotations

import asyncio

from services.common.config.model import Node, Workspace
from services.common.errors import DeadlineExceeded, FailedPrecondition

from ..context import RunContext

RUN_OUTPUT_CAP = 4 * 1024 * 1024  # bytes of a run node's output the broker streams
CHUNK_EVENT = 8 * 1024            # characters per node.output event


class CommandFailed(FailedPrecondition):
    """A `run` command exited non-zero; `output` is all it printed (kept as the
    node's output, so a failed test's output outlives the ticket)."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


async def run_node(ctx: RunContext, node: Node) -> str:
    await ctx.ensure_sandbox()
    try:
        return await _run(ctx, node)
    finally:   # model calls through the relay from the command are the ticket's too (R32)
        await asyncio.shield(ctx.settle_relay(node))


async def _run(ctx: RunContext, node: Node) -> str:
    script, args = ctx.render_command(node.run or "", node.id)
    out: list[str] = []
    code, timed_out, truncated = -1, False, False
    attempt = ctx.attempts.get(node.id, 0)    # each line says which attempt printed it
    async for ev in ctx.sandbox.exec(ctx.ticket.id, command_argv(script, args),
                                     timeout_ms=int(node.timeout_s * 1000), output_cap_bytes=RUN_OUTPUT_CAP):
        which = ev.WhichOneof("event")
        if which in ("stdout", "stderr"):
            text = getattr(ev, which).decode("utf-8", errors="replace")
            out.append(text)
            for i in range(0, len(text), CHUNK_EVENT):
                ctx.emit("node.output", {"node": node.id, "attempt": attempt, "stream": which,
                                         "text": text[i:i + CHUNK_EVENT]})
        elif which == "exit":
            code, timed_out, truncated = ev.exit.code, ev.exit.timed_out, ev.exit.truncated
    text = "".join(out)
    if truncated:
        text += "\n[output cut]"
    if timed_out:
        raise DeadlineExceeded(f"the command timed out after {node.timeout_s:g}s")
    if code != 0:
        tail = text[-2000:].strip()
        raise CommandFailed(f"the command exited with code {code}" + (f":\n{tail}" if tail else "")
                            + disk_full_hint(ctx.workspace, text), output=text)
    return text


def command_argv(script: str, args: list[str]) -> list[str]:
    """`bash -c SCRIPT afe ARG...`: the template values are $1, $2, ... (R36).

    Not a login shell (`-l`): the command gets the sandbox's own environment
    (the image's `ENV`, PATH included) and bash reads no profile; a login
    shell ran `/etc/profile` (an `id -u` fork and `/etc/profile.d/*`) before
    every command, about a millisecond each, and replaced the image's PATH."""
    return ["bash", "-c", script, "afe", *args]


def disk_full_hint(workspace: Workspace, output: str) -> str:
    """R34: a command that hit the workspace's disk cap says which limit it hit."""
    if "No space left on device" not in output:
        return ""
    cap = workspace.sandbox.limits.disk_bytes
    size = next((f"{cap // u}{n}" for n, u in (("g", 1024 ** 3), ("m", 1024 ** 2)) if cap % u == 0), str(cap))
    return (f"\nthe sandbox ran out of disk space: the workspace holds at most {size} "
            f"(sandbox.limits.disk of workspace {workspace.name!r}; /tmp holds 256m); "
            "write less or raise sandbox.limits.disk")
