"""Failing CI on a pull request afe opened (docs/GITHUB.md, "Failing CI"),
mixed into `GitHubIntake` (github_intake.py).

A `check_run` (completed: failure, timed_out, action_required), a
`check_suite` (completed: failure, timed_out) or a `status` (failure, error)
on the HEAD of a pull request afe opened (ticket_for_head) is noted on its
ticket, and, when the ticket's Workflow says `on_ci_failure: {max: N}`,
becomes one follow-up round (source `github:ci`). Ignored: success, pending,
cancelled and skipped results, another SHA (an older head of afe's pull
request: `stale_head`, found by the pull request a check names or, for a
status, by afe's branch `afe/<ticket>` among the commit's branches), a
merged pull request, pull requests afe did not open, and afe's OWN checks
and statuses (context or name `afe` or `afe/...`: afe's ticket status, its
verification). A failure that will never be a round is answered as such
(`no_ci_iteration`, `past_max`), though it is still noted on the ticket.

One round per (ticket, head): the first failure claims the row in
`ci_failures` (ci_records.py) atomically; further deliveries of the same
failure (a check_run per check, the check_suite, the status) and later polls
join it. After CI_SETTLE_S the credential broker reads the head's failing
checks and their logs' redacted tails (GetCheckDetails) and the round starts:
a follow-up through FollowUpQueue (queued while the ticket runs) and a
comment on the pull request, once the head is checked again (a head that
moved during the window starts nothing). A round that had to wait for the
ticket's run and is dropped because that run pushed a newer head
(FollowUpQueue, store/ci_records.drop_stale_ci) gets its comment corrected:
it says the round was not taken up. Past the bound, no follow-up: an event
and a comment that a person must look. Everything from GitHub here is
untrusted: it reaches the prompt only quoted (R36), PR comments only as
inline code.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from services.common.ci import FAILING_RUN, FAILING_STATUS, FAILING_SUITE
from services.common.config.model import Config
from services.common.errors import AfeError

from ..engine.followups import QUEUED_NEXT, FollowUpQueue
from ..sandboxes.brokers import CredentialsClient
from ..store.base import TERMINAL, WAITING_APPROVAL
from ..store.ci_records import CI_SOURCE, GATHERING, OVER, QUIET, ROUND
from ..store.store import Store
from .outcome import Outcome, _text

log = logging.getLogger(__name__)

CI_EVENTS = ("check_run", "check_suite", "status")
CI_SETTLE_S = 10.0          # the checks of one head that fail within this of the first are one round
CI_WATCH_S = 7 * 24 * 3600  # polling looks at heads of tickets that changed within this
MAX_CI_POLLS = 20           # heads polled per workspace and poll (2 requests each)
TEXT_BUDGET = 7 * 1024      # the follow-up's text (a follow-up holds at most 8 KiB)
# What a failure that will never be a round is answered (metrics.GITHUB_REASONS); it is still noted.
NO_ROUNDS = "no_ci_iteration"   # the ticket's Workflow has no on_ci_failure (or is gone)
PAST_MAX = "past_max"           # the ticket had its on_ci_failure.max rounds: a comment asks a person


def own_check(name: str) -> bool:
    """afe's own statuses and check runs: `afe` and `afe/...` (report.py, the verification)."""
    n = (name or "").strip().lower()
    return n == "afe" or n.startswith("afe/")


def _code(text: str, limit: int = 80) -> str:
    line = " ".join((text or "").replace("`", "'").split())
    return "`" + (line[:limit] + "…" if len(line) > limit else line) + "`"


def ci_failure(event: str, data: dict[str, Any]) -> tuple[str, dict[str, Any]] | str:
    """(head SHA, the failing check) of a delivery, or why it is ignored."""
    action = _text(data.get("action"))
    if event == "check_run":
        r = data.get("check_run") or {}
        if action != "completed" or r.get("conclusion") not in FAILING_RUN:
            return "passing"
        out = r.get("output") or {}
        check = {"kind": "check_run", "name": _text(r.get("name")), "app": _text((r.get("app") or {}).get("slug")),
                 "conclusion": _text(r.get("conclusion")), "title": _text(out.get("title")),
                 "summary": _text(out.get("summary")), "details_url": _text(r.get("details_url")),
                 "target_url": _text(r.get("html_url"))}
        return _text(r.get("head_sha")), check
    if event == "check_suite":
        s = data.get("check_suite") or {}
        if action != "completed" or s.get("conclusion") not in FAILING_SUITE:
            return "passing"
        app = s.get("app") or {}
        name = _text(app.get("slug")) or _text(app.get("name"))
        return _text(s.get("head_sha")), {"kind": "check_suite", "name": name, "app": name,
                                          "conclusion": _text(s.get("conclusion"))}
    if data.get("state") not in FAILING_STATUS:
        return "passing"
    return _text(data.get("sha")), {"kind": "status", "name": _text(data.get("context")), "app": "",
                                    "conclusion": _text(data.get("state")),
                                    "description": _text(data.get("description")),
                                    "target_url": _text(data.get("target_url"))}


def followup_text(sha: str, checks: list[dict[str, Any]]) -> str:
    """What the agent gets (quoted as data by quoting.followup_section): the failing checks, each with
    its summary or description, links and its log's tail, within TEXT_BUDGET."""
    head = [f"CI failed on commit {sha}: {len(checks)} failing check(s). Make them pass."]   # FAILED_HEAD
    parts = []
    for c in checks:
        lines = [f"Check {c.get('name') or '?'} ({c.get('kind')}" + (f" by {c['app']}" if c.get("app") else "")
                 + f"): {c.get('conclusion')}"]
        for key, label in (("title", "Title"), ("summary", "Summary"), ("description", "Description"),
                           ("details_url", "Details"), ("target_url", "Link")):
            if c.get(key):
                lines.append(f"{label}: {str(c[key])[:600]}")
        parts.append(lines)
    fixed = len("\n".join(head + ["\n".join(p) for p in parts]).encode()) + 64 * len(checks)
    per_log = max(0, (TEXT_BUDGET - fixed) // max(1, sum(1 for c in checks if c.get("log_tail"))))
    out = list(head)
    for c, lines in zip(checks, parts, strict=True):
        tail = (c.get("log_tail") or "").encode()[-per_log:].decode("utf-8", errors="ignore") if per_log else ""
        out.append("")
        out += lines
        if tail:
            out += ["Log (its last lines):", tail]
    return "\n".join(out)


class CiIteration:
    config: Config
    store: Store
    engine: Any
    credentials: CredentialsClient
    followups: FollowUpQueue | None
    ci_settle_s: float = CI_SETTLE_S

    def _ci_tasks(self) -> dict[tuple[str, str], asyncio.Task[None]]:
        if not hasattr(self, "_ci_running"):
            self._ci_running: dict[tuple[str, str], asyncio.Task[None]] = {}
            self._ci_seen: dict[tuple[str, str], list[dict[str, Any]]] = {}
        return self._ci_running

    async def _ci(self, event: str, data: dict[str, Any], delivery: str) -> Outcome:
        """A check_run, check_suite or status delivery (or a polled failure)."""
        found = ci_failure(event, data)
        if isinstance(found, str):
            return Outcome("ignored", found)
        sha, check = found
        if own_check(check["name"]):
            return Outcome("ignored", "own_check")
        repo = _text((data.get("repository") or {}).get("full_name")).lower()
        spaces = [ws for ws in self.config.workspaces.values()
                  if ws.forge.type == "github" and repo and ws.forge.repo.lower() == repo]
        for ws in spaces:
            tid = self.store.prs.ticket_for_head(ws.name, sha.lower())
            if tid:
                return self._ci_failed(tid, sha.lower(), [check], f"{event} (delivery {delivery})")
        if self._older_head(data, {ws.name for ws in spaces}):
            return Outcome("ignored", "stale_head")
        return Outcome("ignored", "not_afe_pull_request")

    def _older_head(self, data: dict[str, Any], spaces: set[str]) -> bool:
        """Is the failing commit of afe's pull request, but not its head? A check run or suite names its
        pull requests; a status names the branches that contain the commit (GitHub lists up to 10),
        and afe's pull request's branch is `afe/<ticket>`."""
        for pr in (data.get("check_run") or data.get("check_suite") or {}).get("pull_requests") or []:
            number = pr.get("number") if isinstance(pr, dict) else None
            if any(self.store.prs.ticket_for_pr(ws, str(number)) for ws in spaces):
                return True
        for branch in data.get("branches") or []:
            name = _text(branch.get("name")) if isinstance(branch, dict) else ""
            if not name.startswith("afe/"):
                continue
            t = self.store.tickets.get(name[len("afe/"):])
            pr = self.store.prs.get_pr(t.id) if t is not None and t.workspace in spaces else None
            if pr is not None and pr.head_branch == name:
                return True
        return False

    def _ci_fate(self, tid: str) -> str:
        """What a failure on the ticket's head becomes: "" a round, else why not (NO_ROUNDS, PAST_MAX),
        by the rounds the ticket has had so far (_ci_decide decides, with the same rule, once the
        settle window is over)."""
        t = self.store.tickets.get(tid)
        wf = self.config.workflows.get(t.workflow) if t is not None else None
        bound = wf.ci_rounds if wf is not None else 0
        if not bound:
            return NO_ROUNDS
        return PAST_MAX if sum(1 for r in self.store.ci.ci_failures(tid) if r.state == ROUND) >= bound else ""

    def _ci_failed(self, tid: str, sha: str, checks: list[dict[str, Any]], what: str) -> Outcome:
        """Claim (ticket, head) for one round, or join the round that has it."""
        self._ci_tasks()
        pr = self.store.prs.get_pr(tid)
        if pr is None or pr.head_sha.lower() != sha:
            return Outcome("ignored", "stale_head")
        if pr.state == "merged":
            return Outcome("ignored", "merged")
        key = (tid, sha)
        fate = self._ci_fate(tid)
        if not self.store.ci.claim_ci_failure(tid, sha, uuid.uuid4().hex, int(time.time() * 1000)):
            row = self.store.ci.ci_failure(tid, sha)
            if row is not None and row.state == GATHERING:
                self._ci_seen.setdefault(key, []).extend(checks)
                # the same round (its settle window), or the same note of a failure that is no round
                return Outcome("ignored", fate, [tid]) if fate else Outcome("accepted", "gathered", [tid])
            return Outcome("ignored", "duplicate", [tid])          # this head had its round (or its note)
        self._ci_seen[key] = list(checks)
        self._note(tid, "ci.failed", {"sha": sha, "checks": [_brief(c) for c in checks], "via": what})
        log.info("github %s: CI failed on %s of ticket %s (its pull request's head)%s", what, sha[:12], tid,
                 f"; no round: {fate}" if fate else "")
        self._ci_start(tid, sha)
        return Outcome("ignored", fate, [tid]) if fate else Outcome("accepted", "followup", [tid])

    def _ci_start(self, tid: str, sha: str) -> None:
        tasks = self._ci_tasks()
        if (tid, sha) not in tasks:
            tasks[(tid, sha)] = asyncio.get_running_loop().create_task(self._ci_round(tid, sha),
                                                                       name=f"ci-{tid}-{sha[:12]}")

    def ci_resume(self) -> None:
        """Rounds a stopped scheduler left in their settle window."""
        for row in self.store.ci.ci_gathering():
            self._ci_start(row.ticket_id, row.sha)

    async def ci_stop(self) -> None:
        tasks = list(self._ci_tasks().values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _ci_round(self, tid: str, sha: str) -> None:
        try:
            await asyncio.sleep(self.ci_settle_s)
            await self._ci_decide(tid, sha)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("ticket %s: the CI failure on %s could not be handled", tid, sha[:12])
        finally:
            self._ci_running.pop((tid, sha), None)
            self._ci_seen.pop((tid, sha), None)

    async def _ci_checks(self, t: Any, sha: str) -> list[dict[str, Any]]:
        """The head's failing checks as the broker reads them (with log tails), or those the deliveries named."""
        seen = [c for c in self._ci_seen.get((t.id, sha), []) if c.get("kind") != "check_suite"]
        try:
            r = await self.credentials.check_details(t.workspace, sha, True)
        except AfeError as exc:
            log.warning("ticket %s: the failing checks of %s could not be read: %s", t.id, sha[:12], exc.message)
            r = None
        listed = [{"kind": c.kind, "name": c.name, "app": c.app, "conclusion": c.conclusion, "title": c.title,
                   "summary": c.summary, "description": c.description, "details_url": c.details_url,
                   "target_url": c.target_url, "log_tail": c.log_tail} for c in (r.checks if r else [])]
        names = {c["name"] for c in listed}
        checks = [c for c in listed + [c for c in seen if c["name"] not in names] if not own_check(c["name"])]
        if not checks:     # only a suite failed, or listing failed: say what the deliveries said
            checks = [c for c in self._ci_seen.get((t.id, sha), []) if not own_check(c["name"])]
        unique: dict[str, dict[str, Any]] = {}
        for c in checks:
            unique.setdefault(c["name"], c)
        return list(unique.values())[:5]

    async def _ci_decide(self, tid: str, sha: str) -> None:
        t = self.store.tickets.get(tid)
        row = self.store.ci.ci_failure(tid, sha)
        if t is None or row is None or row.state != GATHERING:
            return
        checks = await self._ci_checks(t, sha)
        wf = self.config.workflows.get(t.workflow)
        bound = wf.ci_rounds if wf is not None else 0
        rounds = sum(1 for r in self.store.ci.ci_failures(tid) if r.state == ROUND)
        doc = {**row.doc, "checks": [{k: v for k, v in c.items() if k != "log_tail"} for c in checks]}
        pr = self.store.prs.get_pr(tid)
        names = ", ".join(_code(c["name"]) for c in checks) or "(none listed)"
        moved = pr is not None and pr.head_sha.lower() != sha     # a newer head came during the window
        if not bound or pr is None or pr.state == "merged" or moved:
            self.store.ci.put_ci_failure(tid, sha, {**doc, "state": QUIET, **({"reason": "stale_head"} if moved
                                                                           else {})})
            self._note(tid, "ci.noted", {"sha": sha, "checks": [_brief(c) for c in checks],
                                         "reason": "no on_ci_failure in the workflow" if not bound
                                         else "the pull request is merged" if pr is None or pr.state == "merged"
                                         else f"no longer the pull request's head ({pr.head_sha[:12]}): "
                                              "its own CI decides"})
            return
        if rounds >= bound:
            self.store.ci.put_ci_failure(tid, sha, {**doc, "state": OVER})
            self._note(tid, "ci.rounds_exhausted", {"sha": sha, "rounds": rounds, "max": bound,
                                                    "checks": [_brief(c) for c in checks]})
            await self._ci_comment(t, pr, "ci-over", f"CI still fails on `{sha[:12]}` ({names}) after {rounds} "
                                   f"round(s) of afe (on_ci_failure max {bound}); a person must look.")
            return
        k = rounds + 1
        self.store.ci.put_ci_failure(tid, sha, {**doc, "state": ROUND, "round": k})
        first = checks[0] if checks else {"name": "CI", "details_url": ""}
        assert self.followups is not None, "GitHubIntake has a follow-up queue whenever it has an engine"
        try:
            how = self.followups.submit(tid, followup_text(sha, checks), principal=f"github:{first['name']}",
                                        author=first["name"], source=CI_SOURCE,
                                        url=first.get("details_url") or first.get("target_url") or "",
                                        delivery=f"ci:{sha}")
        except AfeError as exc:
            self.store.ci.put_ci_failure(tid, sha, {**doc, "state": QUIET, "reason": exc.message})
            return
        log.info("ticket %s: CI round %d of %d for %s: %s", tid, k, bound, sha[:12], how)
        await self._ci_round_comment(tid, sha, queued=how == QUEUED_NEXT)

    async def ci_dropped(self, tid: str, sha: str, head: str) -> None:
        """FollowUpQueue dropped the round of `sha` (the run it waited for pushed `head`): the round's
        comment, which announced it, says so now."""
        await self._ci_round_comment(tid, sha)

    async def _ci_round_comment(self, tid: str, sha: str, *, queued: bool = False) -> None:
        """The round's comment (one per head, edited) as the row says NOW: taken, or dropped as stale.
        Written under the ticket's lock, so an announcement still under way when the round is dropped
        is followed by the correction, never the other way round."""
        locks = self._ci_comment_locks()
        held = locks.setdefault(tid, (asyncio.Lock(), [0]))
        held[1][0] += 1
        try:
            async with held[0]:
                t, pr, row = self.store.tickets.get(tid), self.store.prs.get_pr(tid), self.store.ci.ci_failure(tid, sha)
                if t is None or pr is None or row is None:
                    return
                checks = row.doc.get("checks") or []
                names = ", ".join(_code(str(c.get("name") or "")) for c in checks) or "(none listed)"
                bound = getattr(self.config.workflows.get(t.workflow), "ci_rounds", 0)
                if row.state == ROUND:
                    k = row.doc.get("round", 0)
                    body = (f"CI failed on `{sha[:12]}`: {names}; afe is on it, round {k} of {bound}." if not queued
                            else f"CI failed on `{sha[:12]}`: {names}; afe takes it up as round {k} of {bound} "
                                 "once its current run ends, unless that run pushes a newer head (whose own CI "
                                 "then decides).")
                elif row.state == QUIET and row.doc.get("reason") == "stale_head":
                    body = (f"CI failed on `{sha[:12]}`: {names}. Not taken up: afe's run meanwhile pushed "
                            f"`{pr.head_sha[:12]}`, a newer head whose own CI decides; this was no round of "
                            f"on_ci_failure (max {bound}).")
                else:
                    return
                await self._ci_comment(t, pr, f"ci-{sha[:12]}", body)
        finally:
            held[1][0] -= 1
            if not held[1][0]:
                del locks[tid]

    def _ci_comment_locks(self) -> dict[str, tuple[asyncio.Lock, list[int]]]:
        """Per ticket: the lock of its CI comments and how many wait for it (gone when none)."""
        if not hasattr(self, "_ci_locks"):
            self._ci_locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        return self._ci_locks

    async def _ci_comment(self, t: Any, pr: Any, step: str, body: str) -> None:
        try:
            await self.credentials.upsert_comment(t.workspace, pr.number, t.id, step, body, 0)
        except AfeError as exc:
            log.warning("ticket %s: the CI comment on pull request %s could not be posted: %s", t.id, pr.number,
                        exc.message)

    def _note(self, tid: str, type_: str, payload: dict[str, Any]) -> None:
        if self.engine is None or self.store.tickets.get(tid) is None:
            return
        self.engine.events.append(tid, type_, payload)
        self.engine.events.flush()

    # -- polling (poll.py) ------------------------------------------------

    async def poll_ci(self, ws: Any) -> bool:
        """The heads of afe's pull requests in `ws` that wait for approval or ended unmerged, for a
        Workflow with on_ci_failure: a failing check starts the same path as a webhook. False when
        GitHub rate limited it (the caller waits)."""
        since = int((time.time() - CI_WATCH_S) * 1000)
        watched = [w for w in self.store.ci.ci_watch((WAITING_APPROVAL, *TERMINAL), since) if w.workspace == ws.name
                   and getattr(self.config.workflows.get(w.workflow), "ci_rounds", 0)
                   and self.store.ci.ci_failure(w.ticket_id, w.head_sha.lower()) is None]
        for w in watched[:MAX_CI_POLLS]:
            r = await self.credentials.check_details(ws.name, w.head_sha, False)
            if r.rate_limited:
                return False
            failing = [{"kind": c.kind, "name": c.name, "app": c.app, "conclusion": c.conclusion}
                       for c in r.checks if not own_check(c.name)]
            if failing:
                self._ci_failed(w.ticket_id, w.head_sha.lower(), failing, f"poll of {ws.name}")
        return True


def _brief(c: dict[str, Any]) -> dict[str, Any]:
    return {k: str(c.get(k) or "")[:200] for k in ("kind", "name", "app", "conclusion")}
