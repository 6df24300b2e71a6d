"""The polling mode: conditional requests for the repository's events through
the credential broker, a stored cursor, the same Trigger path as webhooks.
Polling loses nothing: not the first event after an empty first poll, not a
burst longer than a page; and it asks GitHub no sooner than GitHub allows
(X-Poll-Interval, X-RateLimit-Reset, Retry-After), also after a restart.
Each of these has its positive control: the old behaviour restored shows
the event lost or the request sent early."""

from __future__ import annotations

import dataclasses

import pytest

from services.credentials import httpclient
from services.credentials.forges import github_events
from services.scheduler.github import poll as github_poll
from services.scheduler.github.poll import NOTHING_SEEN, Poller
from services.scheduler.store.store import Store
from tests.support.retry_rules import capped_next_wait

from .conftest import example
from .old_intake import old_behaviour

pytestmark = pytest.mark.timeout(120)


def _event(n: int, examples, kind: str = "labeled", number: int | None = None) -> dict:
    """A repository event (GET /repos/{o}/{r}/events) made from GitHub's webhook example
    (of another issue than the example's with `number`)."""
    e = example(examples, "issues", kind)
    if number is not None:
        e["issue"]["number"] = number
    payload = {k: e[k] for k in ("action", "issue", "label", "assignee") if k in e}
    return {"id": str(1000 + n), "type": "IssuesEvent", "actor": {"login": e["sender"]["login"]},
            "repo": {"name": e["repository"]["full_name"]}, "payload": payload, "public": True,
            "created_at": "2026-01-01T00:00:00Z"}


def _star(n: int, examples) -> dict:
    """A repository event that starts nothing (WatchEvent: someone starred the repository)."""
    return {**_event(n, examples), "type": "WatchEvent", "payload": {"action": "started"}}


class Clock:
    """The poller's clock, moved by the test (the fake GitHub keeps real time)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _asked(github) -> int:
    """Requests for the repository's events GitHub has seen so far."""
    return sum(1 for x in github.seen if x.path.endswith("/events"))


def _setup(stack, examples, monkeypatch) -> tuple:
    """The stack's Trigger with `poll: true`, a writer labelling, and a poller on a clock of the test's."""
    stack.github.permissions[example(examples, "issues", "labeled")["sender"]["login"]] = "write"
    intake = stack.scheduler.intake
    polled = {n: dataclasses.replace(t, poll=True) for n, t in intake.config.triggers.items()}
    monkeypatch.setattr(intake, "config", dataclasses.replace(intake.config, triggers=polled))
    ws = stack.scheduler.engine.config.workspaces["hello"]
    clock = Clock(float(stack.github.rate_reset - 3000))       # 50 min before GitHub's reset
    return ws, clock, Poller(stack.scheduler.intake, interval_s=1, clock=clock)


async def test_polling_starts_from_now_uses_etags_and_keeps_its_cursor_across_restarts(stack, examples):
    sender = example(examples, "issues", "labeled")["sender"]["login"]
    stack.github.permissions[sender] = "write"
    ws = stack.scheduler.engine.config.workspaces["hello"]
    poller = Poller(stack.scheduler.intake, interval_s=1)
    stack.github.events = [_event(1, examples)]              # history before afe started
    outcomes, wait = await poller.poll_once(ws)
    assert outcomes == [] and stack.tickets() == []            # the first poll only sets the cursor
    assert wait >= 60                                          # X-Poll-Interval is honoured
    # Nothing new: a conditional request, answered 304.
    outcomes, _ = await poller.poll_once(ws)
    assert outcomes == []
    assert stack.github.seen[-1].headers.get("If-None-Match") == stack.github.events_etag()
    # A new labelled issue event: one ticket, marked untrusted like a webhook's.
    stack.github.events.insert(0, _event(2, examples))
    outcomes, _ = await poller.poll_once(ws)
    assert [o.outcome for o in outcomes] == ["accepted"]
    (t,) = stack.tickets()
    assert t.origin["delivery_id"] == "poll:1002" and t.origin["body_untrusted"]
    # A restarted scheduler (a new store object on the same file) neither replays nor skips.
    path = stack.scheduler.store.path
    reopened = Store.sqlite(path)
    try:
        assert reopened.intake.poll_cursor("hello").last_event_id == "1002"
    finally:
        reopened.close()
    stack.github.events.insert(0, _event(3, examples, "assigned", number=3))    # issue #1 has a live ticket
    outcomes, _ = await poller.poll_once(ws)
    assert [o.outcome for o in outcomes] == ["accepted"] and len(stack.tickets()) == 2
    # The same events again (e.g. a changed ETag but nothing new): nothing happens.
    stack.github.events.append({**_event(0, examples), "public": False})
    outcomes, _ = await poller.poll_once(ws)
    assert outcomes == [] and len(stack.tickets()) == 2


@pytest.mark.parametrize("nothing_seen", [github_poll.NOTHING_SEEN, ""],
                         ids=["fixed", "positive-control-old-empty-cursor"])
async def test_the_first_event_after_an_empty_first_poll_becomes_a_ticket(stack, examples, monkeypatch,
                                                                         nothing_seen):
    monkeypatch.setattr(github_poll, "NOTHING_SEEN", nothing_seen)
    ws, _, poller = _setup(stack, examples, monkeypatch)
    assert (await poller.poll_once(ws))[0] == []             # a repository without events yet
    stack.github.events.insert(0, _event(1, examples))
    outcomes, _ = await poller.poll_once(ws)
    if nothing_seen:
        assert [o.outcome for o in outcomes] == ["accepted"] and len(stack.tickets()) == 1
    else:   # the cursor as before: "" reads as "never listed", so this listing only set it
        assert outcomes == [] and stack.tickets() == []


@pytest.mark.parametrize("old_rule", [False, True], ids=["fixed", "positive-control-capped-retries"])
async def test_a_primary_rate_limit_is_asked_once_and_waited_out(stack, examples, monkeypatch, old_rule):
    if old_rule:
        monkeypatch.setattr(httpclient, "next_wait", capped_next_wait)
    ws, clock, poller = _setup(stack, examples, monkeypatch)
    gh = stack.github
    await poller.poll_once(ws)
    gh.rate_remaining = 0                                      # 403 "API rate limit exceeded" until the reset
    gh.events.insert(0, _event(1, examples))
    before = _asked(gh)
    outcomes, wait = await poller.poll_once(ws)
    if old_rule:    # the broker's client asked again and again, 50 min before the reset
        assert _asked(gh) - before == 4
        return
    assert _asked(gh) - before == 1 and outcomes == []
    assert poller.cursor("hello").next_poll_ms == gh.rate_reset * 1000 and wait == 3000
    assert await poller.poll_due() == [] and _asked(gh) - before == 1
    clock.t = gh.rate_reset + 1.0                              # the reset has come
    gh.rate_remaining = 5000
    assert await poller.poll_due() == ["hello"]
    assert len(stack.tickets()) == 1                           # the event that came while limited


@pytest.mark.parametrize("forget", [False, True], ids=["fixed", "positive-control-store-without-next-poll"])
async def test_a_restarted_poller_does_not_ask_before_the_stored_time(stack, examples, monkeypatch, forget):
    ws, clock, poller = _setup(stack, examples, monkeypatch)
    gh, intake = stack.github, stack.scheduler.intake
    await poller.poll_once(ws)
    gh.secondary_limit(600)
    await poller.poll_once(ws)
    # The scheduler restarts: its store opened again from the file, a new poller.
    reopened = Store.sqlite(stack.scheduler.store.path)
    try:
        assert reopened.intake.poll_cursor("hello").next_poll_ms == int(clock.t * 1000) + 600_000
        if forget:      # the store before migration 0008 kept no next poll
            read = reopened.intake.poll_cursor
            monkeypatch.setattr(reopened.intake, "poll_cursor",
                                lambda w: dataclasses.replace(read(w), next_poll_ms=0))
        monkeypatch.setattr(intake, "store", reopened)
        before = _asked(gh)
        polled = await Poller(intake, interval_s=1, clock=clock).poll_due()
        assert (polled, _asked(gh) - before) == ((["hello"], 1) if forget else ([], 0))
    finally:
        monkeypatch.undo()
        reopened.close()


@pytest.mark.parametrize("old", ["", "refused", "claim-kept"],
                         ids=["fixed", "positive-control-refused-as-permission-unknown", "positive-control-claim-kept"])
async def test_an_event_whose_handling_hits_the_limit_becomes_a_ticket_after_the_reset(stack, examples, monkeypatch,
                                                                                       old):
    ws, clock, poller = _setup(stack, examples, monkeypatch)
    gh, store = stack.github, stack.scheduler.store
    await poller.poll_once(ws)
    gh.events.insert(0, _event(1, examples))
    gh.rate_remaining = 1           # the listing is the hour's last request: the permission lookup gets 403
    old_behaviour(monkeypatch, store, old)
    clock.t += 60                   # X-Poll-Interval
    assert await poller.poll_due() == ["hello"] and stack.tickets() == []
    cursor = poller.cursor("hello")
    assert cursor.next_poll_ms == gh.rate_reset * 1000
    assert old == "refused" or cursor.last_event_id == NOTHING_SEEN     # the event is still ahead of the cursor
    clock.t = gh.rate_reset + 1.0
    gh.rate_remaining = 5000
    assert await poller.poll_due() == ["hello"]
    assert len(stack.tickets()) == (0 if old else 1)


LIMITS = [
    # (case, what GitHub answers, seconds until the next poll; None: until X-RateLimit-Reset)
    ("X-Poll-Interval 120", lambda gh: setattr(gh, "poll_interval", 120), 120),
    ("secondary limit, Retry-After 600", lambda gh: gh.secondary_limit(600), 600),
    ("secondary limit as 429, Retry-After 90", lambda gh: gh.secondary_limit(90, status=429), 90),
    ("secondary limit naming no time: at least a minute", lambda gh: gh.secondary_limit(None), 60),
    ("the hour's last request (X-RateLimit-Remaining 0 on a 200)", lambda gh: setattr(gh, "rate_remaining", 1), None),
]


@pytest.mark.parametrize(("case", "answer", "expected"), LIMITS, ids=[c[0] for c in LIMITS])
async def test_the_next_poll_waits_as_long_as_github_says(stack, examples, monkeypatch, case, answer, expected):
    ws, clock, poller = _setup(stack, examples, monkeypatch)
    await poller.poll_once(ws)
    stack.github.events.insert(0, _star(1, examples))          # a change, so no 304
    cursor = poller.cursor("hello")
    answer(stack.github)
    _, wait = await poller.poll_once(ws)
    assert wait == (expected if expected is not None else stack.github.rate_reset - clock.t), case
    after = poller.cursor("hello")
    assert after.next_poll_ms == int(clock.t * 1000 + wait * 1000)
    if stack.github.secondary is not None:                     # limited: the cursor stays where it was
        assert (after.etag, after.last_event_id) == (cursor.etag, cursor.last_event_id)


@pytest.mark.parametrize("pages", [github_events.MAX_EVENT_PAGES, 1], ids=["fixed", "positive-control-first-page-only"])
async def test_a_burst_longer_than_a_page_loses_nothing(stack, examples, monkeypatch, pages):
    monkeypatch.setattr(github_events, "MAX_EVENT_PAGES", pages)
    ws, _, poller = _setup(stack, examples, monkeypatch)
    stack.github.events = [_event(0, examples)]
    await poller.poll_once(ws)
    starred = [_star(n, examples) for n in range(2, 152)]
    # Newest first: 150 stars, then the labelled issue (on the second page of 100), then the history.
    stack.github.events = [*starred[::-1], _event(1, examples), *stack.github.events]
    outcomes, _ = await poller.poll_once(ws)
    if pages > 1:
        assert len(outcomes) == 151 and len(stack.tickets()) == 1
        assert poller.cursor("hello").last_event_id == "1151"
    else:
        assert len(outcomes) == 100 and stack.tickets() == []


def test_openapi_check_flags_undocumented_calls(openapi):
    """Positive control for the fake's OpenAPI check: it is not a check that passes everything."""
    assert openapi.problem("GET", "/repos/o/r/collaborators/u/permission", "", b"") is None
    assert openapi.problem("GET", "/repos/o/r/events", "per_page=100", b"") is None
    assert openapi.problem("GET", "/repos/o/r/events", "per_page=100&page=2", b"") is None
    assert openapi.problem("POST", "/repos/o/r/issues/1/comments", "", b'{"body": "x"}') is None
    assert openapi.problem("POST", "/repos/o/r/issues/1/comments", "", b'{"text": "x"}') is not None
    assert openapi.problem("GET", "/repos/o/r/collaborators/u/permissions", "", b"") is not None
    assert openapi.problem("DELETE", "/repos/o/r/events", "", b"") is not None
