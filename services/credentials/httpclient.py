"""One HTTP client for the forge and model APIs: timeouts, retries with
back-off on 5xx and rate limits honouring `Retry-After`, and errors turned
into clear, redacted AfeErrors. Secrets travel only in the headers the
caller passes (R14); nothing here logs a header.

A server that names a time (`Retry-After`, GitHub's `X-RateLimit-Reset`)
is never asked again before it: when that time is further off than the
caller's `RetryPolicy.max_wait_s`, the answer goes back to the caller at
once instead of being retried early (which only spends attempts and, on
GitHub, risks the integration being blocked).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import random
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from services.common.errors import (
    AfeError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from services.common.host.proxies import proxy_for
from services.common.secrecy.redact import Redactor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """How long one request may keep the caller waiting. A request can override
    the client's policy (`HttpClient.request(retry=...)`)."""

    attempts: int = 4
    backoff_s: float = 0.5          # first back-off after a 5xx or a lost connection; doubles each time
    max_wait_s: float = 60.0        # the longest single wait: a server asking for longer gets its answer returned
    retry_limits: bool = True       # False: a rate-limit answer is returned at once (the caller schedules the next try)


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]
    body: Any                       # parsed JSON, or text when not JSON

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def retry_after_s(headers: dict[str, str], now: float | None = None) -> float | None:
    value = headers.get("retry-after")
    if value:
        value = value.strip()
        if value.isdigit():
            return float(value)
        try:
            when = email.utils.parsedate_to_datetime(value).timestamp()
            return max(0.0, when - (now or time.time()))
        except (TypeError, ValueError):
            return None
    if headers.get("x-ratelimit-remaining") == "0" and (reset := headers.get("x-ratelimit-reset", "")).isdigit():
        return max(0.0, float(reset) - (now or time.time()))
    return None


def rate_limited(resp: Response) -> bool:
    """A rate-limit answer: 429, or GitHub's 403 for a primary limit
    (`X-RateLimit-Remaining: 0`) or a secondary one (`Retry-After`)."""
    if resp.status == 429:
        return True
    return resp.status == 403 and ("retry-after" in resp.headers or resp.headers.get("x-ratelimit-remaining") == "0")


def _retryable(resp: Response) -> bool:
    return resp.status >= 500 or rate_limited(resp)


def next_wait(resp: Response | None, attempt: int, policy: RetryPolicy) -> float | None:
    """Seconds to wait before attempt `attempt + 1`, or None: do not retry,
    return `resp` (the server named a time beyond the caller's longest wait,
    or the caller schedules rate limits itself)."""
    if resp is None:
        return min(_backoff(attempt, policy), policy.max_wait_s)
    if rate_limited(resp) and not policy.retry_limits:
        return None
    asked = retry_after_s(resp.headers)
    if asked is None:
        return min(_backoff(attempt, policy), policy.max_wait_s)
    return asked if asked <= policy.max_wait_s else None


def _backoff(attempt: int, policy: RetryPolicy) -> float:
    return policy.backoff_s * (2.0 ** (attempt - 1)) * (0.5 + random.random() / 2)


class HttpClient:
    def __init__(self, redactor: Redactor, *, ca_file: Path | None = None,
                 proxies: Mapping[str, str] | None = None, retry: RetryPolicy | None = None,
                 user_agent: str = "afe") -> None:
        self.redactor = redactor
        self.ca_file = ca_file
        self.proxies = dict(proxies or {})
        self.retry = retry or RetryPolicy()
        self.user_agent = user_agent
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            ctx = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx),
                                                  trust_env=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, url: str, *, headers: dict[str, str], json_body: Any = None,
                      timeout_s: float = 60.0, what: str = "request",
                      retry: RetryPolicy | None = None) -> Response:
        """Send with retries (`retry`, else the client's policy); returns the
        last response (even a failing one)."""
        policy = retry or self.retry
        session = self._get_session()
        hdrs = {"User-Agent": self.user_agent, **headers}
        last_exc: BaseException | None = None
        resp: Response | None = None
        for attempt in range(1, policy.attempts + 1):
            resp = None
            try:
                async with session.request(method, url, headers=hdrs, json=json_body,
                                           timeout=aiohttp.ClientTimeout(total=timeout_s),
                                           proxy=proxy_for(url, self.proxies),
                                           allow_redirects=False) as r:
                    text = await r.text(errors="replace")
                    rh = {k.lower(): v for k, v in r.headers.items()}
                    try:
                        body: Any = json.loads(text) if text else None
                    except ValueError:
                        body = text
                    resp = Response(r.status, rh, body)
            except aiohttp.ClientConnectorCertificateError as exc:
                raise Unavailable(f"{what}: the server's TLS certificate is not trusted "
                                  f"({self.redactor.redact(str(exc.certificate_error))}); if a private CA "
                                  "signed it, set AFE_CA_FILE to that CA's PEM bundle") from None
            except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                last_exc = exc
            if resp is not None and not _retryable(resp):
                return resp
            if attempt == policy.attempts:
                break
            wait = next_wait(resp, attempt, policy)
            if wait is None:
                break
            log.info("%s: %s; retrying in %.1fs (attempt %s of %s)", what,
                     f"HTTP {resp.status}" if resp is not None else type(last_exc).__name__,
                     wait, attempt + 1, policy.attempts)
            await asyncio.sleep(wait)
        if resp is not None:
            return resp
        if isinstance(last_exc, asyncio.TimeoutError):
            raise DeadlineExceeded(f"{what}: no answer within {timeout_s:.0f}s")
        raise Unavailable(f"{what}: cannot reach the server "
                          f"({self.redactor.redact(str(last_exc) or type(last_exc).__name__)})")

    def error(self, resp: Response, what: str, hint_auth: str = "") -> AfeError:
        """A clear, redacted error for a failing response."""
        detail = ""
        body = resp.body
        if isinstance(body, dict):
            err = body.get("error")
            if isinstance(err, dict):
                detail = str(err.get("message") or err.get("type") or "")
            elif isinstance(err, str):
                detail = err
            detail = detail or str(body.get("message") or "")
            errs = body.get("errors")
            if isinstance(errs, list) and errs:
                detail += " (" + "; ".join(str(e.get("message", e) if isinstance(e, dict) else e)
                                           for e in errs[:3]) + ")"
        elif isinstance(body, str):
            detail = body
        detail = self.redactor.redact(detail.strip())[:300]
        msg = f"{what}: HTTP {resp.status}" + (f": {detail}" if detail else "")
        if resp.status == 401:
            return Unauthenticated(msg + (f"; {hint_auth}" if hint_auth else ""))
        if rate_limited(resp):
            return ResourceExhausted(msg + "; rate limited, " + _when_again(resp))
        if resp.status == 403:
            return PermissionDenied(msg + (f"; {hint_auth}" if hint_auth else ""))
        if resp.status == 404:
            return NotFound(msg)
        if resp.status in (409, 405):
            return FailedPrecondition(msg)
        if resp.status in (400, 422):
            return InvalidArgument(msg)
        return Unavailable(msg)


def _when_again(resp: Response) -> str:
    """When the server allows the next request, as it said (a 403 that is a
    rate limit is not a missing permission: the token is fine)."""
    wait = retry_after_s(resp.headers)
    if wait is None:
        return "try again later"
    return f"the server allows the next request in {wait:.0f} s"
