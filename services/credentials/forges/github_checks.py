"""Failing CI on a commit (docs/GITHUB.md, "Failing CI"), read by the broker,
which alone holds the token: the commit's check runs
(`GET /repos/{o}/{r}/commits/{ref}/check-runs`), its combined status
(`GET /repos/{o}/{r}/commits/{ref}/status`) and, for a failing GitHub Actions
check run (whose id is the Actions job id), the tail of the job's log
(`GET /repos/{o}/{r}/actions/jobs/{job_id}/logs`: a 302 to a short-lived
download URL, fetched WITHOUT the token). Only the failing checks come back,
at most MAX_CHECKS; a log's tail is at most LOG_LINES lines and LOG_BYTES
bytes, its ANSI escapes and control characters stripped, every secret the
broker holds redacted. Everything here is untrusted text for the scheduler:
it reaches a prompt only quoted (R36)."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from services.common.ci import FAILING_RUN, FAILING_STATUS
from services.common.config.model import Workspace
from services.common.host.proxies import proxy_for
from services.credentials.forges.github_events import Limits

MAX_CHECKS = 5
LOG_LINES = 200
LOG_BYTES = 8 * 1024
MAX_LOG_DOWNLOAD = 32 * 1024 * 1024     # read at most this much of a log (its tail is kept)
TEXT_LIMIT = 2000                       # a title, summary or description
ACTIONS_APP = "github-actions"
ETAGS_KEPT = 512                        # conditional answers kept per forge (check runs, combined status)
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


@dataclass(frozen=True)
class CheckDetail:
    kind: str               # check_run | status
    name: str               # the check run's name, the status's context
    app: str                # the check run's app slug ("" for a status)
    conclusion: str         # the check run's conclusion, the status's state
    title: str = ""
    summary: str = ""
    description: str = ""
    details_url: str = ""
    target_url: str = ""
    log_tail: str = ""
    id: int = 0


@dataclass
class CheckDetails:
    checks: list[CheckDetail] = field(default_factory=list)
    pending: bool = False           # a check run or status of the commit has not finished yet
    rate_limited: bool = False
    rate_limit_reset_ms: int = 0
    retry_after_s: int = 0


def clean_log(raw: bytes | str, redact: Callable[[str], str]) -> str:
    """The tail of a log: ANSI escapes and control characters out, redacted, bounded."""
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    text = _CONTROL.sub("", _ANSI.sub("", text.replace("\r\n", "\n")))
    text = redact(text)
    lines = text.rstrip("\n").split("\n")[-LOG_LINES:]
    out = "\n".join(lines)
    data = out.encode("utf-8")
    if len(data) > LOG_BYTES:
        out = data[-LOG_BYTES:].decode("utf-8", errors="ignore")
        out = out.split("\n", 1)[1] if "\n" in out else out
    return out


def _text(value: Any, redact: Callable[[str], str]) -> str:
    return redact(str(value))[:TEXT_LIMIT] if isinstance(value, str) else ""


class ChecksReader:
    """One commit's failing checks through the forge (`github.GitHubForge`)."""

    def __init__(self, forge: Any, ws: Workspace, redact: Callable[[str], str]) -> None:
        self.forge = forge
        self.ws = ws
        self.redact = redact
        self.once = replace(forge.http.retry, retry_limits=False)   # the scheduler keeps a limit's wait

    async def _get(self, *parts: str, query: dict[str, str] | None = None, conditional: bool = False) -> Any:
        """GET; with `conditional`, as a conditional request: the last answer's ETag is sent
        and a 304 (which GitHub does not count against the rate limit) gives that answer again."""
        url = self.forge._url(self.ws, *parts, query=query)
        headers = self.forge._headers(self.ws)
        known = self.forge.etags.get(url) if conditional else None
        if known is not None:
            headers = {**headers, "If-None-Match": known[0]}
        resp = await self.forge.http.request("GET", url, headers=headers, timeout_s=self.forge.timeout_s,
                                             what="GitHub checks", retry=self.once)
        if known is not None and resp.status == 304:
            self.forge.etags.move_to_end(url)
            return known[1]
        if conditional and resp.ok and resp.headers.get("etag"):
            self.forge.etags[url] = (resp.headers["etag"], resp)
            self.forge.etags.move_to_end(url)
            while len(self.forge.etags) > ETAGS_KEPT:
                self.forge.etags.popitem(last=False)
        return resp

    async def read(self, sha: str, with_logs: bool) -> CheckDetails:
        out = CheckDetails()
        runs = await self._get("commits", sha, "check-runs", query={"per_page": "100"}, conditional=True)
        if self._limited(runs, out):
            return out
        if not runs.ok or not isinstance(runs.body, dict):
            raise self.forge._fail(self.ws, runs, f"check runs of {sha[:12]}")
        for r in runs.body.get("check_runs") or []:
            if not isinstance(r, dict):
                continue
            if r.get("status") != "completed":
                out.pending = True
            elif r.get("conclusion") in FAILING_RUN and len(out.checks) < MAX_CHECKS:
                output = r.get("output") or {}
                out.checks.append(CheckDetail(
                    kind="check_run", name=_text(r.get("name"), self.redact),
                    app=_text((r.get("app") or {}).get("slug"), self.redact), conclusion=str(r["conclusion"]),
                    title=_text(output.get("title"), self.redact), summary=_text(output.get("summary"), self.redact),
                    details_url=_text(r.get("details_url"), self.redact),
                    target_url=_text(r.get("html_url"), self.redact),
                    id=int(r["id"]) if isinstance(r.get("id"), int) else 0))
        status = await self._get("commits", sha, "status", query={"per_page": "100"}, conditional=True)
        if self._limited(status, out):
            return out
        if status.ok and isinstance(status.body, dict):
            for s in status.body.get("statuses") or []:
                if not isinstance(s, dict):
                    continue
                if s.get("state") == "pending":
                    out.pending = True
                elif s.get("state") in FAILING_STATUS and len(out.checks) < MAX_CHECKS:
                    out.checks.append(CheckDetail(
                        kind="status", name=_text(s.get("context"), self.redact), app="",
                        conclusion=str(s["state"]), description=_text(s.get("description"), self.redact),
                        target_url=_text(s.get("target_url"), self.redact)))
        elif status.status != 404:
            raise self.forge._fail(self.ws, status, f"combined status of {sha[:12]}")
        if with_logs:
            out.checks = [replace(c, log_tail=await self.log_tail(c.id))
                          if c.kind == "check_run" and c.app == ACTIONS_APP and c.id else c for c in out.checks]
        return out

    def _limited(self, resp: Any, out: CheckDetails) -> bool:
        limits = Limits.of(resp)
        if limits.limited:
            out.rate_limited, out.rate_limit_reset_ms, out.retry_after_s = True, limits.reset_ms, limits.retry_after_s
        return limits.limited

    async def log_tail(self, job_id: int) -> str:
        """The job log's tail ("" when GitHub has none to give: expired, no permission, a limit)."""
        resp = await self._get("actions", "jobs", str(job_id), "logs")
        where = resp.headers.get("location", "") if resp.status in (301, 302, 303, 307, 308) else ""
        if not where or urllib.parse.urlsplit(where).scheme not in ("https", "http"):
            return ""
        session = self.forge.http._get_session()
        tail = b""
        read = 0
        # The download URL is signed for this one job: no Authorization header goes there.
        async with session.get(where, headers={"User-Agent": self.forge.http.user_agent},
                               timeout=aiohttp.ClientTimeout(total=self.forge.timeout_s),
                               proxy=proxy_for(where, self.forge.http.proxies), allow_redirects=True) as r:
            if r.status != 200:
                return ""
            async for chunk in r.content.iter_chunked(64 * 1024):
                read += len(chunk)
                tail = (tail + chunk)[-(LOG_BYTES * 8):]
                if read >= MAX_LOG_DOWNLOAD:
                    break
        if read > len(tail) and b"\n" in tail:
            tail = tail.split(b"\n", 1)[1]       # the cut line: a secret's remainder would not be redacted
        return clean_log(tail, self.redact)
