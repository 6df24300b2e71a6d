"""Clean-room verification of a head before its approval is asked (R41).

A Workflow's `verify:` commands run on the head a person is asked to approve,
never in the ticket's own sandbox or workspace:

- the credential broker checks that commit out into a NEW folder
  `<data>/workspaces/<ticket>-verify`, each of `base_paths` taken from the
  base branch's tip (PrepareVerification, services/credentials/verifycheckout.py);
- the sandbox broker makes a NEW sandbox for the id `<ticket>-verify` (any
  old one removed first): the workspace's image (never an agent's), limits,
  runtime and declared egress, no model relay, no environment variable;
- the commands run in order, each templated like a `run:` node (values as
  $1.., R36), until the first one that fails; their output streams out as
  `verification.output` events;
- the sandbox and the checkout are removed, also on an error or a cancel.

The result (the `verification.finished` payload) is stored per (ticket,
head): a resumed ticket gets it back and runs nothing again. `check_mergeable`
refuses to merge a head whose stored verification is missing or failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services.common.config import Node, Verify, Workspace
from services.common.errors import AfeError, FailedPrecondition, NotFound
from services.common.layout import verify_id
from services.common.verification import failure_line

from ...events.log import now_ms
from ...store.base import PullRequestRecord
from .. import brokercalls
from ..context import RunContext
from .run import CHUNK_EVENT, command_argv

log = logging.getLogger(__name__)

OUTPUT_CAP = 1024 * 1024          # bytes of one command's output the broker streams
TAIL_CHARS = 2000                 # of a failed command's output, kept in the result


class VerificationFailed(FailedPrecondition):
    """`builtin:merge` of a head whose verification did not pass: not retried."""


def verify_spec(workspace: Workspace) -> spb.SandboxSpec:
    """The verification sandbox: the workspace's own settings only — its image
    (never an agent's), limits, runtime and declared egress; no relay, no env names."""
    sb = workspace.sandbox
    return spb.SandboxSpec(
        image=sb.image,
        limits=spb.Limits(cpus=sb.limits.cpus, memory_bytes=sb.limits.memory_bytes, pids=sb.limits.pids,
                          disk_bytes=sb.limits.disk_bytes),
        egress=list(sb.egress), egress_private=list(sb.egress_private), env_names=[], relay=False,
        runtime=sb.runtime if sb.runtime != "runc" else "")


async def verify_head(ctx: RunContext, node: Node, sha: str, pr: PullRequestRecord | None) -> dict[str, Any] | None:
    """The verification of `sha` (run once per ticket and head), or None when the workflow declares none."""
    verify = ctx.workflow.verify
    if verify is None:
        return None
    if not sha:
        raise FailedPrecondition(f"workflow {ctx.workflow.name!r} declares verify:, which runs on the pull "
                                 f"request's head: put builtin:open_pr in the `needs` of {node.id!r}")
    rec = ctx.store.verification(ctx.ticket.id, sha)
    if rec is None:
        result = await _run(ctx, node, sha, verify)
        rec = ctx.store.put_verification(ctx.ticket.id, sha, bool(result["passed"]), result, now_ms())
        ctx.emit("verification.finished", rec.result)
    return summary(rec.result)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """What the `approval.requested` event carries of a verification."""
    return {"passed": bool(result.get("passed")), "sha": result.get("sha", ""),
            "base_paths": list(result.get("base_paths") or []), "base_sha": result.get("base_sha", ""),
            "base_branch": result.get("base_branch", ""), "error": result.get("error", ""),
            "commands": [{k: c.get(k) for k in ("command", "exit_code", "timed_out", "duration_ms")}
                         for c in result.get("commands") or []]}


async def _run(ctx: RunContext, node: Node, sha: str, verify: Verify) -> dict[str, Any]:
    tid, ws = ctx.ticket.id, ctx.workspace
    vid = verify_id(tid)
    base_paths = list(verify.base_paths)
    rendered = [(template, ctx.render_command(template, node.id)) for template in verify.run]
    ctx.emit("verification.started", {"node": node.id, "sha": sha, "base_paths": base_paths,
                                      "commands": list(verify.run)})
    result: dict[str, Any] = {"node": node.id, "sha": sha, "passed": False, "base_paths": base_paths,
                              "base_sha": "", "base_branch": ws.base_branch, "commands": [], "error": ""}
    try:
        await _destroy(ctx, vid)           # a leftover of a crashed run: never reused
        ctx.host.check_lease(tid)
        prep = await ctx.step(node, "verify_checkout", lambda: ctx.credentials.prepare_verification(
            tid, ws.name, sha, base_paths))
        result["base_sha"] = prep.base_sha if base_paths else ""
        ctx.host.check_lease(tid)
        await brokercalls.retry_unavailable(ctx.host.broker_retry_s, "creating the verification sandbox",
                                            lambda: ctx.sandbox.create(vid, verify_spec(ws)))
        for template, (script, args) in rendered:
            entry = await _command(ctx, node, vid, template, script, args, verify.timeout_s)
            result["commands"].append(entry)
            if entry["exit_code"] != 0 or entry["timed_out"]:
                break
        result["passed"] = bool(result["commands"]) and len(result["commands"]) == len(rendered) and all(
            c["exit_code"] == 0 and not c["timed_out"] for c in result["commands"])
    finally:
        await asyncio.shield(_cleanup(ctx, vid))
    return result


async def _command(ctx: RunContext, node: Node, vid: str, template: str, script: str, args: list[str],
                   timeout_s: float) -> dict[str, Any]:
    started = time.monotonic()
    code, timed_out, truncated = -1, False, False
    tail = ""
    async for ev in ctx.sandbox.exec(vid, command_argv(script, args), timeout_ms=int(timeout_s * 1000),
                                     output_cap_bytes=OUTPUT_CAP):
        which = ev.WhichOneof("event")
        if which in ("stdout", "stderr"):
            text = getattr(ev, which).decode("utf-8", errors="replace")
            tail = (tail + text)[-TAIL_CHARS:]
            for i in range(0, len(text), CHUNK_EVENT):
                ctx.emit("verification.output", {"node": node.id, "command": template, "stream": which,
                                                 "text": text[i:i + CHUNK_EVENT]})
        elif which == "exit":
            code, timed_out, truncated = ev.exit.code, ev.exit.timed_out, ev.exit.truncated
    return {"command": template, "exit_code": code, "timed_out": timed_out, "truncated": truncated,
            "duration_ms": int((time.monotonic() - started) * 1000)}


async def _destroy(ctx: RunContext, vid: str) -> None:
    with contextlib.suppress(NotFound):
        await ctx.sandbox.destroy(vid)


async def _cleanup(ctx: RunContext, vid: str) -> None:
    """The verification sandbox, then its checkout (a disk-capped folder is the sandbox broker's to unmount)."""
    try:
        await _destroy(ctx, vid)
    except AfeError as exc:
        log.warning("ticket %s: could not remove the verification sandbox (teardown retries): %s",
                    ctx.ticket.id, exc.message)
    try:
        await ctx.credentials.release_verification(ctx.ticket.id, ctx.workspace.name)
    except AfeError as exc:
        log.warning("ticket %s: could not remove the verification checkout (teardown retries): %s",
                    ctx.ticket.id, exc.message)


def check_mergeable(ctx: RunContext, node: Node, sha: str) -> None:
    """Raise unless `sha` may be merged: its verification passed (when the workflow declares one)."""
    if ctx.workflow.verify is None:
        return
    rec = ctx.store.verification(ctx.ticket.id, sha)
    if rec is None:
        raise VerificationFailed(f"builtin:merge refused: head {sha[:12]} has no verification (verify: of "
                                 f"workflow {ctx.workflow.name!r}); send a follow-up so afe verifies a new head, "
                                 "or reject the change")
    if not rec.passed:
        raise VerificationFailed(f"builtin:merge refused: {failure_line(rec.result)} on head {sha[:12]}; send a "
                                 "follow-up to fix the code (not the tests), or reject the change")
