"""The HTTP client never asks a server again before the time it named
(`Retry-After`, GitHub's `X-RateLimit-Reset` with `X-RateLimit-Remaining: 0`)
and never waits longer than the caller's RetryPolicy allows: such an answer
goes back to the caller at once. Against a real HTTP server (the GitHub fake).

Positive control: the client's old wait rule (the named time capped at
`max_wait_s`, then another try) asks again long before the named time."""

from __future__ import annotations

import time

import pytest

from services.common.errors import ResourceExhausted
from services.common.secrecy.redact import Redactor
from services.credentials import httpclient
from services.credentials.httpclient import HttpClient, Response, RetryPolicy
from tests.support.fakes.github import FakeGitHub
from tests.support.retry_rules import capped_next_wait

pytestmark = pytest.mark.timeout(60)

TOKEN = "ghp_" + "L" * 36
# The caller accepts waits of up to 50 ms: anything a server names beyond that is the caller's to schedule.
SHORT = RetryPolicy(attempts=4, backoff_s=0.01, max_wait_s=0.05)
SCHEDULES_LIMITS = RetryPolicy(attempts=4, backoff_s=0.01, max_wait_s=0.05, retry_limits=False)


def _in_an_hour() -> str:
    return str(int(time.time()) + 3600)


# (case, status, headers, policy, requests GitHub sees, final status)
CASES = [
    ("primary limit, reset in an hour", 403, lambda: {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": _in_an_hour()},
     SHORT, 1, 403),
    ("secondary limit, Retry-After 120 s", 403, lambda: {"Retry-After": "120"}, SHORT, 1, 403),
    ("429, Retry-After 120 s", 429, lambda: {"Retry-After": "120"}, SHORT, 1, 429),
    ("429, Retry-After within the caller's wait", 429, lambda: {"Retry-After": "0"}, SHORT, 2, 200),
    ("secondary limit, but the caller schedules limits itself", 403, lambda: {"Retry-After": "0"},
     SCHEDULES_LIMITS, 1, 403),
    ("a 502 is still retried for a caller that schedules limits", 502, dict, SCHEDULES_LIMITS, 2, 200),
]


async def _once(status: int, headers: dict[str, str], policy: RetryPolicy) -> tuple[int, int, Response, HttpClient]:
    async with FakeGitHub(TOKEN) as gh:
        gh.fail_next(status, '{"message": "API rate limit exceeded for user ID 1."}', headers)
        client = HttpClient(Redactor(), retry=RetryPolicy(attempts=4, backoff_s=0.01, max_wait_s=30.0))
        try:
            resp = await client.request("GET", f"{gh.url}/repos/{gh.repo}/pulls",
                                        headers={"Authorization": f"Bearer {TOKEN}"}, retry=policy, what="test")
        finally:
            await client.close()
        return len(gh.seen), resp.status, resp, client


@pytest.mark.parametrize(("case", "status", "headers", "policy", "requests", "final"), CASES,
                         ids=[c[0] for c in CASES])
async def test_no_request_before_the_time_the_server_named(case, status, headers, policy, requests, final):
    seen, got, _, _ = await _once(status, headers(), policy)
    assert (seen, got) == (requests, final), case


@pytest.mark.parametrize(("case", "status", "headers", "policy"),
                         [c[:4] for c in CASES[:3]], ids=[c[0] for c in CASES[:3]])
async def test_positive_control_the_old_rule_asks_again_before_the_named_time(monkeypatch, case, status, headers,
                                                                             policy):
    monkeypatch.setattr(httpclient, "next_wait", capped_next_wait)
    seen, got, _, _ = await _once(status, headers(), policy)
    assert (seen, got) == (2, 200), case      # asked again 50 ms later, the named time minutes away


async def test_a_rate_limited_403_is_resource_exhausted_not_a_missing_permission():
    _, _, resp, client = await _once(403, {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": _in_an_hour()}, SHORT)
    err = client.error(resp, "GitHub repository events", hint_auth="check the token")
    assert isinstance(err, ResourceExhausted) and "check the token" not in str(err)
    assert "rate limited" in str(err) and "next request in" in str(err)
