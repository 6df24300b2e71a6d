"""One ticket per piece of work (docs/GITHUB.md, "One ticket per issue"): while
the ticket a Trigger started for an issue is live, every further event of that
Trigger for that issue (a second delivery of the same label, `labeled` again,
the assignment that came with the label, the command comment) joins it, in
webhook and in polling mode and with two schedulers racing on one PostgreSQL
database; once the ticket has ended, the next event starts a new one. Each
test has its positive control: the intake without the work claim (a ticket per
event, as before) makes two tickets or more."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from types import SimpleNamespace

import pytest

from services.common.config.manifests import load_config
from services.common.secrecy.redact import Redactor
from services.scheduler.engine.core import Engine
from services.scheduler.github import intake as github_intake
from services.scheduler.github.intake import JOINED_EVENT, GitHubIntake
from services.scheduler.github.poll import Poller
from services.scheduler.store.base import CANCELLED, FAILED, SUCCEEDED
from tests.support.postgres import open_store_url

from .conftest import example, write_config
from .old_intake import old_claims
from .test_polling import _event

pytestmark = pytest.mark.timeout(120)


def _comment(examples, body: str) -> dict:
    e = example(examples, "issue_comment", "created")
    e["comment"]["body"] = body
    return e


def _joined(store, tid: str) -> list[dict]:
    return [json.loads(e.payload_json) for e in store.events.read(tid, 1) if e.type == JOINED_EVENT]


@pytest.mark.parametrize("fixed", [True, False], ids=["claimed", "positive-control-no-claim"])
async def test_deliveries_for_one_issue_make_one_ticket_until_it_ends(stack, examples, monkeypatch, fixed):
    if not fixed:
        old_claims(monkeypatch, stack.scheduler.store)
    labeled = example(examples, "issues", "labeled")
    stack.github.permissions[labeled["sender"]["login"]] = "write"
    assigned = example(examples, "issues", "assigned")
    assert assigned["issue"]["number"] == labeled["issue"]["number"]     # GitHub's examples: one issue
    label_again = example(examples, "issues", "labeled")
    cases = [("issues", labeled, str(uuid.uuid4())),          # the label
             ("issues", labeled, str(uuid.uuid4())),          # the same event delivered again under a new id
             ("issues", assigned, str(uuid.uuid4())),         # assigned to the bot with the label: one Trigger
             ("issues", label_again, str(uuid.uuid4())),      # `labeled` again (removed and added)
             ("issue_comment", _comment(examples, "/afe please"), str(uuid.uuid4()))]
    answers = [await stack.post(event, payload, delivery=d) for event, payload, d in cases]
    if not fixed:
        assert [doc["outcome"] for _, doc in answers] == ["accepted"] * 5
        assert len(stack.tickets()) == 5                       # a ticket per event
        return
    [t] = stack.tickets()
    assert answers[0] == (202, {**answers[0][1], "outcome": "accepted", "reason": "ok", "tickets": [t.id]})
    for status, doc in answers[1:]:
        assert (status, doc["outcome"], doc["reason"], doc["tickets"]) == (202, "duplicate", "joined", [t.id])
    # The ticket says which deliveries joined it, and as what.
    assert [(j["delivery"], j["event"], j["trigger"]) for j in _joined(stack.scheduler.store, t.id)] == [
        (cases[1][2], "issues.labeled", "github-fix"), (cases[2][2], "issues.assigned", "github-fix"),
        (cases[3][2], "issues.labeled", "github-fix"), (cases[4][2], "issue_comment.created", "github-fix")]
    assert await stack.metric("duplicate", "joined") == 4 and await stack.metric("accepted", "ok") == 1
    # A replay of a joined delivery is still a replay.
    status, doc = await stack.post("issues", labeled, delivery=cases[1][2])
    assert (status, doc["reason"]) == (409, "duplicate")
    # The ticket ends: the next event starts a new ticket, which the one after joins.
    stack.scheduler.store.tickets.update(t.id, state=FAILED, torn_down=True)
    status, doc = await stack.post("issues", assigned)
    assert (status, doc["outcome"]) == (202, "accepted") and doc["tickets"] != [t.id]
    status, again = await stack.post("issues", labeled)
    assert (status, again["reason"], again["tickets"]) == (202, "joined", doc["tickets"])
    assert len(stack.tickets()) == 2
    # Another issue is other work.
    other = example(examples, "issues", "labeled")
    other["issue"]["number"] = 77
    status, doc = await stack.post("issues", other)
    assert (status, doc["reason"]) == (202, "ok") and len(stack.tickets()) == 3


@pytest.mark.parametrize("fixed", [True, False], ids=["claimed", "positive-control-no-claim"])
async def test_polled_events_for_one_issue_make_one_ticket(stack, examples, monkeypatch, fixed):
    if not fixed:
        old_claims(monkeypatch, stack.scheduler.store)
    stack.github.permissions[example(examples, "issues", "labeled")["sender"]["login"]] = "write"
    ws = stack.scheduler.engine.config.workspaces["hello"]
    poller = Poller(stack.scheduler.intake, interval_s=1)
    stack.github.events = [_event(1, examples)]
    assert (await poller.poll_once(ws))[0] == []                 # the first poll sets the cursor
    # One poll brings the label, the assignment and the label again (newest first, as GitHub lists them).
    stack.github.events[:0] = [_event(4, examples), _event(3, examples, "assigned"), _event(2, examples)]
    outcomes, _ = await poller.poll_once(ws)
    if not fixed:
        assert [o.outcome for o in outcomes] == ["accepted"] * 3 and len(stack.tickets()) == 3
        return
    [t] = stack.tickets()
    assert [(o.outcome, o.reason, o.ticket_ids) for o in outcomes] == [
        ("accepted", "ok", [t.id]), ("duplicate", "joined", [t.id]), ("duplicate", "joined", [t.id])]
    assert [j["delivery"] for j in _joined(stack.scheduler.store, t.id)] == ["poll:1003", "poll:1004"]
    # Ended: the next polled event of the issue starts a new ticket.
    stack.scheduler.store.tickets.update(t.id, state=SUCCEEDED, torn_down=True)
    stack.github.events.insert(0, _event(5, examples))
    outcomes, _ = await poller.poll_once(ws)
    assert [o.reason for o in outcomes] == ["ok"] and len(stack.tickets()) == 2


async def test_a_claim_left_by_a_crash_never_blocks_the_issue_for_good(stack, examples, monkeypatch):
    """A scheduler that died between claiming the work and creating the ticket
    left a claim without a ticket: an event within the grace period is answered
    "redeliver later" (503, nothing recorded), one after it starts the ticket. So
    is a claim whose ticket does not exist."""
    labeled = example(examples, "issues", "labeled")
    stack.github.permissions[labeled["sender"]["login"]] = "write"
    store = stack.scheduler.store
    key = (stack.repo.lower(), labeled["issue"]["number"], "github-fix")
    monkeypatch.setattr(github_intake, "JOIN_WAIT_S", 0.3)
    store.intake.claim_work(*key, "crashed-scheduler", 10**13, github_intake.CLAIM_GRACE_MS)   # "just now"
    delivery = str(uuid.uuid4())
    status, doc = await stack.post("issues", labeled, delivery=delivery)
    assert (status, doc["reason"]) == (503, "scheduler_unavailable") and stack.tickets() == []
    monkeypatch.setattr(github_intake, "CLAIM_GRACE_MS", -10**13)    # the grace period is over
    status, doc = await stack.post("issues", labeled, delivery=delivery)   # GitHub's redelivery, same id
    assert (status, doc["reason"]) == (202, "ok")
    [t] = stack.tickets()
    # A claim naming a ticket the store does not have (a cut restore, say): the same, it blocks for
    # the grace period only.
    store.tickets.update(t.id, state=CANCELLED, torn_down=True)
    monkeypatch.undo()
    monkeypatch.setattr(github_intake, "JOIN_WAIT_S", 0.3)
    held = store.intake.claim_work(*key, "another", 10**13, github_intake.CLAIM_GRACE_MS)
    assert store.intake.set_work_ticket(*key, held.claim, "t-not-stored")
    status, doc = await stack.post("issues", labeled)
    assert (status, doc["reason"]) == (503, "scheduler_unavailable") and len(stack.tickets()) == 1
    monkeypatch.setattr(github_intake, "CLAIM_GRACE_MS", -10**13)
    status, doc = await stack.post("issues", labeled)
    assert (status, doc["reason"]) == (202, "ok") and len(stack.tickets()) == 2


class _Writers:
    """The credential broker's write-access answer: everyone may write (not under test here)."""

    async def repo_permission(self, workspace: str, login: str):
        return SimpleNamespace(can_write=True, permission="write")


@pytest.mark.parametrize("fixed", [True, False], ids=["claimed", "positive-control-no-claim"])
def test_two_schedulers_on_one_postgresql_racing_make_one_ticket_per_issue(pg_url, examples, tmp_path, fixed):
    """Two schedulers (each its own store connection, engine and intake, in its
    own thread and event loop) get the events of the same issues at the same
    moment: one the label, the other the assignment, issue after issue. One
    ticket per issue; the other event joined it."""
    labeled, assigned = example(examples, "issues", "labeled"), example(examples, "issues", "assigned")
    config = load_config(write_config(tmp_path / "cfg", labeled["repository"]["full_name"], "http://127.0.0.1:9",
                                      label=labeled["label"]["name"], assignee=assigned["assignee"]["login"]))
    open_store_url(pg_url).close()        # migrate once
    issues = list(range(100, 140))
    start = threading.Barrier(2)
    outcomes: list[list[tuple[str, str]]] = [[], []]
    errors: list[BaseException] = []

    def scheduler(i: int, payload: dict) -> None:
        async def run() -> None:
            store = open_store_url(pg_url, tmp_path / f"s{i}")
            if not fixed:
                mp = pytest.MonkeyPatch()
                old_claims(mp, store)
            engine = Engine(config, store, None, None, Redactor(), recovery_interval=0)
            intake = GitHubIntake(config, store, engine, _Writers())
            try:
                for n in issues:
                    body = json.loads(json.dumps(payload))
                    body["issue"]["number"] = n
                    start.wait()
                    o = await intake.deliver(str(uuid.uuid4()), "issues", json.dumps(body).encode())
                    outcomes[i].append((o.outcome, o.reason))
                engine.events.flush()
            finally:
                await intake.stop()
                store.close()
        try:
            asyncio.run(run())
        except BaseException as exc:   # noqa: BLE001 - reported by the test
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=scheduler, args=(0, labeled)),
               threading.Thread(target=scheduler, args=(1, assigned))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    store = open_store_url(pg_url)
    try:
        per_issue: dict[str, int] = {}
        for t in store.tickets.list(limit=1000):
            per_issue[t.origin["issue"]] = per_issue.get(t.origin["issue"], 0) + 1
        if not fixed:
            assert per_issue == {str(n): 2 for n in issues}
            return
        assert per_issue == {str(n): 1 for n in issues}
        for n in range(len(issues)):
            pair = sorted([outcomes[0][n], outcomes[1][n]])
            assert pair == [("accepted", "ok"), ("duplicate", "joined")], (issues[n], pair)
        # Each issue's ticket names the delivery that joined it.
        for t in store.tickets.list(limit=1000):
            assert len(_joined(store, t.id)) == 1
    finally:
        store.close()
