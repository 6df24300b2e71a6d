"""No event lost on odd bytes (R35): a correctly signed delivery whose JSON
spells a lone surrogate (`\\ud800`) makes its ticket once, with U+FFFD in
place of the surrogate; a redelivery is a duplicate; no text of the body
reaches a log. And a delivery whose handling failed (503, "redeliver later")
is not recorded as seen, so its redelivery is handled instead of being
answered 409.

Positive controls put back the old code path (json.loads as it was, the
claim kept on failure) and show the event lost: 503, then 409 on the
redelivery. (That failure's log line once carried the issue's text, through
the exception's repr; the gRPC boundary logs no repr any more, see
tests/foundation/test_guard_logs.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid

import pytest

from services.common.errors import AfeError
from services.scheduler.github import intake as github_intake

from .conftest import example

pytestmark = pytest.mark.timeout(120)

TITLE_MARK = "TitleMarkQ7"
BODY_MARK = "BodyMarkZ3"


def _odd_delivery(examples) -> tuple[bytes, str]:
    """issues.labeled as GitHub sends it, with a lone surrogate escape in its title and body."""
    e = example(examples, "issues", "labeled")
    e["issue"]["title"] = f"{TITLE_MARK} broken"
    e["issue"]["body"] = f"{BODY_MARK} steps"
    text = json.dumps(e)
    for mark in (TITLE_MARK, BODY_MARK):
        text = text.replace(mark, mark + "\\ud800")
    assert "\\ud800" in text
    return text.encode(), e["sender"]["login"]


def _old_decoding(payload: bytes):
    """What deliver() did before: json.loads of the raw bytes, surrogates and all."""
    try:
        data = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _claim_kept(store, key, delivery_id, event):
    """What deliver() did before on a failure: nothing (the claim stayed)."""
    return contextlib.nullcontext()


def _logs(stack, caplog) -> str:
    return stack.gateway.logs() + caplog.text


async def test_r35_a_lone_surrogate_in_a_signed_delivery_makes_one_ticket_and_logs_no_text(stack, examples,
                                                                                           caplog):
    caplog.set_level(logging.DEBUG)
    body, sender = _odd_delivery(examples)
    stack.github.permissions[sender] = "write"
    delivery = str(uuid.uuid4())
    status, doc = await stack.post("issues", body, delivery=delivery)
    assert status == 202 and doc["outcome"] == "accepted" and doc["reason"] == "ok", doc
    [ticket] = stack.tickets()
    assert f"{TITLE_MARK}\ufffd broken" in ticket.title
    assert ticket.body == f"{BODY_MARK}\ufffd steps"
    assert ticket.inputs["issue"] == f"{BODY_MARK}\ufffd steps"
    status, doc = await stack.post("issues", body, delivery=delivery)
    assert status == 409 and doc["reason"] == "duplicate", doc
    assert len(stack.tickets()) == 1
    logs = _logs(stack, caplog)
    assert delivery in logs                                  # the logs were read: they name the delivery
    assert TITLE_MARK not in logs and BODY_MARK not in logs


async def test_r35_positive_control_the_old_decoding_loses_the_event(stack, examples, monkeypatch):
    monkeypatch.setattr(github_intake, "decode_payload", _old_decoding)
    monkeypatch.setattr(github_intake, "unclaimed_on_failure", _claim_kept)
    body, sender = _odd_delivery(examples)
    stack.github.permissions[sender] = "write"
    delivery = str(uuid.uuid4())
    status, doc = await stack.post("issues", body, delivery=delivery)
    assert status == 503 and "redeliver" in doc["message"], doc
    status, doc = await stack.post("issues", body, delivery=delivery)
    assert status == 409 and doc["reason"] == "duplicate", doc
    assert stack.tickets() == []


def _fail_once(monkeypatch, stack) -> list[str]:
    """Ticket creation raises once, with the issue's text in the exception."""
    intake = stack.scheduler.intake
    create = intake._create
    failures: list[str] = []

    def flaky(tr, ws, event, action, data, issue, *rest):
        if not failures:
            failures.append(issue["title"])
            raise RuntimeError(f"cannot file {issue['title']!r}")
        return create(tr, ws, event, action, data, issue, *rest)
    monkeypatch.setattr(intake, "_create", flaky)
    return failures


async def test_r35_a_delivery_whose_handling_failed_is_handled_on_redelivery(stack, examples, caplog,
                                                                             monkeypatch):
    caplog.set_level(logging.DEBUG)
    failures = _fail_once(monkeypatch, stack)
    payload = example(examples, "issues", "labeled")
    payload["issue"]["title"] = f"{TITLE_MARK} fails once"
    stack.github.permissions[payload["sender"]["login"]] = "write"
    delivery = str(uuid.uuid4())
    status, doc = await stack.post("issues", payload, delivery=delivery)
    assert status == 503 and "redeliver" in doc["message"], doc
    assert failures == [f"{TITLE_MARK} fails once"]
    status, doc = await stack.post("issues", payload, delivery=delivery)
    assert status == 202 and doc["reason"] == "ok", doc
    assert len(stack.tickets()) == 1
    status, doc = await stack.post("issues", payload, delivery=delivery)
    assert status == 409, doc                                # handled now: a further replay is a duplicate
    logs = _logs(stack, caplog)
    assert f"github delivery {delivery} (issues) failed: RuntimeError at" in logs
    assert TITLE_MARK not in logs


async def test_r35_positive_control_a_failed_delivery_kept_as_seen_is_lost(stack, examples, monkeypatch):
    monkeypatch.setattr(github_intake, "unclaimed_on_failure", _claim_kept)
    _fail_once(monkeypatch, stack)
    payload = example(examples, "issues", "labeled")
    stack.github.permissions[payload["sender"]["login"]] = "write"
    delivery = str(uuid.uuid4())
    status, _ = await stack.post("issues", payload, delivery=delivery)
    assert status == 503
    status, doc = await stack.post("issues", payload, delivery=delivery)
    assert status == 409 and doc["reason"] == "duplicate", doc
    assert stack.tickets() == []



async def _cancelled_then_redelivered(stack, examples, monkeypatch):
    """The gateway gave up (its deadline passed, so it answered 503) while the scheduler
    waited on the write-access check, and grpc cancelled the handler; then GitHub redelivers."""
    intake = stack.scheduler.intake
    asked, never = asyncio.Event(), asyncio.Event()
    lookup = intake.credentials.repo_permission

    async def stuck(workspace, login):
        asked.set()
        await never.wait()
    monkeypatch.setattr(intake.credentials, "repo_permission", stuck)
    payload = example(examples, "issues", "labeled")
    stack.github.permissions[payload["sender"]["login"]] = "write"
    body, delivery = json.dumps(payload).encode(), str(uuid.uuid4())
    first = asyncio.ensure_future(intake.deliver(delivery, "issues", body))
    await asked.wait()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    monkeypatch.setattr(intake.credentials, "repo_permission", lookup)
    return await intake.deliver(delivery, "issues", body)


async def test_r35_a_delivery_cancelled_mid_way_is_handled_on_redelivery(stack, examples, monkeypatch):
    again = await _cancelled_then_redelivered(stack, examples, monkeypatch)
    assert (again.outcome, again.reason) == ("accepted", "ok")
    assert len(stack.tickets()) == 1


async def test_r35_positive_control_a_cancelled_delivery_kept_as_seen_is_lost(stack, examples, monkeypatch):
    monkeypatch.setattr(github_intake, "unclaimed_on_failure", _claim_kept)
    again = await _cancelled_then_redelivered(stack, examples, monkeypatch)
    assert (again.outcome, again.reason) == ("duplicate", "duplicate")
    assert stack.tickets() == []


async def _poll_odd_event(stack, examples) -> None:
    """Polling (services/scheduler/github/poll.py): a new labelled-issue event whose
    title and body hold a lone surrogate, as GitHub's events API would escape it."""
    from services.scheduler.github.poll import Poller

    from .test_polling import _event

    stack.github.permissions[example(examples, "issues", "labeled")["sender"]["login"]] = "write"
    ws = stack.scheduler.engine.config.workspaces["hello"]
    poller = Poller(stack.scheduler.intake, interval_s=1)
    stack.github.events = [_event(1, examples)]
    await poller.poll_once(ws)                                 # the first poll only sets the cursor
    odd = _event(2, examples)
    odd["payload"]["issue"]["title"] = f"{TITLE_MARK}\ud800 polled"
    odd["payload"]["issue"]["body"] = f"{BODY_MARK}\ud800 polled"
    stack.github.events.insert(0, odd)
    await poller.poll_once(ws)


async def test_r35_a_polled_event_with_a_lone_surrogate_makes_its_ticket(stack, examples):
    await _poll_odd_event(stack, examples)
    [ticket] = stack.tickets()
    assert f"{TITLE_MARK}\ufffd polled" in ticket.title and ticket.body == f"{BODY_MARK}\ufffd polled"


async def test_r35_positive_control_the_old_decoding_makes_no_ticket_from_the_polled_event(stack, examples,
                                                                                          monkeypatch):
    monkeypatch.setattr(github_intake, "decode_payload", _old_decoding)
    with contextlib.suppress(UnicodeEncodeError, AfeError):    # the old path failed inside ticket creation
        await _poll_odd_event(stack, examples)
    assert stack.tickets() == []
