"""The polling mode: conditional requests for the repository's events through
the credential broker, a stored cursor, the same Trigger path as webhooks."""

from __future__ import annotations

import pytest

from services.scheduler.github_poll import Poller
from services.scheduler.sqlite_store import SqliteStore

from .conftest import example

pytestmark = pytest.mark.timeout(120)


def _event(n: int, examples, kind: str = "labeled") -> dict:
    """A repository event (GET /repos/{o}/{r}/events) made from GitHub's webhook example."""
    e = example(examples, "issues", kind)
    payload = {k: e[k] for k in ("action", "issue", "label", "assignee") if k in e}
    return {"id": str(1000 + n), "type": "IssuesEvent", "actor": {"login": e["sender"]["login"]},
            "repo": {"name": e["repository"]["full_name"]}, "payload": payload, "public": True,
            "created_at": "2026-01-01T00:00:00Z"}


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
    reopened = SqliteStore(path)
    try:
        assert reopened.poll_cursor("hello")[1] == "1002"
    finally:
        reopened.close()
    stack.github.events.insert(0, _event(3, examples, "assigned"))
    outcomes, _ = await poller.poll_once(ws)
    assert [o.outcome for o in outcomes] == ["accepted"] and len(stack.tickets()) == 2
    # The same events again (e.g. a changed ETag but nothing new): nothing happens.
    stack.github.events.append({**_event(0, examples), "public": False})
    outcomes, _ = await poller.poll_once(ws)
    assert outcomes == [] and len(stack.tickets()) == 2


async def test_polling_waits_out_a_rate_limit(stack, examples):
    ws = stack.scheduler.engine.config.workspaces["hello"]
    poller = Poller(stack.scheduler.intake, interval_s=1)
    stack.github.fail_next(403, '{"message": "API rate limit exceeded"}',
                           {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "4102444800"}, times=8)
    outcomes, wait = await poller.poll_once(ws)
    assert outcomes == [] and wait > 3600                      # until the reset GitHub named


def test_openapi_check_flags_undocumented_calls(openapi):
    """Positive control for the fake's OpenAPI check: it is not a check that passes everything."""
    assert openapi.problem("GET", "/repos/o/r/collaborators/u/permission", "", b"") is None
    assert openapi.problem("GET", "/repos/o/r/events", "per_page=100", b"") is None
    assert openapi.problem("POST", "/repos/o/r/issues/1/comments", "", b'{"body": "x"}') is None
    assert openapi.problem("POST", "/repos/o/r/issues/1/comments", "", b'{"text": "x"}') is not None
    assert openapi.problem("GET", "/repos/o/r/collaborators/u/permissions", "", b"") is not None
    assert openapi.problem("DELETE", "/repos/o/r/events", "", b"") is not None
