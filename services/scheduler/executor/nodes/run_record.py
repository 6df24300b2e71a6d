"""The signed record of a run for each head afe asks approval for (R42,
docs/GUIDE.md "The run record").

`sign_request` builds the ticket's in-toto Statement for the head
(run_statement.py), has the credential broker sign it (its Ed25519 key;
the broker checks the subject is a commit of the ticket's branch and that
no secret it holds is in it), stores the DSSE envelope (`run_records`) and
attaches it to the pull request: on GitHub one comment per head (the
broker's marked, edited comment, R37) with a short summary and the envelope
in a fenced block; the local forge has no editable comment, so there the
stored record is what `afe verify <ticket>` fetches. `sign_decision` signs
again with the decision and edits the comment. Both are idempotent per
(ticket, head): a resumed ticket gets the stored record, never a new one.
What `approval.requested` carries is only {keyid, digest} of the envelope.
"""

from __future__ import annotations

import json
import logging
import re
import unicodedata
from typing import Any

from services.common.errors import AfeError, FailedPrecondition, PeerUnavailable
from services.common.provenance import attestation

from ...events.log import now_ms
from ...sandboxes import egress_report
from ...store.base import ApprovalRecord, PullRequestRecord
from ...store.run_records import DECISION, REQUEST, RunRecord
from ..context import RunContext
from . import run_statement

log = logging.getLogger(__name__)

SHA = re.compile(r"^[0-9a-f]{40}$")


async def sign_request(ctx: RunContext, node: Any, sha: str, pr: PullRequestRecord | None,
                       verification: dict[str, Any] | None) -> dict[str, Any] | None:
    """Sign (once per ticket and head) the record of the run that made `sha`; what the approval shows of it."""
    if not SHA.match(sha or ""):
        return None     # no commit to sign for (an approval with nothing committed)
    rec = ctx.store.run_records.run_record(ctx.ticket.id, sha, REQUEST)
    if rec is None:
        rec = await _sign(ctx, node, sha, pr, verification, None)
    await _attach(ctx, node, sha, pr)
    return _shown(rec)


async def sign_decision(ctx: RunContext, node: Any, appr: ApprovalRecord) -> None:
    """Sign the record again with the decision on `appr.sha`."""
    if not SHA.match(appr.sha or ""):
        return
    # Every decision on a head is kept: a head rejected, then re-run to the same commit and
    # approved, has two (`decision`, `decision-2`); one already signed is not signed again.
    decided = decisions(ctx.store, ctx.ticket.id, appr.sha)
    if not any(_predicate(d.envelope).get("decision", {}).get("at_ms") == appr.at_ms for d in decided):
        request = ctx.store.run_records.run_record(ctx.ticket.id, appr.sha, REQUEST)
        verification = None
        if request is not None:
            verification = _predicate(request.envelope).get("verification")
        kind = DECISION if not decided else f"{DECISION}-{len(decided) + 1}"
        rec = await _sign(ctx, node, appr.sha, ctx.store.prs.get_pr(ctx.ticket.id), verification, appr, kind)
        ctx.emit("record.signed", {"node": node.id, **_shown(rec)})
    await _attach(ctx, node, appr.sha, ctx.store.prs.get_pr(ctx.ticket.id))


def decisions(store: Any, ticket_id: str, sha: str) -> list[RunRecord]:
    """The decision records of `sha`, oldest first."""
    return [r for r in store.run_records.run_records(ticket_id) if r.sha == sha and r.kind.startswith(DECISION)]


def _shown(rec: RunRecord) -> dict[str, Any]:
    env = json.loads(rec.envelope)
    keyid = str((env.get("signatures") or [{}])[0].get("keyid", ""))
    return {"kind": rec.kind, "sha": rec.sha, "keyid": keyid, "digest": attestation.envelope_digest(rec.envelope)}


def _predicate(envelope: str) -> dict[str, Any]:
    """The predicate of a record this scheduler stored (it was signed for it)."""
    try:
        env = json.loads(envelope)
    except ValueError:
        return {}
    if not isinstance(env, dict):
        return {}
    return attestation.unverified_statement(env).get("predicate") or {}


async def _sign(ctx: RunContext, node: Any, sha: str, pr: PullRequestRecord | None,
                verification: dict[str, Any] | None, decision: ApprovalRecord | None,
                kind: str = REQUEST) -> RunRecord:
    tid = ctx.ticket.id
    ctx.host.events.flush()            # the events so far are in the store, which the record reads
    t = ctx.store.tickets.get(tid) or ctx.ticket
    denied = await _denied(ctx)
    stmt = run_statement.statement(ctx.config, ctx.store, t, sha, pr=pr, verification=verification,
                                   denied=denied, decision=decision)
    try:
        envelope = await ctx.step(node, "sign", lambda: ctx.credentials.sign_statement(
            tid, attestation.canonical(stmt)))
    except PeerUnavailable:
        raise
    except AfeError as exc:
        raise FailedPrecondition(f"the run record of head {sha} could not be signed ({exc.message}); the approval "
                                 "is not asked without it (R42): fix the cause and retry the ticket") from None
    return ctx.store.run_records.put_run_record(RunRecord(tid, sha, kind, envelope, now_ms()))


async def _denied(ctx: RunContext) -> dict[str, Any] | None:
    """The hosts the ticket's egress proxy refused so far, with counts."""
    if ctx.sandbox_ready:
        try:
            return egress_report.record_payload(await ctx.sandbox.denied_egress(ctx.ticket.id))
        except AfeError as exc:
            log.info("ticket %s: denied egress not read for the run record: %s", ctx.ticket.id, exc.message)
    return egress_report.latest(ctx.store, ctx.ticket.id)


async def _attach(ctx: RunContext, node: Any, sha: str, pr: PullRequestRecord | None) -> None:
    """The head's comment on a GitHub pull request: summary and envelope(s), edited, never repeated."""
    if pr is None or not pr.number or ctx.workspace.forge.type != "github":
        return
    body = comment_body(ctx.store.run_records.run_record(ctx.ticket.id, sha, REQUEST),
                        next(reversed(decisions(ctx.store, ctx.ticket.id, sha)), None))
    if not body:
        return
    tid, ws, number = ctx.ticket.id, ctx.workspace.name, pr.number
    try:
        await ctx.step(node, "record", lambda: ctx.credentials.upsert_comment(      # type: ignore[attr-defined]
            ws, number, tid, f"record-{sha[:32]}", body, ctx.host.fence(tid)))
    except PeerUnavailable:
        raise
    except AfeError as exc:      # the record is stored and `afe verify <ticket>` fetches it
        log.warning("ticket %s: the run record of %s was not attached to the pull request: %s", tid, sha,
                    exc.message)
        ctx.emit("record.unattached", {"node": node.id, "sha": sha, "message": exc.message})


def comment_body(request: RunRecord | None, decision: RunRecord | None) -> str:
    """The PR comment of a head: a short summary, then the envelope(s) in fenced blocks. Every
    value shown comes from the signed predicate and is shown as escaped inline code or a number."""
    latest = decision or request
    if latest is None:
        return ""
    p = _predicate(latest.envelope)
    lines = [f"### afe run record of `{latest.sha}`", ""]
    wf = p.get("workflow") or {}
    ran = [n for n in wf.get("nodes") or [] if n.get("state") in ("succeeded", "failed", "running", "waiting")]
    lines.append(f"- workflow {_code(wf.get('name', ''))}: " + ", ".join(
        f"{_code(n.get('id', ''))} {_code(n.get('state', ''))}" for n in ran[:30]))
    head = p.get("head") or {}
    run = p.get("afe_run") if head.get("pushed_by") == "person" else None
    if isinstance(run, dict):
        lines.append(f"- **head pushed by a person, not by afe's run**: what afe's run did (below) made "
                     f"{_code(run.get('head') or 'no head')}, not this one")
    ver = p.get("verification")
    lines.append("- verification: " + ("none declared" if not isinstance(ver, dict)
                                        else "passed" if ver.get("passed") else "**failed**"))
    if isinstance(ver, dict):
        lines += verification_lines(ver)
    usage = (run if isinstance(run, dict) else p).get("usage") or {}
    whose = " of afe's run" if isinstance(run, dict) else ""
    lines.append(f"- tokens{whose}: {int(usage.get('total_tokens', 0) or 0)}, estimated cost "
                 f"${float(usage.get('cost_usd', 0) or 0):.4f}")
    denied = (p.get("egress") or {}).get("denied") or []
    lines.append("- denied egress: " + (", ".join(f"{_code(h.get('host', ''))} ({int(h.get('count', 0))})"
                                                  for h in denied[:20]) or "none"))
    d = p.get("decision")
    if isinstance(d, dict):
        lines.append(f"- decision: {'approved' if d.get('granted') else 'rejected'} by "
                     f"{_code(d.get('principal', ''))}")
        if d.get("accepted_harness_change"):
            lines.append("  - acknowledged harness changes: " + _codes(d["accepted_harness_change"]))
    lines += ["", "Verify with `afe verify <this comment saved to a file>` or `afe verify <PR URL>`."]
    for rec in (request, decision):
        if rec is not None:
            lines += ["", f"{rec.kind} record (DSSE envelope, in-toto Statement v1):", "",
                      attestation.FENCE, rec.envelope, "```"]
    return "\n".join(lines)


def verification_lines(ver: dict[str, Any]) -> list[str]:
    """The verification's details for the comment: tests counted, the base it was merged onto,
    harness changes, binary files, shadowing names and the reasons it failed."""
    out = []
    tests = ver.get("tests")
    if isinstance(tests, dict):
        base = ver.get("base_tests")
        out.append("  - tests: " + ", ".join(f"{int(tests.get(k, 0) or 0)} {k}" for k in run_statement.COUNT_KEYS)
                   + (f" (the base's own run: {int(base.get('ran', 0) or 0)} ran)" if isinstance(base, dict) else ""))
    if ver.get("base_sha"):
        out.append(f"  - merged onto {_code(ver.get('base_branch') or 'the base')} at {_code(ver['base_sha'])}"
                   + (f", verified as {_code(ver['merge_sha'])}" if ver.get("merge_sha") else ""))
    for key, what in (("harness_changes", "changes how tests run (the base's version was used)"),
                      ("binary_files", "binary files added or changed"),
                      ("shadowing", "names shadowing a standard module"), ("reasons", "why it failed")):
        if ver.get(key):
            out.append(f"  - {what}: " + _codes(ver[key]))
    return out


def _codes(values: object, shown: int = 20) -> str:
    items = list(values) if isinstance(values, list) else []
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(_code(v) for v in items[:shown]) + more


def _code(value: object, limit: int = 120) -> str:
    """A value as inline code: no backticks, no line breaks, no control or format characters
    (bidi overrides), clipped (R36)."""
    text = "".join(ch for ch in str(value) if unicodedata.category(ch) not in ("Cc", "Cf", "Zl", "Zp")
                   or ch in " \t\n")
    text = " ".join(text.replace("`", "'").split())[:limit]
    return f"`{text}`" if text else "`-`"
