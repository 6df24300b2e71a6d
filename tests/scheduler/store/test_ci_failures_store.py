"""The store side of failing CI on afe's pull requests (ci_records.py,
docs/GITHUB.md "Failing CI"), on SQLite and PostgreSQL: one claim per
(ticket, head), safe to run again; rows in their settle window are found
after a restart; the heads polling looks at."""

from __future__ import annotations

import pytest

from services.scheduler.store.base import (
    FAILED,
    FOLLOWUP_PENDING,
    SUCCEEDED,
    WAITING_APPROVAL,
    FollowUpRecord,
    PullRequestRecord,
    TicketRecord,
)
from services.scheduler.store.ci_records import GATHERING, ROUND
from tests.support.postgres import open_store_url

pytestmark = pytest.mark.timeout(120)

SHA, OLD = "b" * 40, "a" * 40


@pytest.fixture
def store(store_url, tmp_path):
    s = open_store_url(store_url, tmp_path)
    try:
        yield s
    finally:
        s.close()


def _ticket(store, tid: str, state: str, sha: str, pr_state: str = "open") -> None:
    store.tickets.create(TicketRecord(tid, "ws", "fix", "t", "b", {}, state, 1, 1), [], [])
    store.prs.put_pr(PullRequestRecord(tid, tid[-1], "", f"afe/{tid}", "main", sha, pr_state))


def test_one_claim_per_ticket_and_head(store):
    _ticket(store, "t-1", WAITING_APPROVAL, SHA)
    assert store.ci.claim_ci_failure("t-1", SHA, "A", 10)
    assert not store.ci.claim_ci_failure("t-1", SHA, "B", 11)      # a second delivery of the same failure
    assert store.ci.claim_ci_failure("t-1", SHA, "A", 10)          # the claimer's own retry: still its claim
    assert store.ci.claim_ci_failure("t-1", OLD, "C", 12)          # another head is another round
    assert [r.state for r in store.ci.ci_gathering()] == [GATHERING, GATHERING]
    store.ci.put_ci_failure("t-1", SHA, {"claim": "A", "state": ROUND, "round": 1, "checks": [{"name": "ci"}]})
    rows = store.ci.ci_failures("t-1")
    assert [(r.sha, r.state) for r in rows] == [(SHA, ROUND), (OLD, GATHERING)]
    assert store.ci.ci_failure("t-1", SHA).doc["checks"] == [{"name": "ci"}]
    assert [r.sha for r in store.ci.ci_gathering()] == [OLD]
    assert store.ci.ci_failure("t-2", SHA) is None


def test_ticket_for_head_and_the_heads_polling_watches(store):
    _ticket(store, "t-1", WAITING_APPROVAL, SHA)
    _ticket(store, "t-2", FAILED, OLD)
    _ticket(store, "t-3", SUCCEEDED, "c" * 40, pr_state="merged")
    assert store.prs.ticket_for_head("ws", SHA) == "t-1"
    assert store.prs.ticket_for_head("other", SHA) is None
    assert store.prs.ticket_for_head("ws", "d" * 40) is None
    watched = store.ci.ci_watch((WAITING_APPROVAL, FAILED, SUCCEEDED), 0)
    assert [(w.ticket_id, w.head_sha, w.number) for w in watched] == [("t-1", SHA, "1"), ("t-2", OLD, "2")]
    assert store.ci.ci_watch((WAITING_APPROVAL,), 0)[0].workflow == "fix"
    assert store.ci.ci_watch((WAITING_APPROVAL,), 10**15) == []


def test_drop_ci_followups_drops_only_the_pending_ci_follow_ups_of_that_head(store):
    _ticket(store, "t-1", WAITING_APPROVAL, SHA)

    def add(source: str, text: str, state: str = FOLLOWUP_PENDING) -> None:
        store.followups.add_followup(FollowUpRecord("t-1", 5, "ci", source, text, state=state))

    add("github:ci", f"CI failed on commit {OLD}: 1 failing check(s). Make them pass.")
    add("github:ci", f"CI failed on commit {SHA}: 1 failing check(s). Make them pass.")
    add("github:review", f"CI failed on commit {OLD}: a reviewer's words, not a CI round")
    add("github:ci", f"CI failed on commit {OLD}: already given", state="given")
    assert store.followups.drop_ci_followups("t-1", OLD) == 1
    assert store.followups.drop_ci_followups("t-1", OLD) == 0                 # run again: nothing more
    assert [(f.source, f.text[20:32]) for f in store.followups.pending_followups("t-1")] == [
        ("github:ci", SHA[:12]), ("github:review", OLD[:12])]
    assert [f.text for f in store.followups.followups("t-1", 0)] == [f"CI failed on commit {OLD}: already given"]
