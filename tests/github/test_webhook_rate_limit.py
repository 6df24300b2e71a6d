"""Webhook mode under GitHub's rate limit: a delivery whose sender's write
access cannot be checked yet (the permission lookup answered 403 with
X-RateLimit-Remaining: 0) is answered 503 and not recorded as seen, so
GitHub's "Redeliver" after the reset makes its ticket. Positive controls:
the old answers (refused as permission_unknown, or the claim kept) use the
delivery up, and the redelivery makes nothing."""

from __future__ import annotations

import pytest

from .conftest import example
from .old_intake import old_behaviour

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("old", ["", "refused", "claim-kept"],
                         ids=["fixed", "positive-control-refused-as-permission-unknown", "positive-control-claim-kept"])
async def test_a_delivery_refused_by_the_rate_limit_makes_its_ticket_when_redelivered(stack, examples, monkeypatch,
                                                                                     old):
    payload = example(examples, "issues", "labeled")
    stack.github.permissions[payload["sender"]["login"]] = "write"
    old_behaviour(monkeypatch, stack.scheduler.store, old)
    stack.github.rate_remaining = 0
    first, _ = await stack.post("issues", payload, delivery="d-limited-1")
    assert first == (202 if old == "refused" else 503) and stack.tickets() == []
    stack.github.rate_remaining = 5000                       # the reset came; the operator redelivers
    again, doc = await stack.post("issues", payload, delivery="d-limited-1")
    if old:
        assert again == 409 and stack.tickets() == []
    else:
        assert again == 202 and len(doc["tickets"]) == 1 and len(stack.tickets()) == 1
