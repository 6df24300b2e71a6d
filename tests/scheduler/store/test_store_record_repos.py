"""The store's record repositories (services/scheduler/store/repos/), each
statement written once with SQLAlchemy Core, run against SQLite and the real
PostgreSQL test server: today's semantics of every method (one row per key,
first or last one kept as before, orders, the work claim's takeover rule),
and the fence (R37, R45): a write that changes an owner's ticket data runs
the owner's fence check (`Leases.guard`) in its own transaction, so a
scheduler whose ticket was taken over writes nothing, while requests from
non-owners (approvals, follow-ups received, work claims, once-keys of
deliveries) stay unfenced.

Each scheduler is a `Database` (its own connection) migrated as the store
does, with its own `Leases`; the repositories are composed as store.py does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, and_, exists, insert, or_, select, text, update

from services.scheduler.store import schema
from services.scheduler.store.base import (
    CANCELLED,
    FAILED,
    FOLLOWUP_PENDING,
    LIVE,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    WAITING_APPROVAL,
    ApprovalRecord,
    FollowUpRecord,
    LeaseLost,
    PullRequestRecord,
)
from services.scheduler.store.ci_records import GATHERING, ROUND
from services.scheduler.store.database import Database
from services.scheduler.store.github_records import PollCursor
from services.scheduler.store.leases import Leases
from services.scheduler.store.migrate import migrate
from services.scheduler.store.repos import (
    Approvals,
    CiFailures,
    FenceCheck,
    FinalDiffs,
    FollowUps,
    GitHubIntake,
    PullRequests,
    Reports,
    RunRecords,
    SandboxPlacements,
    Verifications,
    github_intake,
)
from services.scheduler.store.run_records import DECISION, REQUEST, RunRecord
from services.scheduler.store.verification_records import BASE

pytestmark = pytest.mark.timeout(120)

SHA, OLD = "b" * 40, "a" * 40
GRACE = 60_000
LONG = 600_000      # ms: a lease that does not run out during a test
T = schema.tickets


def _open(url: str) -> Database:
    """A scheduler's database (its own connection), migrated as the store opens it."""
    if url.startswith("sqlite:///"):
        db = Database.sqlite(Path(url[len("sqlite:///"):]))
    else:
        db = Database.postgresql(url, "the test database")
    migrate(db)
    return db


@pytest.fixture
def db(store_url) -> Iterator[Database]:
    d = _open(store_url)
    try:
        yield d
    finally:
        d.close()


def unfenced(conn: Connection, ticket_id: str) -> None:
    """No check at all: the positive controls' repositories."""


def repos(db: Database, check: FenceCheck = unfenced) -> SimpleNamespace:
    """Every record repository on one database, composed as store.py composes them."""
    def tx():
        return db.transaction(write=True)

    return SimpleNamespace(
        db=db, approvals=Approvals(tx, read=db.transaction), prs=PullRequests(tx, check, read=db.transaction),
        diffs=FinalDiffs(tx, check, read=db.transaction), reports=Reports(tx, check, read=db.transaction),
        intake=GitHubIntake(tx, check, read=db.transaction), followups=FollowUps(tx, check, read=db.transaction),
        ci=CiFailures(tx, check, read=db.transaction), verifications=Verifications(tx, check, read=db.transaction),
        runs=RunRecords(tx, check, read=db.transaction),
        placements=SandboxPlacements(tx, check, read=db.transaction))


def _ticket(db: Database, tid: str, state: str = QUEUED, workspace: str = "ws", created: int = 1,
            updated: int = 1) -> None:
    with db.transaction(write=True) as conn:
        conn.execute(insert(T).values(id=tid, workspace=workspace, workflow="fix", title="t", body="b",
                                      inputs_json="{}", state=state, created_at_ms=created, updated_at_ms=updated))


def _set_state(db: Database, tid: str, state: str) -> None:
    with db.transaction(write=True) as conn:
        conn.execute(update(T).where(T.c.id == tid).values(state=state))


def _now(db: Database) -> int:
    """The store's clock: PostgreSQL's claim uses the database's, so the test takes it from there."""
    if db.dialect == "postgresql":
        with db.transaction() as conn:
            return int(conn.execute(text("SELECT (extract(epoch from clock_timestamp()) * 1000)::bigint")).scalar_one())
    return int(time.time() * 1000)


# -- each repository's semantics, on both databases -----------------------------------------------

def test_approvals_the_latest_decision_counts(db):
    r = repos(db)
    _ticket(db, "t-1")
    assert r.approvals.latest_approval("t-1") is None
    r.approvals.add_approval(ApprovalRecord("t-1", "ann", SHA, True, 10, accepted_harness_change=["conftest.py"]))
    r.approvals.add_approval(ApprovalRecord("t-1", "bob", SHA, False, 5, reason="no"))   # older clock, later row
    latest = r.approvals.latest_approval("t-1")
    assert (latest.principal, latest.granted, latest.reason, latest.at_ms) == ("bob", False, "no", 5)
    assert latest.granted is False and latest.accepted_harness_change == []
    r.approvals.add_approval(ApprovalRecord("t-1", "ann", SHA, True, 20, accepted_harness_change=["tox.ini"]))
    latest = r.approvals.latest_approval("t-1")
    assert latest.granted is True and latest.accepted_harness_change == ["tox.ini"]


def test_pull_requests_one_per_ticket_and_the_ticket_of_a_number_or_head(db):
    r = repos(db)
    _ticket(db, "t-old", created=1)
    _ticket(db, "t-new", created=2)
    _ticket(db, "t-other", workspace="other", created=3)
    assert r.prs.get_pr("t-old") is None
    r.prs.put_pr(PullRequestRecord("t-old", "7", "u", "afe/t-old", "main", OLD))
    r.prs.put_pr(PullRequestRecord("t-old", "7", "u2", "afe/t-old", "main", SHA, "merged", "m" * 40))   # replaced
    assert r.prs.get_pr("t-old") == PullRequestRecord("t-old", "7", "u2", "afe/t-old", "main", SHA, "merged",
                                                      "m" * 40)
    r.prs.put_pr(PullRequestRecord("t-new", "7", "", "afe/t-new", "main", SHA))
    r.prs.put_pr(PullRequestRecord("t-other", "7", "", "afe/t-other", "main", SHA))
    assert r.prs.ticket_for_pr("ws", "7") == "t-new"                 # the newest ticket naming it
    assert r.prs.ticket_for_pr("other", "7") == "t-other"
    assert r.prs.ticket_for_pr("ws", "8") is None
    assert r.prs.ticket_for_head("ws", SHA) == "t-new"
    assert r.prs.ticket_for_head("ws", OLD) is None                  # no pull request has that head now
    assert r.prs.ticket_for_head("nowhere", SHA) is None


def test_final_diffs_and_reports_keep_the_last_one(db):
    r = repos(db)
    _ticket(db, "t-1")
    assert r.diffs.final_diff("t-1") is None and r.reports.report("t-1", "final") is None
    r.diffs.put_final_diff("t-1", "diff a", True, 1)
    assert r.diffs.final_diff("t-1") == ("diff a", True)
    r.diffs.put_final_diff("t-1", "diff b", False, 2)
    got = r.diffs.final_diff("t-1")
    assert got == ("diff b", False) and got[1] is False
    r.reports.put_report("t-1", "final", "c-1", "d1", 1)
    r.reports.put_report("t-1", "started", "c-2", "d2", 1)
    r.reports.put_report("t-1", "final", "c-1", "d3", 2)
    assert r.reports.report("t-1", "final") == ("c-1", "d3")
    assert r.reports.report("t-1", "started") == ("c-2", "d2")
    assert r.reports.report("t-2", "final") is None


def test_once_keys_take_effect_once_until_released(db):
    r = repos(db)
    assert r.intake.claim_once("delivery:1", 1)
    assert not r.intake.claim_once("delivery:1", 2)
    assert r.intake.claim_once("delivery:2", 2)
    r.intake.release_once("delivery:1")
    assert r.intake.claim_once("delivery:1", 3)
    r.intake.release_once("never-claimed")                           # nothing to forget: no error


def test_poll_cursors_keep_the_next_poll_with_the_cursor(db):
    r = repos(db)
    assert r.intake.poll_cursor("ws") == PollCursor()
    r.intake.put_poll_cursor("ws", PollCursor('W/"a"', "0", 1_800_000_000_000), 1)
    assert r.intake.poll_cursor("ws") == PollCursor('W/"a"', "0", 1_800_000_000_000)
    r.intake.put_poll_cursor("ws", PollCursor('W/"b"', "1234", 1_800_000_060_000), 2)
    assert r.intake.poll_cursor("ws") == PollCursor('W/"b"', "1234", 1_800_000_060_000)
    assert r.intake.poll_cursor("other") == PollCursor()


def test_a_work_claim_is_held_while_its_ticket_lives_and_taken_over_after(db):
    w = repos(db).intake
    key = ("o/r", 7, "fix-issues")
    now = _now(db)
    first = w.claim_work(*key, "A", now, GRACE)
    assert (first.claim, first.ticket_id) == ("A", "")
    assert w.claim_work(*key, "B", now, GRACE).claim == "A"         # A is creating its ticket
    _ticket(db, "t-1")
    assert w.set_work_ticket(*key, "A", "t-1")
    assert not w.set_work_ticket(*key, "B", "t-x")                 # only the holder records its ticket
    for state in (QUEUED, RUNNING, WAITING_APPROVAL):
        _set_state(db, "t-1", state)
        held = w.claim_work(*key, "B", now, GRACE)
        assert (held.claim, held.ticket_id) == ("A", "t-1")        # live: B joins t-1
    # Other keys are other work; their rows (one without a ticket) change nothing of this one's.
    assert w.claim_work("o/r", 8, "fix-issues", "C", now, GRACE).claim == "C"
    assert w.claim_work("o/r", 7, "other-trigger", "D", now, GRACE).claim == "D"
    assert w.claim_work("o/other", 7, "fix-issues", "E", now, GRACE).claim == "E"
    assert w.claim_work(*key, "B", now + 2 * GRACE, 0).claim == "A"   # a live ticket holds past the grace
    for ended in (SUCCEEDED, CANCELLED, FAILED):
        _set_state(db, "t-1", ended)
        held = w.claim_work(*key, f"F-{ended}", now, GRACE)
        assert (held.claim, held.ticket_id) == (f"F-{ended}", "")
        assert w.set_work_ticket(*key, f"F-{ended}", "t-1")


def test_a_claim_left_by_a_crash_blocks_nothing_for_long(db):
    w = repos(db).intake
    key = ("o/r", 9, "fix-issues")
    now = _now(db)
    w.claim_work(*key, "A", now, GRACE)
    w.set_work_ticket(*key, "A", "t-never-stored")
    assert w.claim_work(*key, "B", now, GRACE).claim == "A"          # within the grace period
    w.release_work(*key, "A")
    w.claim_work(*key, "A", now, GRACE)
    w.set_work_ticket(*key, "A", "t-never-stored")
    assert w.claim_work(*key, "B", now + 2 * GRACE, 0).claim == "B"  # after it
    assert w.claim_work(*key, "C", now, GRACE).claim == "B"          # B's creator died before its ticket
    assert w.claim_work(*key, "C", now + 4 * GRACE, 0).claim == "C"
    w.release_work(*key, "not-the-holder")
    assert w.claim_work(*key, "D", now, GRACE).claim == "C"
    w.release_work(*key, "C")
    assert w.claim_work(*key, "D", now, GRACE).claim == "D"


def test_followups_wait_pending_then_go_to_one_rerun_or_are_dropped(db):
    f = repos(db).followups
    _ticket(db, "t-1")
    _ticket(db, "t-2")
    f.add_followup(FollowUpRecord("t-1", 5, "op", "operator", "given one"))
    for i, words in enumerate(("review", "comment a", "comment b")):
        f.add_followup(FollowUpRecord("t-1", 10 + i, "octo", "github:review", words, "a.py", 3 + i, "u",
                                      state=FOLLOWUP_PENDING))
    f.add_followup(FollowUpRecord("t-2", 10, "octo", "github:review", "other", state=FOLLOWUP_PENDING))
    assert [x.text for x in f.followups("t-1", 0)] == ["given one"]
    assert f.followups("t-1", 6) == []
    assert [(x.text, x.line, x.path) for x in f.pending_followups("t-1")] == [
        ("review", 3, "a.py"), ("comment a", 4, "a.py"), ("comment b", 5, "a.py")]
    assert f.tickets_with_pending_followups() == ["t-1", "t-2"]      # in the order their first one came
    assert f.give_followups("t-1", 100) == 3
    assert f.give_followups("t-1", 200) == 0                        # given once
    assert [(x.text, x.at_ms) for x in f.followups("t-1", 100)] == [
        ("review", 100), ("comment a", 100), ("comment b", 100)]
    assert f.pending_followups("t-1") == [] and f.tickets_with_pending_followups() == ["t-2"]
    [dropped] = f.drop_followups("t-2")
    assert (dropped.text, dropped.state) == ("other", "dropped")
    assert f.drop_followups("t-2") == [] and f.followups("t-2", 0) == []
    assert f.tickets_with_pending_followups() == []


def test_drop_ci_followups_drops_only_the_pending_ci_follow_ups_of_that_head(db):
    f = repos(db).followups
    _ticket(db, "t-1")

    def add(source: str, words: str, state: str = FOLLOWUP_PENDING) -> None:
        f.add_followup(FollowUpRecord("t-1", 5, "ci", source, words, state=state))

    add("github:ci", f"CI failed on commit {OLD}: 1 failing check(s). Make them pass.")
    add("github:ci", f"CI failed on commit {SHA}: 1 failing check(s). Make them pass.")
    add("github:review", f"CI failed on commit {OLD}: a reviewer's words, not a CI round")
    add("github:ci", f"CI failed on commit {OLD}: already given", state="given")
    add("github:ci", f"CI failed on commit {OLD.upper()}: another head's text (SQLite's LIKE took it for {OLD})")
    assert f.drop_ci_followups("t-1", OLD) == 1
    assert f.drop_ci_followups("t-1", OLD) == 0
    assert [(x.source, x.text[20:32]) for x in f.pending_followups("t-1")] == [
        ("github:ci", SHA[:12]), ("github:review", OLD[:12]), ("github:ci", OLD.upper()[:12])]


def _pr_ticket(db: Database, r: SimpleNamespace, tid: str, state: str, sha: str, pr_state: str = "open",
               updated: int = 1) -> None:
    _ticket(db, tid, state, updated=updated)
    r.prs.put_pr(PullRequestRecord(tid, tid[-1], "", f"afe/{tid}", "main", sha, pr_state))


def test_one_ci_claim_per_ticket_and_head(db):
    r = repos(db)
    _pr_ticket(db, r, "t-1", WAITING_APPROVAL, SHA)
    assert r.ci.claim_ci_failure("t-1", SHA, "A", 10)
    assert not r.ci.claim_ci_failure("t-1", SHA, "B", 11)            # a second delivery of the same failure
    assert r.ci.claim_ci_failure("t-1", SHA, "A", 10)                # the claimer's own retry
    assert r.ci.claim_ci_failure("t-1", OLD, "C", 12)
    assert [x.state for x in r.ci.ci_gathering()] == [GATHERING, GATHERING]
    r.ci.put_ci_failure("t-1", SHA, {"claim": "A", "state": ROUND, "round": 1, "checks": [{"name": "ci"}]})
    assert [(x.sha, x.state) for x in r.ci.ci_failures("t-1")] == [(SHA, ROUND), (OLD, GATHERING)]
    assert r.ci.ci_failure("t-1", SHA).doc["checks"] == [{"name": "ci"}]
    assert [x.sha for x in r.ci.ci_gathering()] == [OLD]
    assert r.ci.ci_failure("t-2", SHA) is None


def test_the_heads_ci_polling_watches(db):
    r = repos(db)
    _pr_ticket(db, r, "t-1", WAITING_APPROVAL, SHA)
    _pr_ticket(db, r, "t-2", FAILED, OLD)
    _pr_ticket(db, r, "t-3", SUCCEEDED, "c" * 40, pr_state="merged")
    _pr_ticket(db, r, "t-4", SUCCEEDED, "")                      # no head yet
    watched = r.ci.ci_watch((WAITING_APPROVAL, FAILED, SUCCEEDED), 0)
    assert [(w.ticket_id, w.head_sha, w.number, w.workflow) for w in watched] == [
        ("t-1", SHA, "1", "fix"), ("t-2", OLD, "2", "fix")]
    assert [w.ticket_id for w in r.ci.ci_watch((WAITING_APPROVAL,), 0)] == ["t-1"]
    assert r.ci.ci_watch((WAITING_APPROVAL,), 10**15) == []
    assert r.ci.ci_watch((), 0) == []


def test_verifications_keep_the_first_result_per_head_base_config_and_kind(db):
    v = repos(db).verifications
    first = v.put_verification("t-1", SHA, True, {"n": 1}, 10, base_sha="base1", config="c")
    assert (first.passed, first.result, first.kind) == (True, {"n": 1}, "head")
    again = v.put_verification("t-1", SHA, False, {"n": 2}, 11, base_sha="base1", config="c")
    assert again == first                                            # the stored one
    v.put_verification("t-1", SHA, False, {"n": 3}, 20, base_sha="base2", config="c")
    v.put_verification("t-1", SHA, True, {"n": 4}, 30, base_sha="base2", config="c", kind=BASE)
    v.put_verification("t-1", OLD, True, {"n": 5}, 5)
    latest = v.verification("t-1", SHA)
    assert (latest.base_sha, latest.passed, latest.result) == ("base2", False, {"n": 3})   # heads only
    assert v.verification_with("t-1", SHA, "base2", "c", BASE).result == {"n": 4}
    assert v.verification_with("t-1", SHA, "base3", "c") is None
    assert [(x.sha, x.at_ms) for x in v.verifications("t-1")] == [(OLD, 5), (SHA, 10), (SHA, 20)]
    assert v.verification("t-2", SHA) is None


def test_run_records_keep_the_first_envelope_per_ticket_head_and_kind(db):
    runs = repos(db).runs
    a, b = "a" * 40, "b" * 40
    assert runs.run_record("t1", a, REQUEST) is None and runs.run_records("t1") == []
    first = runs.put_run_record(RunRecord("t1", a, REQUEST, '{"n": 1}', 10))
    assert runs.put_run_record(RunRecord("t1", a, REQUEST, '{"n": 2}', 11)) == first
    runs.put_run_record(RunRecord("t1", a, DECISION, '{"d": 1}', 10))      # same time: request first
    runs.put_run_record(RunRecord("t1", b, REQUEST, '{"n": 3}', 30))
    runs.put_run_record(RunRecord("t2", a, REQUEST, '{"x": 1}', 5))
    assert [(x.sha, x.kind) for x in runs.run_records("t1")] == [(a, REQUEST), (a, DECISION), (b, REQUEST)]
    assert runs.run_record("t1", a, DECISION).envelope == '{"d": 1}'


def test_sandbox_placements_one_broker_per_id(db):
    p = repos(db).placements
    assert p.sandbox_placement("t-1") is None
    p.place_sandbox("t-1", "host-a", 1)
    p.place_sandbox("warm-7", "host-b", 1)                           # a warm sandbox's reserved id: no ticket
    p.place_sandbox("t-1", "host-c", 2)
    assert (p.sandbox_placement("t-1"), p.sandbox_placement("warm-7")) == ("host-c", "host-b")
    p.unplace_sandbox("t-1")
    assert p.sandbox_placement("t-1") is None and p.sandbox_placement("warm-7") == "host-b"


# -- the fence (R37, R45) ---------------------------------------------------------------------------

@dataclass(frozen=True)
class FencedWrite:
    """A write of the old owner after the takeover, what the new owner set up before it, and what
    shows whether the write landed."""

    name: str
    setup: Callable[[SimpleNamespace], Any]
    write: Callable[[SimpleNamespace], Any]
    seen: Callable[[SimpleNamespace], Any]


def _ci_line(sha: str) -> str:
    return f"CI failed on commit {sha}: 1 failing check(s)."


def _once_row(r: SimpleNamespace, key: str) -> bool:
    with r.db.transaction() as conn:
        return conn.execute(select(schema.github_once.c.key).where(schema.github_once.c.key == key)).first() is not None


FENCED = [
    FencedWrite("put_pr", lambda r: r.prs.put_pr(PullRequestRecord("T", "1", "", "afe/T", "main", OLD)),
                lambda r: r.prs.put_pr(PullRequestRecord("T", "1", "", "afe/T", "main", SHA)),
                lambda r: r.prs.get_pr("T").head_sha),
    FencedWrite("put_final_diff", lambda r: None, lambda r: r.diffs.put_final_diff("T", "stale", False, 1),
                lambda r: r.diffs.final_diff("T")),
    FencedWrite("put_report", lambda r: r.reports.put_report("T", "final", "c-new", "new", 1),
                lambda r: r.reports.put_report("T", "final", "c-old", "stale", 2),
                lambda r: r.reports.report("T", "final")),
    FencedWrite("claim_once of a ticket's step", lambda r: None,
                lambda r: r.intake.claim_once("step:T:merge", 1, ticket_id="T"),
                lambda r: _once_row(r, "step:T:merge")),
    FencedWrite("release_once of a ticket's step", lambda r: r.intake.claim_once("step:T:pr", 1, ticket_id="T"),
                lambda r: r.intake.release_once("step:T:pr", ticket_id="T"),
                lambda r: _once_row(r, "step:T:pr")),
    FencedWrite("give_followups",
                lambda r: r.followups.add_followup(FollowUpRecord("T", 1, "o", "operator", "x", state="pending")),
                lambda r: r.followups.give_followups("T", 50),
                lambda r: [x.state for x in r.followups.pending_followups("T")]),
    FencedWrite("drop_followups",
                lambda r: r.followups.add_followup(FollowUpRecord("T", 1, "o", "operator", "y", state="pending")),
                lambda r: r.followups.drop_followups("T"),
                lambda r: [x.text for x in r.followups.pending_followups("T")]),
    FencedWrite("drop_ci_followups",
                lambda r: r.followups.add_followup(FollowUpRecord("T", 1, "ci", "github:ci", _ci_line(OLD),
                                                                  state="pending")),
                lambda r: r.followups.drop_ci_followups("T", OLD),
                lambda r: [x.text for x in r.followups.pending_followups("T")]),
    FencedWrite("claim_ci_failure", lambda r: None, lambda r: r.ci.claim_ci_failure("T", SHA, "old", 1),
                lambda r: r.ci.ci_failure("T", SHA)),
    FencedWrite("put_ci_failure", lambda r: r.ci.claim_ci_failure("T", OLD, "new", 1),
                lambda r: r.ci.put_ci_failure("T", OLD, {"claim": "new", "state": ROUND, "round": 9}),
                lambda r: r.ci.ci_failure("T", OLD).state),
    FencedWrite("put_verification", lambda r: None,
                lambda r: r.verifications.put_verification("T", SHA, True, {}, 1, base_sha="b"),
                lambda r: r.verifications.verification("T", SHA)),
    FencedWrite("put_run_record", lambda r: None, lambda r: r.runs.put_run_record(RunRecord("T", SHA, REQUEST, "{}", 1)),
                lambda r: r.runs.run_record("T", SHA, REQUEST)),
    FencedWrite("place_sandbox", lambda r: r.placements.place_sandbox("T", "host-new", 1),
                lambda r: r.placements.place_sandbox("T", "host-old", 2),
                lambda r: r.placements.sandbox_placement("T")),
    FencedWrite("unplace_sandbox", lambda r: r.placements.place_sandbox("T", "host-new", 1),
                lambda r: r.placements.unplace_sandbox("T"),
                lambda r: r.placements.sandbox_placement("T")),
]


@dataclass
class Scheduler:
    """One scheduler: its own database connection and its leases."""

    db: Database
    leases: Leases

    def repos(self, check: FenceCheck | None = None) -> SimpleNamespace:
        return repos(self.db, self.leases.guard if check is None else check)


def _scheduler(url: str, name: str) -> Scheduler:
    db = _open(url)
    return Scheduler(db, Leases(db, name))


@pytest.fixture
def two(store_url) -> Iterator[tuple[Scheduler, Scheduler]]:
    """Ticket T claimed by sched-a, whose lease then ran out (it stopped renewing), taken over by
    sched-b with a new fence."""
    a, b = _scheduler(store_url, "sched-a"), _scheduler(store_url, "sched-b")
    try:
        _ticket(a.db, "T", RUNNING)
        _take_over(a, b)
        yield a, b
    finally:
        a.db.close()
        b.db.close()


def _take_over(a: Scheduler, b: Scheduler) -> None:
    """a claims T (after any lease of T ran out), stops renewing, and b takes T over: a still
    believes it holds T with its fence (it has not been told), b holds the newer fence."""
    for s in (a, b):
        with s.db.transaction(write=True) as conn:
            conn.execute(update(T).where(T.c.id == "T").values(lease_until_ms=0))   # the lease ran out
        assert s.leases.claim("T", (RUNNING,), LONG) is not None
    assert a.leases.fences["T"] == b.leases.fences["T"] - 1


def test_r45_the_old_owners_record_writes_are_refused_and_nothing_is_written(two):
    a, b = two
    old, new = a.repos(), b.repos()
    for case in FENCED:
        _take_over(a, b)                        # a's write meets the database's check, not a lost mark
        fence = a.leases.fences["T"]
        case.setup(new)
        before = case.seen(new)
        with pytest.raises(LeaseLost):
            case.write(old)
        assert case.seen(new) == before, f"{case.name}: the old owner's write landed after the takeover"
        assert a.leases.lost == {"T": fence}, case.name              # and a knows it lost T
        case.write(new)                                              # the new owner writes
    # What the new owner wrote is there (each case's write, in order).
    assert new.prs.get_pr("T").head_sha == SHA and new.diffs.final_diff("T") == ("stale", False)
    assert new.placements.sandbox_placement("T") is None and new.runs.run_record("T", SHA, REQUEST) is not None


def test_r45_positive_control_without_the_check_every_stale_write_lands(two):
    a, b = two
    old, new = a.repos(unfenced), b.repos()
    for case in FENCED:
        case.setup(new)
        before = case.seen(new)
        case.write(old)
        assert case.seen(new) != before, f"{case.name}: the control did not change anything"


def test_r45_requests_from_non_owners_are_not_fenced(two):
    """add_approval, add_followup, claim_work, a delivery's once-key and the poll cursor come from
    whichever scheduler got the request: they are written while another scheduler owns the ticket,
    and also by the old owner whose lease was found lost."""
    a, b = two
    with pytest.raises(LeaseLost):
        a.repos().prs.put_pr(PullRequestRecord("T", "1", "", "afe/T", "main", OLD))   # a knows it lost T
    for s in (a, b):
        r, name = s.repos(), s.leases.owner
        r.approvals.add_approval(ApprovalRecord("T", f"p-{name}", SHA, True, 1))
        r.followups.add_followup(FollowUpRecord("T", 1, name, "github:review", "w", state="pending"))
        assert r.intake.claim_once(f"delivery:{name}", 1)
        r.intake.release_once(f"delivery:{name}")
        assert r.intake.claim_work("o/r", 1, name, "tok", 1, GRACE).claim == "tok"
        r.intake.put_poll_cursor("ws", PollCursor("e", "1", 0), 1)
    r = b.repos()
    assert r.approvals.latest_approval("T").principal == "p-sched-b"
    assert len(r.followups.pending_followups("T")) == 2


def test_r45_ids_this_scheduler_never_claimed_are_written_as_before(store_url):
    """A warm sandbox's reserved id is no ticket, and a ticket another scheduler drives is not
    this one's to fence: their rows are written without a check (Leases.guard's rule)."""
    a = _scheduler(store_url, "sched-a")
    try:
        _ticket(a.db, "T", RUNNING)
        r = a.repos()
        r.placements.place_sandbox("warm-1", "host-a", 1)
        r.ci.claim_ci_failure("T", SHA, "tok", 1)
        assert r.placements.sandbox_placement("warm-1") == "host-a" and r.ci.ci_failure("T", SHA).doc["claim"] == "tok"
    finally:
        a.db.close()


def _claim_waits(pg_url: str, check_in_write_tx: bool) -> tuple[bool, str]:
    """Scheduler A writes T's pull request; between its fence check and its write, scheduler B
    tries to take T over. Returns (B's claim had to wait, the head stored in the end)."""
    a = _scheduler(pg_url, "sched-a")
    other = _open(pg_url)                  # a second connection of A's, for the control's separate check
    _ticket(a.db, "T", RUNNING)
    a.leases.claim("T", (RUNNING,), LONG)
    checked, go = threading.Event(), threading.Event()

    def check(conn: Connection, tid: str) -> None:
        if check_in_write_tx:
            a.leases.guard(conn, tid)
        else:                               # the same check, in a transaction of its own
            with other.transaction(write=True) as own:
                a.leases.guard(own, tid)
        checked.set()
        assert go.wait(10)

    errors: list[BaseException] = []

    def write() -> None:
        try:
            a.repos(check).prs.put_pr(PullRequestRecord("T", "1", "", "afe/T", "main", OLD))
        except Exception as exc:   # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    assert checked.wait(10)
    waited = False
    with psycopg.connect(pg_url, autocommit=True) as b:     # scheduler B's claim of T
        b.execute("SET lock_timeout = '300ms'")
        try:
            b.execute("UPDATE tickets SET owner='sched-b', fence=fence+1 WHERE id='T'")
        except psycopg.errors.LockNotAvailable:
            waited = True
        go.set()
        writer.join(10)
        if waited:
            b.execute("UPDATE tickets SET owner='sched-b', fence=fence+1 WHERE id='T'")   # after A's write
    assert not errors, errors
    stored = a.repos(unfenced).prs.get_pr("T")
    a.db.close()
    other.close()
    return waited, stored.head_sha if stored else ""


def test_r45_a_claim_cannot_slip_between_the_fence_check_and_the_write(pg_url):
    waited, head = _claim_waits(pg_url, check_in_write_tx=True)
    assert waited, "B took the ticket over while A's checked write was still open"
    assert head == OLD                          # A wrote while it held the ticket; B's claim came after


def test_r45_positive_control_a_check_in_its_own_transaction_lets_the_takeover_in(pg_url):
    waited, head = _claim_waits(pg_url, check_in_write_tx=False)
    assert not waited                           # B took the ticket over between A's check and A's write ...
    assert head == OLD                          # ... and A's write landed after the takeover: a stale write


# -- the work claim with several schedulers on one PostgreSQL database ---------------------------

def test_concurrent_claimers_on_one_postgresql_database_have_one_winner(pg_url):
    """Eight schedulers (a database connection each) claim the same work at the same moment,
    round after round: exactly one holds it, every other one is told that one's token."""
    n, rounds = 8, 20
    dbs = [_open(pg_url) for _ in range(n)]
    start = threading.Barrier(n)
    seen: list[list[str]] = [[] for _ in range(rounds)]
    lock = threading.Lock()

    def claim(i: int) -> None:
        w = repos(dbs[i]).intake
        for k in range(rounds):
            start.wait()
            held = w.claim_work("o/r", k, "fix", f"s{i}", 0, GRACE)
            with lock:
                seen[k].append(held.claim)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(rounds):
        assert len(seen[k]) == n and len(set(seen[k])) == 1, (k, seen[k])
    for d in dbs:
        d.close()


def _first_takeover_condition(now: Any, grace_ms: int) -> Any:
    """The claim as first written: a row naming a ticket that is not live (in the claimer's
    snapshot) was taken over at once."""
    w, t = schema.github_work, schema.tickets.alias("t")
    live = exists().where(t.c.id == github_intake._HELD_TICKET, t.c.state.in_(LIVE))
    return or_(and_(w.c.ticket_id == "", w.c.claimed_at_ms < now - grace_ms), and_(w.c.ticket_id != "", ~live))


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "positive-control-first-claim"])
def test_a_claimer_whose_snapshot_predates_the_holders_ticket_joins_it(pg_url, monkeypatch, fixed):
    """B's claim starts while A holds the row (recording its ticket), A's ticket is committed
    after B's statement began, then A's row. PostgreSQL gives B the row's newest version (naming
    the ticket) but reads `tickets` in B's older snapshot, where the ticket is not there yet. B
    must join A's ticket, not take the claim over."""
    if not fixed:
        monkeypatch.setattr(github_intake, "takeover_condition", _first_takeover_condition)
    d = _open(pg_url)
    w = repos(d).intake
    key = ("o/r", 5, "fix")
    assert w.claim_work(*key, "A", 0, GRACE).claim == "A"
    holder = psycopg.connect(pg_url)                        # A records its ticket in a transaction ...
    holder.execute("UPDATE github_work SET ticket_id='t-a' WHERE claim='A'")
    got: list = []
    blocked = threading.Thread(target=lambda: got.append(w.claim_work(*key, "B", 0, GRACE)))
    blocked.start()                                          # ... B's claim waits for that row
    end = time.monotonic() + 10
    with psycopg.connect(pg_url, autocommit=True) as watch:
        while not watch.execute("SELECT 1 FROM pg_stat_activity WHERE wait_event_type='Lock' AND "
                                "query LIKE 'INSERT INTO github_work%%'").fetchone():
            assert time.monotonic() < end, "B's claim never waited for A's row"
            time.sleep(0.01)
    other = _open(pg_url)
    _ticket(other, "t-a")                                    # A's ticket, committed after B's statement began
    holder.commit()                                          # then A's row
    blocked.join(10)
    [held] = got
    if fixed:
        assert (held.claim, held.ticket_id) == ("A", "t-a")   # B joins A's ticket
    else:
        assert held.claim == "B"                               # B took the work over: a second ticket
    holder.close()
    for x in (d, other):
        x.close()


def test_concurrent_once_keys_and_ci_claims_on_one_postgresql_database_have_one_winner(pg_url):
    """Eight schedulers receive the same delivery and the same CI failure at the same moment,
    round after round: one of them handles each (claim_once True, claim_ci_failure True), the
    others see it taken."""
    n, rounds = 8, 10
    dbs = [_open(pg_url) for _ in range(n)]
    _ticket(dbs[0], "t-1", WAITING_APPROVAL)
    start = threading.Barrier(n)
    won: list[list[tuple[bool, bool]]] = [[] for _ in range(rounds)]
    lock = threading.Lock()

    def receive(i: int) -> None:
        r = repos(dbs[i])
        for k in range(rounds):
            start.wait()
            once = r.intake.claim_once(f"delivery:{k}", 1)
            ci = r.ci.claim_ci_failure("t-1", f"{k:040x}", f"s{i}", 1)
            with lock:
                won[k].append((once, ci))

    threads = [threading.Thread(target=receive, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(rounds):
        assert len(won[k]) == n, (k, won[k])
        assert sum(o for o, _ in won[k]) == 1 and sum(c for _, c in won[k]) == 1, (k, won[k])
    for d in dbs:
        d.close()
