"""Clean-room verification of a head before its approval is asked (R41).

A Workflow's `verify:` commands run on the head a person is asked to approve
MERGED ONTO the base branch's current tip, never in the ticket's own
sandbox or workspace:

- the credential broker checks the merge result out into a NEW folder
  `<data>/workspaces/<ticket>-verify`, with the base's version of each of
  `base_paths` and of the harness (what decides how the tests run: test
  configuration, conftest.py, the scripts the commands name), without
  bytecode or top-level names that shadow a module the commands run
  (PrepareVerification, services/credentials/verification/checkout.py);
- the sandbox broker makes a NEW sandbox for the id `<ticket>-verify` (any
  old one removed first): the workspace's image (never an agent's), limits,
  runtime and declared egress, no model relay, no environment variable;
- the commands run in order, each templated like a `run:` node (values as
  $1.., R36), until the first one that fails; their output streams out as
  `verification.output` events and their test runner's summary gives the
  counts (services/common/provenance/testcounts.py);
- the sandbox and the checkout are removed, also on an error or a cancel.

The verdict: every command exited 0, no command that runs a test runner
left its summary out, the commands ran at least one test, and no fewer than
the base tip's own run of the same commands (run once per base tip, kind
'base'). What the head changes in the harness does not fail it: it is
listed (`harness_changes`) and a person must acknowledge it to approve.

The result (the `verification.finished` payload) is stored per (ticket,
head, base tip, configuration): a resumed ticket gets it back and runs
nothing again; a moved base or a changed `verify:` verifies again. A
verification that could not run (a dead sandbox, a missing image, a failed
checkout) is no verdict: nothing is stored, `verification.error` says why,
and the node fails so `afe ticket retry` runs it again (VerificationNotRun); so
does a command that reached `verify.timeout`.
`ensure_mergeable` refuses to merge a head whose verification on the base's
current tip did not pass, or whose harness change was not acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from services._gen.afe.credentials.v1 import credentials_pb2 as cpb
from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services.common.config.model import Node, Verify, Workspace
from services.common.errors import AfeError, Cancelled, FailedPrecondition, NotFound
from services.common.layout import verify_id
from services.common.provenance import testcounts
from services.common.provenance.verification import failure_line

from ...events.log import now_ms
from ...sandboxes.spec import egress_rules_spec
from ...store.base import ApprovalRecord, LeaseLost, PullRequestRecord
from ...store.verification_records import BASE, HEAD, VerificationRecord
from .. import brokercalls
from ..context import RunContext
from .run import CHUNK_EVENT, command_argv

log = logging.getLogger(__name__)

OUTPUT_CAP = 1024 * 1024          # bytes of one command's output the broker streams
SUMMARY_CHARS = 16 * 1024         # of each command's output, read for its test runner's summary
# What the clean room takes from the base and how a verdict is reached: part of
# the configuration digest, so a stored verdict of older rules is not reused
# (2: distribution metadata, pytest.toml, shared files at any depth, -m modules).
RULES = "r41-merge-harness-counts-2"


class VerificationFailed(FailedPrecondition):
    """`builtin:merge` of a head whose verification did not pass: not retried."""


class VerificationNotRun(FailedPrecondition):
    """The clean room could not run (a dead sandbox, a missing image, a failed checkout):
    no verdict on the head, nothing stored; `afe ticket retry` runs it again."""


def base_owner(workspace: str) -> str:
    """The `ticket_id` under which a workspace's base runs are stored (no ticket has a ':')."""
    return "base:" + workspace


def verify_spec(workspace: Workspace) -> spb.SandboxSpec:
    """The verification sandbox: the workspace's own settings only — its image
    (never an agent's), limits, runtime and declared egress (with its rules, R44); no relay, no env names."""
    sb = workspace.sandbox
    return spb.SandboxSpec(
        image=sb.image,
        limits=spb.Limits(cpus=sb.limits.cpus, memory_bytes=sb.limits.memory_bytes, pids=sb.limits.pids,
                          disk_bytes=sb.limits.disk_bytes),
        egress=list(sb.egress), egress_private=list(sb.egress_private), env_names=[], relay=False,
        egress_rules=egress_rules_spec(sb), runtime=sb.runtime if sb.runtime != "runc" else "")


def config_digest(verify: Verify, workspace: Workspace) -> str:
    """What a stored verdict depends on besides the commits: the `verify:` declaration,
    the Workspace's harness and compiled-file settings, the image, the rules."""
    doc = {"run": list(verify.run), "base_paths": list(verify.base_paths), "timeout": verify.timeout_s,
           "harness": list(getattr(workspace, "verify_harness", ()) or ()),
           "compiled": list(getattr(workspace, "allow_compiled_paths", ()) or ()),
           "image": workspace.sandbox.image, "rules": RULES}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


async def verify_head(ctx: RunContext, node: Node, sha: str, pr: PullRequestRecord | None) -> dict[str, Any] | None:
    """The verification of `sha` merged onto the base's current tip (run once per ticket, head,
    base tip and configuration), or None when the workflow declares none."""
    rec = await _verified(ctx, node, sha)
    return summary(rec.result) if rec is not None else None


async def _verified(ctx: RunContext, node: Node, sha: str) -> VerificationRecord | None:
    verify = ctx.workflow.verify
    if verify is None:
        return None
    if not sha:
        raise FailedPrecondition(f"workflow {ctx.workflow.name!r} declares verify:, which runs on the pull "
                                 f"request's head: put builtin:open_pr in the `needs` of {node.id!r}")
    room = _Room(ctx, node, verify, config_digest(verify, ctx.workspace))
    try:
        return await room.head(sha)
    except (LeaseLost, VerificationFailed, asyncio.CancelledError, Cancelled):
        raise
    except AfeError as exc:
        message = (f"verification could not run: {exc.message}; nothing was recorded for head {sha[:12]}: "
                   f"`afe ticket retry {ctx.ticket.id}` runs it again (when the cause is in verify: or the "
                   "Workspace, fix the manifest and restart afe up first)")
        ctx.emit("verification.error", {"node": node.id, "sha": sha, "message": exc.message})
        raise VerificationNotRun(message) from None


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """What the `approval.requested` event carries of a verification."""
    out = {"passed": bool(result.get("passed")), "sha": result.get("sha", ""),
           "base_paths": list(result.get("base_paths") or []), "base_sha": result.get("base_sha", ""),
           "base_branch": result.get("base_branch", ""), "error": result.get("error", ""),
           "merge_sha": result.get("merge_sha", ""), "tests": result.get("tests"),
           "base_tests": result.get("base_tests"), "reasons": list(result.get("reasons") or []),
           "harness_changes": list(result.get("harness_changes") or []),
           "binary_files": list(result.get("binary_files") or []),
           "shadowing": list(result.get("shadowing") or []),
           "commands": [{k: c.get(k) for k in ("command", "exit_code", "timed_out", "duration_ms", "counts")}
                        for c in result.get("commands") or []]}
    return out


@dataclass
class _Outcome:
    """What one clean-room run gave: the commands' entries and counts."""
    commands: list[dict[str, Any]] = field(default_factory=list)
    counts: list[testcounts.Counts | None] = field(default_factory=list)

    def exited_ok(self, expected: int) -> bool:
        return len(self.commands) == expected and all(
            c["exit_code"] == 0 and not c["timed_out"] for c in self.commands)


class _Room:
    """One verification of a ticket's head (and, once per base tip, of the base itself)."""

    def __init__(self, ctx: RunContext, node: Node, verify: Verify, digest: str) -> None:
        self.ctx, self.node, self.verify, self.digest = ctx, node, verify, digest
        self.tid = ctx.ticket.id
        self.vid = verify_id(self.tid)
        self.rendered = [(t, ctx.render_command(t, node.id)) for t in verify.run]
        values = [args for _, (_, args) in self.rendered]
        if any(values):   # the ticket's values ($1..) decide what the commands run, the base's run too
            self.digest = hashlib.sha256(json.dumps([digest, values]).encode()).hexdigest()[:32]

    async def head(self, sha: str) -> VerificationRecord:
        ctx, ws = self.ctx, self.ctx.workspace
        base_paths = list(self.verify.base_paths)
        started = False
        outcome = _Outcome()
        try:
            prep = await self._prepare(sha)
            stored = ctx.store.verifications.verification_with(self.tid, sha, prep.base_sha, self.digest)
            if stored is not None:
                return stored
            ctx.emit("verification.started", {"node": self.node.id, "sha": sha, "base_paths": base_paths,
                                              "base_sha": prep.base_sha, "commands": list(self.verify.run)})
            started = True
            result: dict[str, Any] = {
                "node": self.node.id, "sha": sha, "passed": False, "base_paths": base_paths,
                "base_sha": prep.base_sha, "base_branch": ws.base_branch, "merge_sha": prep.commit,
                "commands": [], "error": "", "tests": None, "base_tests": None, "reasons": [],
                "harness_changes": list(prep.harness_changes), "binary_files": list(prep.binary_files),
                "shadowing": list(prep.shadowing), "config": self.digest}
            if prep.conflicts:
                shown = ", ".join(list(prep.conflicts)[:10]) + (" …" if len(prep.conflicts) > 10 else "")
                result["reasons"].append(f"does not merge onto {ws.base_branch} at {prep.base_sha[:12]}: "
                                         f"conflicts in {shown}; update the branch (afe ticket update-branch)")
            else:
                outcome = await self._commands(stream=True)
                result["commands"] = outcome.commands
                result["tests"] = testcounts.total(outcome.counts)
                result["reasons"] += self._count_reasons(outcome)
        finally:
            await asyncio.shield(self._cleanup())
        passed = not result["reasons"] and outcome.exited_ok(len(self.rendered))
        if passed and result["tests"] is not None and prep.base_sha and prep.base_sha != sha:
            base = await self._base_counts(prep.base_sha)
            result["base_tests"] = base
            if base is not None and result["tests"]["ran"] < base["ran"]:
                result["reasons"].append(f"ran {result['tests']['ran']} tests, fewer than the base's own run of "
                                         f"the same commands ({base['ran']} on {ws.base_branch} at "
                                         f"{prep.base_sha[:12]})")
                passed = False
        result["passed"] = passed
        rec = ctx.store.verifications.put_verification(self.tid, sha, passed, result, now_ms(), base_sha=prep.base_sha,
                                         config=self.digest, kind=HEAD)
        if started:
            ctx.emit("verification.finished", rec.result)
        return rec

    def _count_reasons(self, outcome: _Outcome) -> list[str]:
        """Why commands that all exited 0 still did not pass: a runner without its summary, no test at all."""
        reasons = []
        for entry, counts in zip(outcome.commands, outcome.counts, strict=True):
            runner = testcounts.runs_tests(entry["command"])
            if runner and counts is None and entry["exit_code"] == 0:
                reasons.append(f"`{entry['command'][:200]}` runs {runner} but printed no summary of the tests it "
                               "ran")
        totals = testcounts.total(outcome.counts)
        if totals is not None and totals["ran"] == 0:
            reasons.append("ran no test (a check that runs no test does not pass)")
        return reasons

    async def _base_counts(self, base_sha: str) -> dict[str, int] | None:
        """The counts of the base tip's own run of the commands (kind 'base'): once per workspace,
        tip and configuration — the base's commit is no ticket's, so every ticket on it shares it."""
        ctx = self.ctx
        owner = base_owner(ctx.workspace.name)
        stored = ctx.store.verifications.verification_with(owner, base_sha, base_sha, self.digest, BASE)
        if stored is None:
            try:
                await self._prepare(base_sha)
                outcome = await self._commands(stream=False)
            finally:
                await asyncio.shield(self._cleanup())
            tests = testcounts.total(outcome.counts)
            stored = ctx.store.verifications.put_verification(
                owner, base_sha, outcome.exited_ok(len(self.rendered)),
                {"sha": base_sha, "tests": tests, "commands": outcome.commands}, now_ms(),
                base_sha=base_sha, config=self.digest, kind=BASE)
            ctx.emit("verification.base", {"node": self.node.id, "base_sha": base_sha, "tests": tests})
        tests = stored.result.get("tests")
        return tests if isinstance(tests, dict) else None

    async def _prepare(self, sha: str) -> cpb.PrepareVerificationResponse:
        ctx = self.ctx
        await _destroy(ctx, self.vid)           # a leftover of a crashed run: never reused
        ctx.host.check_lease(self.tid)
        prep: cpb.PrepareVerificationResponse = await ctx.step(
            self.node, "verify_checkout", lambda: ctx.credentials.prepare_verification(
                self.tid, ctx.workspace.name, sha, list(self.verify.base_paths), list(self.verify.run)))
        return prep

    async def _commands(self, *, stream: bool) -> _Outcome:
        ctx = self.ctx
        ctx.host.check_lease(self.tid)
        await brokercalls.retry_unavailable(ctx.host.broker_retry_s, "creating the verification sandbox",
                                            lambda: ctx.sandbox.create(self.vid, verify_spec(ctx.workspace)))
        outcome = _Outcome()
        for template, (script, args) in self.rendered:
            entry, text = await self._command(template, script, args, stream)
            counts = testcounts.parse(text)
            entry["counts"] = counts.as_dict() if counts is not None else None
            outcome.commands.append(entry)
            outcome.counts.append(counts)
            if entry["timed_out"]:
                # the clean room's own time-out: no verdict on the head (a slow machine, a hang either way)
                raise VerificationNotRun(f"`{template[:200]}` did not finish within {self.verify.timeout_s:g} s "
                                         "(verify.timeout); raise verify.timeout, or find what hangs")
            if entry["exit_code"] != 0:
                await self._alive()
                break
        return outcome

    async def _command(self, template: str, script: str, args: list[str], stream: bool) -> tuple[dict[str, Any], str]:
        ctx = self.ctx
        started = time.monotonic()
        code, timed_out, truncated = -1, False, False
        tail = ""
        got_exit = False
        async for ev in ctx.sandbox.exec(self.vid, command_argv(script, args),
                                         timeout_ms=int(self.verify.timeout_s * 1000), output_cap_bytes=OUTPUT_CAP):
            which = ev.WhichOneof("event")
            if which in ("stdout", "stderr"):
                text = getattr(ev, which).decode("utf-8", errors="replace")
                tail = (tail + text)[-SUMMARY_CHARS:]
                if stream:
                    for i in range(0, len(text), CHUNK_EVENT):
                        ctx.emit("verification.output", {"node": self.node.id, "command": template,
                                                         "stream": which, "text": text[i:i + CHUNK_EVENT]})
            elif which == "exit":
                code, timed_out, truncated = ev.exit.code, ev.exit.timed_out, ev.exit.truncated
                got_exit = True
        if not got_exit:
            raise VerificationNotRun(f"the verification sandbox ended `{template[:200]}` without an exit status")
        return ({"command": template, "exit_code": code, "timed_out": timed_out, "truncated": truncated,
                 "duration_ms": int((time.monotonic() - started) * 1000)}, tail)

    async def _alive(self) -> None:
        """After a failed command: is the sandbox still there? A dead one is no verdict."""
        ctx = self.ctx
        try:
            code = -1
            async for ev in ctx.sandbox.exec(self.vid, ["true"], timeout_ms=20_000):
                if ev.WhichOneof("event") == "exit":
                    code = ev.exit.code
        except AfeError as exc:
            raise VerificationNotRun(f"the verification sandbox died: {exc.message}") from None
        if code != 0:
            raise VerificationNotRun("the verification sandbox stopped answering after a command failed "
                                     f"(a check of it exited {code})")

    async def _cleanup(self) -> None:
        await _cleanup(self.ctx, self.vid)


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


def check_approvable(rec: VerificationRecord | None, sha: str, accept_harness_change: bool) -> list[str]:
    """Raise unless a person may approve `sha` with this verification; the harness files the approval
    acknowledges. A failed verification is never approved (the merge would be refused)."""
    if rec is None:
        return []
    if not rec.passed:
        raise FailedPrecondition(f"{failure_line(rec.result)} on head {sha[:12]}: builtin:merge would refuse it, "
                                 "so it cannot be approved; send a follow-up to fix the code (not the tests), "
                                 "or reject the change")
    changes = [str(c) for c in rec.result.get("harness_changes") or []]
    if changes and not accept_harness_change:
        raise FailedPrecondition("this head changes how its tests run: " + ", ".join(changes[:20])
                                 + ("…" if len(changes) > 20 else "")
                                 + "; read those changes, then approve with --accept-harness-change "
                                   "(in the UI: Accept harness change and approve)")
    return changes


async def ensure_mergeable(ctx: RunContext, node: Node, appr: ApprovalRecord) -> dict[str, Any] | None:
    """Raise unless `appr.sha` may be merged: its verification merged onto the base's CURRENT tip
    passed (verified again when the base moved since), and the person acknowledged every harness
    change it has. Returns the verification the merge relies on (None without `verify:`)."""
    sha = appr.sha
    before = ctx.store.verifications.verification(ctx.ticket.id, sha)
    rec = await _verified(ctx, node, sha)
    if rec is None:
        return None
    if before is not None and before.base_sha != rec.base_sha:
        ctx.emit("verification.base_moved", {"node": node.id, "sha": sha, "verified_base_sha": before.base_sha,
                                             "base_sha": rec.base_sha, "passed": rec.passed})
    if not rec.passed:
        moved = (f" (the base moved to {rec.base_sha[:12]} since the approval)"
                 if before is not None and before.base_sha != rec.base_sha else "")
        raise VerificationFailed(f"builtin:merge refused: {failure_line(rec.result)} on head {sha[:12]}{moved}; "
                                 "send a follow-up to fix the code (not the tests), or reject the change")
    changes = set(rec.result.get("harness_changes") or [])
    unacknowledged = sorted(changes - set(appr.accepted_harness_change))
    if unacknowledged:
        raise VerificationFailed("builtin:merge refused: head " + sha[:12] + " changes how its tests run ("
                                 + ", ".join(unacknowledged[:20]) + ") and the approval did not acknowledge it; "
                                 "reject and approve again with --accept-harness-change")
    return rec.result
