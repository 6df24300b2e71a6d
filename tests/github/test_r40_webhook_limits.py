"""R40 at the webhook, through the real gateway process: deliveries with a
bad signature from an address are counted in the webhook's own budget
(`--max-bad-webhook-signatures`; past it 429 with Retry-After), yet a
correctly signed delivery from that address is taken, and failures on the
webhook and on the UI/CLI (`--max-failed-logins`) never count against each
other.

Positive controls run the gateway with the old code path put back
(tests/gateway/old_lockout.py: one limiter for every surface, asked before
the signature or token is checked): the signed delivery is refused 429,
after bad signatures and after bad CLI tokens alike."""

from __future__ import annotations

import pytest

from tests.gateway.rpcutil import open_rpc

from .conftest import example

pytestmark = pytest.mark.timeout(120)

BUDGET = 3
OLD = "tests.gateway.old_lockout"


@pytest.fixture
def gateway_flags() -> list[str]:
    return ["--max-bad-webhook-signatures", str(BUDGET), "--max-failed-logins", str(BUDGET)]


async def _bad_signatures(stack, examples, count: int) -> list[int]:
    payload = example(examples, "issues", "labeled")
    return [(await stack.post("issues", payload, signature="sha256=" + "0" * 64))[0] for _ in range(count)]


async def _signed_delivery(stack, examples) -> tuple[int, dict]:
    payload = example(examples, "issues", "labeled")
    stack.github.permissions[payload["sender"]["login"]] = "write"
    return await stack.post("issues", payload)


async def _bad_bearers(stack, count: int) -> list[int]:
    return [(await open_rpc(stack.session, stack.gateway, bearer=f"wrong-{i}"))[0] for i in range(count)]


async def test_r40_a_signed_delivery_passes_after_bad_signatures_from_its_address(stack, examples):
    assert await _bad_signatures(stack, examples, BUDGET) == [401] * BUDGET
    status, doc = await stack.post("issues", example(examples, "issues", "labeled"), signature="sha256=" + "1" * 64)
    assert status == 429 and doc["reason"] == "rate_limited", doc
    assert "secret" in doc["message"]
    status, doc = await _signed_delivery(stack, examples)
    assert status == 202 and doc["reason"] == "ok", doc
    assert len(stack.tickets()) == 1
    # Still over the budget for what is not signed right; each failure counted.
    assert await _bad_signatures(stack, examples, 2) == [429, 429]
    assert await stack.metric("refused", "rate_limited") == 3
    assert await stack.metric("refused", "bad_signature") == BUDGET


async def test_r40_webhook_and_cli_failures_are_counted_apart(stack, examples):
    assert await _bad_bearers(stack, BUDGET + 1) == [401] * BUDGET + [429]
    assert await _bad_signatures(stack, examples, 1) == [401]     # the webhook's budget is untouched
    assert await _bad_signatures(stack, examples, BUDGET) == [401] * (BUDGET - 1) + [429]
    status, ws = await open_rpc(stack.session, stack.gateway, bearer=stack.gateway.token)
    assert status == 101                                          # the CLI's right token gets in
    await ws.close()
    status, doc = await _signed_delivery(stack, examples)
    assert status == 202 and doc["reason"] == "ok", doc


@pytest.mark.parametrize("gateway_module", [OLD])
async def test_r40_positive_control_the_old_limiter_refuses_the_signed_delivery(stack, examples):
    assert await _bad_signatures(stack, examples, BUDGET) == [401] * BUDGET
    status, _ = await _signed_delivery(stack, examples)
    assert status == 429
    assert stack.tickets() == []


@pytest.mark.parametrize("gateway_module", [OLD])
async def test_r40_positive_control_bad_cli_tokens_used_to_block_the_webhook(stack, examples):
    assert await _bad_bearers(stack, BUDGET) == [401] * BUDGET
    status, _ = await _signed_delivery(stack, examples)
    assert status == 429
    assert stack.tickets() == []
