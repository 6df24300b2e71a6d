"""Reporting back to GitHub (docs/GITHUB.md, "Reporting back"): brings
GitHub in line with a ticket's state, through the credential broker only.

For a ticket that came from a GitHub Trigger (its `origin` names the issue)
or whose pull request is on GitHub:
- `started`: a comment on the issue with the ticket's link, once the ticket
  runs (edited, not repeated, when a follow-up runs it again);
- `status`: a commit status `afe/<workflow>` on the pull request's head,
  pending while the ticket is live, then success, failure or error; a head
  a re-opened ticket's run replaced gets `error`, "superseded by <new head>",
  instead of staying pending;
- `final`: when the ticket ends, a comment (on the issue, else on the pull
  request) with what was done, the checks' result, tokens and duration.

Every state change reaches `changed()` (Transitions' listener); the work runs
in the background, one sync per ticket at a time, and a failed sync (the
broker away) is tried again with back-off. What was said is recorded per
ticket and step in the store (`github_reports`: comment id and a digest of
the text), so an unchanged report is not sent again. The broker marks each
comment (credentials/forges/reportmarks.py) and edits the marked one, so a crash
between GitHub's answer and the record gives one comment, edited (R37).
Texts from the sandbox (errors) go in as one clipped line of inline code.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from typing import Any

from services.common.config.model import Config
from services.common.errors import AfeError
from services.common.provenance.verification import failure_line

from ..sandboxes import egress_report
from ..store.base import (
    CANCELLED,
    FAILED,
    LIVE,
    N_FAILED,
    N_SKIPPED,
    N_SUCCEEDED,
    QUEUED,
    SUCCEEDED,
    TERMINAL,
    LeaseLost,
    NodeRunRecord,
    TicketRecord,
)
from ..store.store import Store

log = logging.getLogger(__name__)

STARTED, STATUS, FINAL = "started", "status", "final"
VERIFY_STEP, VERIFY_CONTEXT = "verify", "afe/verify"       # the clean-room verification's status (R41)
RETRY_S = 5.0               # the first retry of a failed sync; doubles up to RETRY_MAX_S
RETRY_MAX_S = 300.0
MAX_TRIES = 10
ISSUE_URL = re.compile(r"/issues/(\d+)(?:$|[#?])")
STATUS_STATES = {SUCCEEDED: ("success", "succeeded"), FAILED: ("failure", "failed"),
                 CANCELLED: ("error", "cancelled")}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _code(text: str, limit: int = 300) -> str:
    """Untrusted text as one line of inline code: no backticks, no line breaks, clipped."""
    line = " ".join(text.replace("`", "'").split())
    return "`" + (line[:limit] + "…" if len(line) > limit else line) + "`"


def duration(ms: int) -> str:
    s = max(0, ms) // 1000
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h {m}m {s}s" if h else f"{m}m {s}s" if m else f"{s}s"


def issue_number(t: TicketRecord) -> str:
    """The GitHub issue a Trigger made the ticket from ("" for any other ticket)."""
    origin = t.origin or {}
    if origin.get("source") != "github":
        return ""
    number = str(origin.get("issue") or "")
    if number.isdigit():
        return number
    m = ISSUE_URL.search(str(origin.get("url") or ""))
    return m.group(1) if m else ""


def checks_line(nodes: list[NodeRunRecord]) -> str:
    """The tests' result: the workflow's command (`run:`) nodes, passed of ran."""
    runs = [n for n in nodes if n.kind == "run" and n.state != N_SKIPPED]
    if not runs:
        return "no command nodes ran"
    passed = [n for n in runs if n.state == N_SUCCEEDED]
    failed = [n for n in runs if n.state == N_FAILED]
    out = f"{len(passed)} of {len(runs)} passed"
    if failed:
        out += " (failed: " + ", ".join(_code(n.node_id, 60) for n in failed[:10]) + ")"
    return out


class GitHubReporter:
    def __init__(self, config: Config, store: Store, credentials: Any, public_url: str = "", *,
                 retry_s: float = RETRY_S) -> None:
        self.config = config
        self.store = store
        self.credentials = credentials       # brokers.CredentialsClient: upsert_comment, set_status
        self.public_url = public_url.rstrip("/")
        self.retry_s = retry_s
        self._dirty: set[str] = set()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopped = False

    # -- when ------------------------------------------------------------------

    def changed(self, ticket_id: str, state: str = "") -> None:
        """A Transitions listener: sync the ticket in the background (coalesced)."""
        if self._stopped:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._dirty.add(ticket_id)
        if ticket_id not in self._tasks:
            self._tasks[ticket_id] = loop.create_task(self._run(ticket_id), name=f"github-report-{ticket_id}")

    def resume(self) -> None:
        """After a start: live tickets' reports catch up (a crash may have cut one short)."""
        for t in self.store.tickets.in_states(LIVE):
            self.changed(t.id, t.state)

    async def idle(self) -> None:
        """Wait until no sync is running or due (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)

    async def stop(self) -> None:
        self._stopped = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, ticket_id: str) -> None:
        tries = 0
        try:
            while ticket_id in self._dirty:
                self._dirty.discard(ticket_id)
                try:
                    await self.sync(ticket_id)
                    tries = 0
                except LeaseLost:     # another scheduler drives the ticket now and reports it (R37)
                    log.warning("ticket %s: not reported from here: another scheduler took it over", ticket_id)
                    break
                except AfeError as exc:
                    tries += 1
                    if tries >= MAX_TRIES:
                        log.warning("ticket %s: reporting to GitHub failed %d times; giving up until its next "
                                    "change: %s", ticket_id, tries, exc.message)
                        break
                    wait = min(self.retry_s * 2 ** (tries - 1), RETRY_MAX_S)
                    log.info("ticket %s: reporting to GitHub failed; again in %.0f s: %s", ticket_id, wait,
                             exc.message)
                    self._dirty.add(ticket_id)
                    await asyncio.sleep(wait)
                except Exception:
                    log.exception("ticket %s: reporting to GitHub failed", ticket_id)
                    break
        finally:
            self._tasks.pop(ticket_id, None)

    # -- what ------------------------------------------------------------------

    def link(self, ticket_id: str) -> str:
        """The ticket's page in the UI ("" when the scheduler has no --public-url)."""
        return f"{self.public_url}/#/t/{ticket_id}" if self.public_url else ""

    def _ticket_ref(self, t: TicketRecord) -> str:
        url = self.link(t.id)
        return f"[`{t.id}`]({url})" if url else f"`{t.id}`"

    async def sync(self, ticket_id: str) -> None:
        """Bring GitHub in line with the ticket: started, status, final (each only when it changed)."""
        t = self.store.tickets.get(ticket_id)
        if t is None:
            return
        ws = self.config.workspaces.get(t.workspace)
        if ws is None or ws.forge.type != "github":
            return
        issue = issue_number(t)
        pr = self.store.prs.get_pr(t.id)
        if issue and t.state != QUEUED:
            again = " again, for a follow-up" if t.reopened_at_ms else ""
            await self._comment(t, issue, STARTED,
                                f"afe is working on this{again}: ticket {self._ticket_ref(t)} "
                                f"(workflow `{t.workflow}`).")
        if pr is not None and re.fullmatch(r"[0-9a-f]{40}", pr.head_sha or ""):
            await self._superseded(t, pr.head_sha)
            await self._status(t, pr.head_sha)
            await self._verify_status(t, pr.head_sha)
        if t.state in TERMINAL and (issue or pr is not None):
            await self._comment(t, issue or pr.number, FINAL, self.final_body(t))   # type: ignore[union-attr]

    def final_body(self, t: TicketRecord) -> str:
        pr = self.store.prs.get_pr(t.id)
        nodes = self.store.tickets.node_runs(t.id)
        since = t.reopened_at_ms or t.created_at_ms
        lines = [f"**afe ticket {self._ticket_ref(t)} {t.state}** (workflow `{t.workflow}`)", ""]
        if pr is not None and pr.url:
            lines.append(f"- Pull request: {pr.url}" + (f" (head `{pr.head_sha[:12]}`)" if pr.head_sha else ""))
        else:
            lines.append("- Pull request: none")
        done = [n for n in nodes if n.state == N_SUCCEEDED]
        lines.append(f"- Done: {len(done)} of {len(nodes)} nodes succeeded"
                     + (" (" + ", ".join(_code(n.node_id, 60) for n in nodes[:20]
                                         if n.state != N_SUCCEEDED) + " not)" if len(done) < len(nodes) else ""))
        lines.append(f"- Tests: {checks_line(nodes)}")
        lines.append(f"- Tokens: {t.tokens_used}")
        lines.append(f"- Duration: {duration(t.updated_at_ms - since)}")
        if t.error:
            lines.append(f"- Error: {_code(t.error)}")
        blocked = egress_report.section(egress_report.latest(self.store, t.id), "**Blocked egress attempts**")
        if blocked:
            lines += ["", blocked]
        return "\n".join(lines)

    def _fence(self, ticket_id: str) -> int:
        """The fence of this scheduler's lease on the ticket, checked by the credential broker (R37);
        0 once the ticket ended here, or on an unshared store."""
        return self.store.leases.fences.get(ticket_id, 0) if self.store.shared else 0

    async def _comment(self, t: TicketRecord, number: str, step: str, body: str) -> None:
        digest = _digest(f"{number}\n{body}")
        known = self.store.reports.report(t.id, step)
        if known is not None and known[1] == digest:
            return
        r = await self.credentials.upsert_comment(t.workspace, number, t.id, step, body, self._fence(t.id))
        self.store.reports.put_report(t.id, step, r.comment_id, digest, int(time.time() * 1000))
        log.info("ticket %s: GitHub %s comment %s on #%s", t.id, step, "posted" if r.created else "edited", number)

    async def _status(self, t: TicketRecord, sha: str) -> None:
        if t.state in STATUS_STATES:
            state, description = STATUS_STATES[t.state]
        else:
            state = "pending"
            description = "waiting for approval" if t.state == "waiting_approval" else "running"
        await self._set_status(t, sha, STATUS, state, f"afe/{t.workflow}", f"afe ticket {t.id}: {description}")

    async def _superseded(self, t: TicketRecord, head: str) -> None:
        """The head the ticket's status was last set on, when the pull request has moved past it (a
        re-opened ticket's run pushed `head`): a final `error`, "superseded", instead of the pending it
        was left with. Before the new head's status, so a failed call leaves the old head recorded and
        the retry sets it again."""
        known = self.store.reports.report(t.id, STATUS)
        old = known[0] if known is not None else ""
        if not re.fullmatch(r"[0-9a-f]{40}", old) or old == head:
            return
        await self.credentials.set_status(t.workspace, old, "error", f"afe/{t.workflow}",
                                          f"afe ticket {t.id}: superseded by {head[:12]}", self.link(t.id), t.id,
                                          self._fence(t.id))
        log.info("ticket %s: the status of %s, no longer the pull request's head, is final now", t.id, old[:12])

    async def _verify_status(self, t: TicketRecord, sha: str) -> None:
        """`afe/verify` on `sha` from its stored clean-room verification (R41); nothing without one."""
        rec = self.store.verifications.verification(t.id, sha)
        if rec is not None:
            await self._set_status(t, sha, VERIFY_STEP, "success" if rec.passed else "failure", VERIFY_CONTEXT,
                                   failure_line(rec.result).replace("`", ""))

    async def _set_status(self, t: TicketRecord, sha: str, step: str, state: str, context: str,
                          description: str) -> None:
        """A commit status, set once per (head, state, text): recorded under `step` (R37)."""
        digest = _digest(f"{sha} {state} {description} {context}")
        known = self.store.reports.report(t.id, step)
        if known is not None and known[1] == digest:
            return
        await self.credentials.set_status(t.workspace, sha, state, context, description, self.link(t.id), t.id,
                                          self._fence(t.id))
        self.store.reports.put_report(t.id, step, sha, digest, int(time.time() * 1000))
