"""Records of failing CI on afe's pull requests (docs/GITHUB.md, "Failing
CI"), kept in the store's `ci_failures` table (migration 0009): one row per
(ticket, head), so a failure GitHub reports by several deliveries (a
check_run per check, the check_suite, a commit status), or that polling sees
again, is one round. `Store` inherits these methods; both back ends run the
same SQL (PostgreSQL's `%s` becomes SQLite's `?`), under the store's retry
wrapper (store_retry.py), so each is safe to run again: a claim is an
INSERT ... ON CONFLICT DO NOTHING that carries the claimer's token, and the
read after it says whose row it is.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .either import EitherBackend

CI_SOURCE = "github:ci"     # the follow-ups of CI rounds (github/ci.py)
# the first line of a CI round's follow-up (github/ci.py followup_text): the failed head
FAILED_HEAD = re.compile(r"CI failed on commit ([0-9a-f]{40,64}):")

# A row's `checks` document: {"claim": token, "state": GATHERING | ROUND | OVER | QUIET, "round": k,
# "checks": [...]}.
GATHERING = "gathering"   # claimed; the failing checks are being gathered (the settle window)
ROUND = "round"           # a follow-up round of the ticket (counts against on_ci_failure.max)
OVER = "over"             # past the bound: a comment asked a person to look, no follow-up
QUIET = "quiet"           # noted only (no on_ci_failure, or the ticket could take no follow-up)


@dataclass
class CiFailureRecord:
    ticket_id: str
    sha: str
    at_ms: int
    doc: dict[str, Any] = field(default_factory=dict)

    @property
    def state(self) -> str:
        return str(self.doc.get("state") or "")


@dataclass(frozen=True)
class CiWatch:
    """A pull request afe opened whose head's CI polling looks at (github_ci_poll.py)."""

    ticket_id: str
    workspace: str
    workflow: str
    number: str
    head_sha: str


class CiRecords(EitherBackend):
    """The `ci_failures` methods of `Store` (SQLite and PostgreSQL)."""

    def claim_ci_failure(self, ticket_id: str, sha: str, token: str, at_ms: int) -> bool:
        """Take (ticket, head) for one round: True for the one caller whose token the row carries."""
        doc = json.dumps({"claim": token, "state": GATHERING, "checks": []})
        self._sql("INSERT INTO ci_failures (ticket_id, sha, checks, at_ms) VALUES (%s,%s,%s,%s) "
                  "ON CONFLICT (ticket_id, sha) DO NOTHING", (ticket_id, sha, doc, at_ms))
        row = self.ci_failure(ticket_id, sha)
        return row is not None and row.doc.get("claim") == token

    def put_ci_failure(self, ticket_id: str, sha: str, doc: dict[str, Any]) -> None:
        self._sql("UPDATE ci_failures SET checks=%s WHERE ticket_id=%s AND sha=%s",
                  (json.dumps(doc), ticket_id, sha))

    def ci_failure(self, ticket_id: str, sha: str) -> CiFailureRecord | None:
        row = self._sql("SELECT ticket_id, sha, at_ms, checks FROM ci_failures WHERE ticket_id=%s AND sha=%s",
                        (ticket_id, sha)).fetchone()
        return _record(row) if row else None

    def ci_failures(self, ticket_id: str) -> list[CiFailureRecord]:
        rows = self._sql("SELECT ticket_id, sha, at_ms, checks FROM ci_failures WHERE ticket_id=%s "
                         "ORDER BY at_ms, sha", (ticket_id,)).fetchall()
        return [_record(r) for r in rows]

    def drop_ci_followups(self, ticket_id: str, sha: str) -> int:
        """Mark the ticket's pending `github:ci` follow-ups about the failed head `sha` (their text
        starts with github_ci.followup_text's first line) dropped; how many this call dropped.
        One statement: a follow-up is either given to a re-run or dropped, never both."""
        cur = self._sql("UPDATE ticket_followups SET state='dropped' WHERE ticket_id=%s AND state='pending' "
                        "AND source='github:ci' AND text LIKE %s", (ticket_id, f"CI failed on commit {sha}:%"))
        return max(0, cur.rowcount)

    def ci_gathering(self) -> list[CiFailureRecord]:
        """Rows a stopped scheduler left in their settle window (resumed at start)."""
        rows = self._sql("SELECT ticket_id, sha, at_ms, checks FROM ci_failures WHERE checks LIKE %s "
                         "ORDER BY at_ms", (f'%"state": "{GATHERING}"%',)).fetchall()
        return [r for r in (_record(row) for row in rows) if r.state == GATHERING]

    def ticket_for_head(self, workspace: str, sha: str) -> str | None:
        """The ticket whose pull request in `workspace` has head `sha` now, if afe opened it."""
        row = self._sql("SELECT p.ticket_id FROM pull_requests p JOIN tickets t ON t.id=p.ticket_id "
                        "WHERE t.workspace=%s AND p.head_sha=%s ORDER BY t.created_at_ms DESC LIMIT 1",
                        (workspace, sha)).fetchone()
        return row[0] if row else None

    def ci_watch(self, states: tuple[str, ...], since_ms: int) -> list[CiWatch]:
        """Tickets in `states` changed since `since_ms` whose pull request is not merged."""
        marks = ",".join(["%s"] * len(states))
        rows = self._sql("SELECT t.id, t.workspace, t.workflow, p.number, p.head_sha FROM tickets t JOIN "
                         "pull_requests p ON p.ticket_id=t.id WHERE t.state IN (" + marks + ") AND "
                         "t.updated_at_ms >= %s AND p.state <> 'merged' AND p.head_sha <> '' ORDER BY t.id",
                         (*states, since_ms)).fetchall()
        return [CiWatch(*r) for r in rows]


def _record(row: tuple) -> CiFailureRecord:
    try:
        doc = json.loads(row[3] or "{}")
    except ValueError:
        doc = {}
    return CiFailureRecord(row[0], row[1], row[2], doc if isinstance(doc, dict) else {})


def failed_head(source: str, text: str) -> str:
    """The head a CI round's follow-up is about ("" for any other follow-up)."""
    m = FAILED_HEAD.match(text) if source == CI_SOURCE else None
    return m.group(1) if m else ""


def drop_stale_ci(store: Any, ticket_id: str, pending: list[Any]) -> list[dict]:
    """A CI round's follow-up queued while the ticket ran is stale once the pull request's head is no
    longer the failed one (the run pushed a newer head, whose own CI says whether it still fails):
    dropped, and its round no longer counts against on_ci_failure. Returns what was dropped, per head."""
    pr = store.get_pr(ticket_id)
    head = (pr.head_sha if pr is not None else "").lower()
    out = []
    for sha in sorted({s for f in pending if (s := failed_head(f.source, f.text)) and s != head}):
        count = store.drop_ci_followups(ticket_id, sha)
        if not count:
            continue                    # given or dropped meanwhile (another scheduler)
        row = store.ci_failure(ticket_id, sha)
        if row is not None and row.state == ROUND:
            store.put_ci_failure(ticket_id, sha, {**row.doc, "state": QUIET, "reason": "stale_head"})
        out.append({"sha": sha, "head": head, "count": count,
                    "reason": f"CI failed on {sha[:12]}, which is no longer the pull request's head "
                              f"({head[:12] or 'none'}): a newer head was pushed since; its own CI decides"})
    return out
