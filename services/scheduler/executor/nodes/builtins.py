"""`builtin:` nodes, looked up in `BUILTINS`: commit, open_pr, approval, merge.

Each broker call is a step that waits through a credential broker restart
(R37) and is idempotent in the broker, so a resumed ticket repeats nothing.
An approval is pinned to the pull request's head SHA; merge merges only the
SHA a person approved (R16).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from services._gen.afe.credentials.v1 import credentials_pb2 as cpb
from services.common.config.model import Node
from services.common.errors import Aborted, AfeError, FailedPrecondition

from ...sandboxes import egress_report
from ...store.base import N_RUNNING, N_WAITING, RUNNING, WAITING_APPROVAL, ApprovalRecord, PullRequestRecord
from ..context import RunContext
from ..transitions import state_event
from . import forge_text, review_gate

log = logging.getLogger(__name__)

MERGE_BASE_TRIES = 5             # verifications of one approved head while its base keeps moving
NESTED_REPOS_SHOWN = 20          # nested repository paths named in an event or a PR body


class Rejected(FailedPrecondition):
    """A person rejected the change: not retried."""


def nested_repositories_warning(paths: Sequence[str]) -> str:
    """One line for people (event, PR description): the workspace held other git
    repositories, committed as plain files. Paths are sandbox-made: each is shown
    as inline code with backticks and line breaks removed, and the list is bounded."""
    shown = ["`" + "".join(ch for ch in p[:200] if ch not in "`\r\n") + "`"
             for p in list(paths)[:NESTED_REPOS_SHOWN]]
    more = f" and {len(paths) - len(shown)} more" if len(paths) > len(shown) else ""
    return (f"the workspace holds {len(paths)} other git "
            f"repositor{'y' if len(paths) == 1 else 'ies'} ({', '.join(shown)}{more}), committed as plain "
            "files, not as submodules; review them before merging")


async def builtin_node(ctx: RunContext, node: Node) -> str:
    fn = BUILTINS.get(node.uses or "")
    if fn is None:
        raise FailedPrecondition(f"unknown builtin {node.uses!r}")
    return await fn(ctx, node)


# ---- commit and pull request ---------------------------------------------------

def _default_message(ctx: RunContext) -> str:
    return f"{ctx.ticket.title}\n\nafe ticket {ctx.ticket.id}"


async def _commit(ctx: RunContext, node: Node) -> cpb.CommitResponse:
    """Commit the workspace (the sandbox frozen meanwhile) and announce it."""
    await ctx.ensure_workspace()
    frozen = False
    if ctx.uses_sandbox():
        await ctx.ensure_sandbox()
    if ctx.sandbox_ready:
        await ctx.sandbox.freeze(ctx.ticket.id, True)
        frozen = True
    try:
        # The ticket's text may be an issue's (R36): control characters out, or git refuses a NUL.
        message = forge_text.commit_message(ctx.render(str(node.with_.get("message") or _default_message(ctx)),
                                                       node.id))
        r = await ctx.step(node, "commit", lambda: ctx.credentials.commit(
            ctx.ticket.id, ctx.workspace.name, message, ctx.host.fence(ctx.ticket.id)))
    finally:
        if frozen:
            await asyncio.shield(ctx.sandbox.freeze(ctx.ticket.id, False))
    ctx.emit("commit.done", {"node": node.id, "sha": r.sha, "changed": r.changed,
                             "files_changed": r.files_changed})
    if r.nested_repositories:
        ctx.emit("commit.warning", {"node": node.id, "sha": r.sha, "kind": "nested_repository",
                                    "paths": list(r.nested_repositories)[:NESTED_REPOS_SHOWN],
                                    "count": len(r.nested_repositories),
                                    "message": nested_repositories_warning(r.nested_repositories)})
    return r


async def commit(ctx: RunContext, node: Node) -> str:
    return (await _commit(ctx, node)).sha


async def _denied_egress(ctx: RunContext, node: Node) -> dict[str, Any] | None:
    """The hosts the ticket's egress proxy refused so far (an event, and for the
    PR description); None when none, without a sandbox, or the broker cannot say."""
    if not ctx.sandbox_ready:
        return None
    try:
        r = await ctx.sandbox.denied_egress(ctx.ticket.id)
    except AfeError as exc:
        log.info("ticket %s: no list of refused egress: %s", ctx.ticket.id, exc.message)
        return None
    if not r.hosts:
        return None
    data = egress_report.payload(r)
    ctx.emit(egress_report.EVENT, {"node": node.id, **data})
    return data


async def open_pr(ctx: RunContext, node: Node) -> str:
    tid, ws = ctx.ticket.id, ctx.workspace.name
    c = await _commit(ctx, node)
    p = await ctx.step(node, "push", lambda: ctx.credentials.push(tid, ws, ctx.host.fence(tid)))
    ctx.emit("push.done", {"node": node.id, "branch": p.branch, "sha": p.sha})
    title = forge_text.pr_title(ctx.render(str(node.with_.get("title") or "{{ticket.title}}"), node.id))
    body = forge_text.pr_body(ctx.render(str(node.with_.get("body") or
                                             "{{ticket.body}}\n\n---\nOpened by afe for ticket {{ticket.id}}."),
                                         node.id))
    if c.nested_repositories:
        body += "\n\n> [!WARNING]\n> " + nested_repositories_warning(c.nested_repositories)
    denied = await _denied_egress(ctx, node)
    if denied:
        body += "\n\n" + egress_report.section(denied)
    pr = await ctx.step(node, "open_pr", lambda: ctx.credentials.open_pr(tid, ws, title, body,
                                                                           ctx.host.fence(tid)))
    known = ctx.store.prs.get_pr(tid)
    rec = PullRequestRecord(tid, pr.number, pr.url, pr.head_branch, pr.base_branch, pr.head_sha,
                            pr.state or "open", pr.merge_sha)
    if known is not None and known.state == "merged":
        rec.state, rec.merge_sha = known.state, known.merge_sha
    ctx.store.prs.put_pr(rec)
    ctx.emit("pr.opened", {"node": node.id, "number": pr.number, "url": pr.url,
                           "head_branch": pr.head_branch, "base_branch": pr.base_branch,
                           "head_sha": pr.head_sha, "existing": known is not None})
    ctx.host.transitions.notify(tid, ctx.ticket.state)     # the PR head gets its pending status (github/report.py)
    return pr.url or pr.number


# ---- approval and merge -----------------------------------------------------------

async def _await_approval(ctx: RunContext, node: Node, sha: str, pr: PullRequestRecord | None,
                          gate: dict[str, Any]) -> ApprovalRecord:
    """Park the ticket in waiting_approval until a person decides. Nothing
    here awaits before the waiter is registered: an approval given in
    between would find no waiter and be missed (`_approval_for` prepares the
    workspace before it looks for a decision)."""
    tid = ctx.ticket.id
    t = ctx.store.tickets.get(tid)
    ctx.store.tickets.update_node(tid, node.id, state=N_WAITING)
    if not (t and t.state == WAITING_APPROVAL and t.awaiting_sha == sha):
        ctx.host.transitions.move(tid, WAITING_APPROVAL, state_event(WAITING_APPROVAL),
                                  ("approval.requested", {"node": node.id, "sha": sha, "pr": pr.number if pr else "",
                                                          "url": pr.url if pr else "", **gate}),
                                  awaiting_sha=sha)
    rec = await ctx.host.wait_for_decision(tid)
    ctx.store.tickets.update_node(tid, node.id, state=N_RUNNING)
    return rec


async def _approval_for(ctx: RunContext, node: Node, sha: str, pr: PullRequestRecord | None) -> ApprovalRecord:
    # The workspace first: the diff a person is asked to approve (tickets.diff,
    # the ticket and pull request pages) is the live workspace's, and a re-run
    # that starts here (a retry after a rejection, an update of the branch)
    # runs no node that would prepare it. Done before looking for a decision,
    # so no await separates that look from waiting for one.
    await ctx.ensure_workspace()
    # review_gate (verification R41, signed record R42) before the look for a decision,
    # for the same reason; it is idempotent per head, so a decided head costs a lookup.
    gate = await review_gate.before_request(ctx, node, sha, pr)
    appr = ctx.store.approvals.latest_approval(ctx.ticket.id)
    t = ctx.store.tickets.get(ctx.ticket.id)
    # An approval given before the ticket was last re-opened is not one of the re-run (R16).
    decided = (appr is not None and appr.sha == sha and t is not None and t.state == RUNNING
               and appr.at_ms > t.reopened_at_ms)  # same millisecond: the old one
    if not decided or appr is None:
        appr = await _await_approval(ctx, node, sha, pr, gate)
    await review_gate.after_decision(ctx, node, appr)
    if not appr.granted:
        why = f": {appr.reason}" if appr.reason else ""
        raise Rejected(f"rejected by {appr.principal}{why}")
    return appr


async def approval(ctx: RunContext, node: Node) -> str:
    pr = ctx.store.prs.get_pr(ctx.ticket.id)
    appr = await _approval_for(ctx, node, pr.head_sha if pr else "", pr)
    return f"approved by {appr.principal}"


async def merge(ctx: RunContext, node: Node) -> str:
    tid, ws = ctx.ticket.id, ctx.workspace.name
    pr = ctx.store.prs.get_pr(tid)
    if pr is None:
        raise FailedPrecondition("builtin:merge needs a pull request: put builtin:open_pr in its `needs`")
    if pr.state == "merged":
        return pr.merge_sha  # recorded: never merge twice
    number = pr.number
    current = await ctx.step(node, "merge", lambda: ctx.credentials.get_pr(ws, number))
    if current.state == "merged":
        pr.state, pr.merge_sha = "merged", current.merge_sha
        ctx.store.prs.put_pr(pr)
        ctx.emit("merge.done", {"node": node.id, "number": pr.number, "merge_sha": pr.merge_sha,
                                "already_merged": True})
        return pr.merge_sha
    if current.head_sha and current.head_sha != pr.head_sha:
        pr.head_sha = current.head_sha
        ctx.store.prs.put_pr(pr)
    while True:
        appr = await _approval_for(ctx, node, pr.head_sha, pr)
        # The branch may have moved while it waited: a person approved
        # `appr.sha`, so only that SHA may be merged (R16); ask again.
        current = await ctx.step(node, "merge", lambda: ctx.credentials.get_pr(ws, number))
        if current.head_sha and current.head_sha != appr.sha and current.state != "merged":
            ctx.emit("approval.stale", {"node": node.id, "approved_sha": appr.sha, "head_sha": current.head_sha})
            pr.head_sha = current.head_sha
            ctx.store.prs.put_pr(pr)
            continue
        break
    acknowledged = getattr(appr, "accepted_harness_change", None) or ()    # R41: carried into the signed record
    for _ in range(MERGE_BASE_TRIES):
        verified = await review_gate.ensure_mergeable(ctx, node, appr)   # R41: only a verified merge result
        base = str(verified.get("base_sha") or "") if verified else ""
        def merging(base: str = base) -> Awaitable[cpb.MergePullRequestResponse]:
            return ctx.credentials.merge(tid, ws, number, appr.principal, appr.sha, appr.at_ms,
                                         str(node.with_.get("method") or ""), ctx.host.fence(tid),
                                         accepted_harness_change=acknowledged, expected_base_sha=base)
        try:
            r = await ctx.step(node, "merge", merging)
            break
        except Aborted as exc:          # the base moved between the verification and the merge: verify again
            ctx.emit("merge.base_moved", {"node": node.id, "sha": appr.sha, "verified_base_sha": base,
                                          "message": exc.message})
    else:
        raise FailedPrecondition(f"builtin:merge gave up: the base branch moved {MERGE_BASE_TRIES} times while "
                                 f"head {appr.sha[:12]} was verified on it; retry when it is quieter "
                                 f"(`afe ticket retry {tid}`)")
    pr.state, pr.merge_sha = "merged", r.merge_sha
    ctx.store.prs.put_pr(pr)
    ctx.emit("merge.done", {"node": node.id, "number": pr.number, "sha": appr.sha, "merge_sha": r.merge_sha,
                            "principal": appr.principal, "already_merged": r.already_merged,
                            **({"verified_base_sha": verified.get("base_sha", "")} if verified else {})})
    return r.merge_sha


BUILTINS: dict[str, Callable[[RunContext, Node], Awaitable[str]]] = {
    "commit": commit,
    "open_pr": open_pr,
    "approval": approval,
    "merge": merge,
}
