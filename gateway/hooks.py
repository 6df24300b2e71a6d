"""POST /hooks/github: GitHub webhook deliveries (docs/GITHUB.md, R35).

A delivery is passed to the scheduler only when, in this order:
1. it is not over MAX_BODY bytes (read in chunks: a larger body is never
   held, whatever its Content-Length says)                       -> else 413
2. it carries `X-Hub-Signature-256: sha256=<hex>` equal, compared in
   constant time, to the HMAC-SHA256 of the exact raw body under the
   webhook secret (held by the gateway only)                      -> else 401
3. it is JSON (`application/json`)                                 -> else 415
4. its `X-GitHub-Delivery` is a GUID                               -> else 400
5. its `X-GitHub-Event` is subscribed (issues, issue_comment,
   pull_request_review, pull_request_review_comment, and for failing CI
   check_run, check_suite, status; `ping` is answered here)                                                           -> else 400
The scheduler then claims the delivery id in its store: a replayed delivery
is answered 409 and changes nothing. Every refusal is counted in
afe_gateway_github_deliveries_total{outcome,reason}. A missing or wrong
signature counts as a failed credential of the client's address in the
webhook surface's own limiter (R38): past its budget the answer is 429 with
Retry-After instead of 401. The signature is checked before the limiter is
asked, so a correctly signed delivery is never refused for other senders'
failures, nor for failed UI/CLI tokens (R40). Nothing of a body is ever
logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from services.common.errors import AfeError, Unavailable
from services.common.observability.metrics import github_deliveries
from services.common.secrecy.env_secrets import SecretValue

from .backend import SchedulerBackend
from .ratelimit import FailureLimiter, retry_after_header

log = logging.getLogger(__name__)

PATH = "/hooks/github"
MAX_BODY = 1024 * 1024              # GitHub caps payloads at 25 MB; issue events are a few KiB
SUBSCRIBED = ("issues", "issue_comment", "pull_request_review", "pull_request_review_comment", "check_run",
              "check_suite", "status")
DELIVERY_ID = re.compile(r"^[A-Za-z0-9-]{1,100}$")
SIGNATURE = re.compile(r"^sha256=([0-9a-f]{64})$")
STATUS = {"accepted": 202, "ignored": 202, "refused": 202, "duplicate": 409}


def sign(secret: bytes, body: bytes) -> str:
    """The X-Hub-Signature-256 value GitHub sends for `body`."""
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


class GitHubWebhook:
    def __init__(self, secret: SecretValue, backend: SchedulerBackend, limiter: FailureLimiter,
                 registry: CollectorRegistry | None = None) -> None:
        self._secret = secret
        self.backend = backend
        self.limiter = limiter
        self.metrics = github_deliveries(registry, "gateway") if registry is not None else None

    def _answer(self, status: int, outcome: str, reason: str, message: str,
                extra: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> web.Response:
        if self.metrics is not None:
            self.metrics.labels(outcome=outcome, reason=reason).inc()
        return web.json_response({"outcome": outcome, "reason": reason, "message": message, **(extra or {})},
                                 status=status, headers=headers)

    async def _read(self, request: web.Request) -> bytes | None:
        """The raw body, or None once it passes MAX_BODY (never holding more)."""
        if request.content_length is not None and request.content_length > MAX_BODY:
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = await request.content.read(64 * 1024)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > MAX_BODY:
                return None
            chunks.append(chunk)

    def _bad_signature(self, request: web.Request, reason: str) -> web.Response:
        """401, or 429 once the client's address is past the webhook surface's budget."""
        client = request.remote or "unknown"
        wait = self.limiter.failed(client)
        if wait > 0:
            return self._answer(429, "refused", "rate_limited", "too many deliveries with a bad signature "
                                "from this address; check the webhook's secret, then redeliver later",
                                headers=retry_after_header(wait))
        if reason == "no_signature":
            return self._answer(401, "refused", "no_signature", "X-Hub-Signature-256 is missing or malformed; "
                                "set the webhook's secret on GitHub")
        log.info("github delivery refused: bad signature (delivery %s)",
                 _safe_id(request.headers.get("X-GitHub-Delivery", "")))
        return self._answer(401, "refused", "bad_signature", "the signature does not match; the webhook's "
                            "secret on GitHub must equal the gateway's AFE_GITHUB_WEBHOOK_SECRET")

    async def handle(self, request: web.Request) -> web.Response:
        body = await self._read(request)
        if body is None:
            return self._answer(413, "refused", "too_large", f"the body is over {MAX_BODY} bytes")
        presented = request.headers.get("X-Hub-Signature-256", "")
        m = SIGNATURE.match(presented.strip().lower())
        expected = hmac.new(self._secret.reveal().encode(), body, hashlib.sha256).hexdigest()
        if m is None or not hmac.compare_digest(expected, m.group(1)):
            return self._bad_signature(request, "no_signature" if m is None else "bad_signature")
        if request.content_type != "application/json":
            return self._answer(415, "refused", "bad_content_type", "set the webhook's content type to "
                                "application/json on GitHub")
        delivery = request.headers.get("X-GitHub-Delivery", "")
        if not DELIVERY_ID.match(delivery):
            return self._answer(400, "refused", "bad_delivery_id", "X-GitHub-Delivery is missing or malformed")
        event = request.headers.get("X-GitHub-Event", "")
        if event == "ping":
            return self._answer(200, "accepted", "ping", "pong")
        if event not in SUBSCRIBED:
            log.info("github delivery %s refused: event type %s is not subscribed", delivery, _safe_id(event))
            return self._answer(400, "refused", "unsubscribed_event", "afe acts on the issues, issue_comment, "
                                "pull_request_review, pull_request_review_comment, check_run, check_suite and "
                                "status events only; unselect the "
                                "others in the webhook's settings on GitHub")
        try:
            result = await self.backend.deliver_github(delivery, event, body)
        except Unavailable:
            return self._answer(503, "refused", "scheduler_unavailable", "afe's scheduler is not reachable; "
                                "redeliver later", headers={"Retry-After": "30"})
        except AfeError as exc:
            log.warning("github delivery %s: the scheduler refused it: %s", delivery, exc)
            return self._answer(503, "refused", "scheduler_unavailable", "afe could not take the delivery; "
                                "redeliver later")
        reason = result["reason"] if result["reason"] in _REASONS else "bad_payload"
        outcome = result["outcome"] if result["outcome"] in STATUS else "refused"
        # A delivery that joined a live ticket is a new delivery, taken: 202, not a replay's 409.
        status = 202 if reason == "joined" else STATUS[outcome]
        return self._answer(status, outcome, reason, _MESSAGES.get(reason, reason),
                            {"tickets": result["ticket_ids"]})


def _safe_id(value: str) -> str:
    """A header value fit for a log line: a GUID or event name, else a placeholder."""
    return value if re.match(r"^[A-Za-z0-9_.-]{1,100}$", value) else "(malformed)"


_MESSAGES = {
    "ok": "ticket created", "duplicate": "this delivery was handled before; nothing changed",
    "no_trigger": "no Trigger matches this event", "bot": "events by bots start nothing",
    "pull_request": "comments on pull requests start nothing",
    "no_write_access": "only people with write access to the repository can start work",
    "permission_unknown": "write access could not be checked; nothing was started",
    "invalid_ticket": "the Trigger could not create a ticket; see the scheduler's log",
    "unsubscribed_event": "event type not subscribed", "bad_payload": "the payload is not a GitHub event",
    "bad_delivery_id": "X-GitHub-Delivery is malformed",
    "followup": "a follow-up of the pull request's ticket started",
    "not_afe_pull_request": "afe did not open this pull request (or it is not a review asking for changes)",
    "busy": "the pull request's ticket cannot be re-opened (its pull request is merged, or its workflow is gone); "
            "nothing was started",
    "joined": "this work has a live ticket already; the event was added to it",
    "gathered": "added to the follow-up of the pull request's ticket that is about to run",
    "queued": "the pull request's ticket is running; this follow-up runs once it waits for approval or ends",
    "passing": "not a failing check or status; nothing to do",
    "own_check": "afe's own status or check; it starts nothing",
    "stale_head": "not the pull request's current head; nothing to do",
    "merged": "the pull request is merged; nothing to do",
    "no_ci_iteration": "the ticket's workflow has no on_ci_failure: the failure is noted on the ticket, no round",
    "past_max": "the ticket had its on_ci_failure rounds: no round; a comment asks a person to look",
}
_REASONS = set(_MESSAGES)
