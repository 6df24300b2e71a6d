"""Records of failing CI on afe's pull requests (docs/GITHUB.md, "Failing
CI"), kept in the store's `ci_failures` table: one row per (ticket, head), so
a failure GitHub reports by several deliveries (a check_run per check, the
check_suite, a commit status), or that polling sees again, is one round. The
statements: repos/ci_failures.py (`store.ci`); here the records, the states
of a row's document and the helpers the engine and github/ci.py share.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

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
    """A pull request afe opened whose head's CI polling looks at (github/ci.py)."""

    ticket_id: str
    workspace: str
    workflow: str
    number: str
    head_sha: str


def failed_head(source: str, text: str) -> str:
    """The head a CI round's follow-up is about ("" for any other follow-up)."""
    m = FAILED_HEAD.match(text) if source == CI_SOURCE else None
    return m.group(1) if m else ""


def drop_stale_ci(store: Any, ticket_id: str, pending: list[Any]) -> list[dict[str, Any]]:
    """A CI round's follow-up queued while the ticket ran is stale once the pull request's head is no
    longer the failed one (the run pushed a newer head, whose own CI says whether it still fails):
    dropped, and its round no longer counts against on_ci_failure. Returns what was dropped, per head."""
    pr = store.prs.get_pr(ticket_id)
    head = (pr.head_sha if pr is not None else "").lower()
    out: list[dict[str, Any]] = []
    for sha in sorted({s for f in pending if (s := failed_head(f.source, f.text)) and s != head}):
        count = store.followups.drop_ci_followups(ticket_id, sha)
        if not count:
            continue                    # given or dropped meanwhile (another scheduler)
        row = store.ci.ci_failure(ticket_id, sha)
        if row is not None and row.state == ROUND:
            store.ci.put_ci_failure(ticket_id, sha, {**row.doc, "state": QUIET, "reason": "stale_head"})
        out.append({"sha": sha, "head": head, "count": count,
                    "reason": f"CI failed on {sha[:12]}, which is no longer the pull request's head "
                              f"({head[:12] or 'none'}): a newer head was pushed since; its own CI decides"})
    return out
