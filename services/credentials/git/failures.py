"""What a failed `git fetch`/`git push` against a Workspace's remote means.

git reports a remote's answer only on stderr (curl's "The requested URL
returned error: 403", "Could not resolve host", fsck's "missingEmail", ...).
`classify` turns that text into one `Failure` kind; `error_for` turns a kind
into the error a person sees: which git operation, which URL (a Workspace's
repo never holds credentials), what the remote said, and what to change --
naming the token's variable, never a value. Only `TRANSIENT` failures are
worth another attempt; the others are definitive and fail the call at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.common.config.model import Workspace
from services.common.errors import (
    AfeError,
    FailedPrecondition,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)

AUTH = "auth"                # 401, or git asked for credentials nobody could give
FORBIDDEN = "forbidden"      # 403
MISSING = "missing"          # 404 / "repository not found"
DNS = "dns"                  # the host name does not resolve
TLS = "tls"                  # the server's certificate was not accepted
CORRUPT = "corrupt"          # fsck / index-pack refused what the remote sent
REJECTED = "rejected"        # the remote refused a pushed ref (protected, hooks)
TRANSIENT = "transient"      # 5xx, 429, time-outs, resets, refused connections
UNKNOWN = "unknown"

_HTTP = re.compile(r"returned error: (\d{3})")


@dataclass(frozen=True)
class Failure:
    kind: str
    status: int = 0              # the HTTP status, when git named one
    detail: str = ""             # one redacted line of git's stderr


def classify(stderr: str) -> Failure:
    """The kind of failure git's (already redacted) stderr describes."""
    text = stderr.lower()
    m = _HTTP.search(text)
    status = int(m.group(1)) if m else 0
    line = _detail(stderr)
    if status == 401 or "authentication failed" in text or "could not read username" in text \
            or "could not read password" in text:
        return Failure(AUTH, status or 401, line)
    if status == 403:
        return Failure(FORBIDDEN, status, line)
    if status == 404 or ("repository" in text and "not found" in text) \
            or "does not appear to be a git repository" in text:
        return Failure(MISSING, status or 404, line)
    if "could not resolve host" in text or "could not resolve proxy" in text:
        return Failure(DNS, 0, line)
    if "ssl certificate problem" in text or "certificate verification failed" in text \
            or "server certificate" in text:
        return Failure(TLS, 0, line)
    if "fsck error" in text or "index-pack failed" in text or "bad object" in text or "corrupt" in text \
            or "did not send all necessary objects" in text or "invalid index-pack output" in text:
        return Failure(CORRUPT, 0, _fsck_line(stderr) or line)
    if status == 429 or status >= 500 or any(s in text for s in (
            "timed out", "connection reset", "couldn't connect", "connection refused", "failed to connect",
            "early eof", "rpc failed", "empty reply", "unexpected disconnect", "the remote end hung up",
            "recv failure", "send failure", "operation too slow")):
        return Failure(TRANSIENT, status, line)
    if "[rejected]" in text or "[remote rejected]" in text or "non-fast-forward" in text or "protected" in text:
        return Failure(REJECTED, status, line)
    return Failure(UNKNOWN, status, line)


def error_for(failure: Failure, ws: Workspace, operation: str, url: str, attempts: int = 1,
              field: str = "repo") -> AfeError:
    """The error for `operation` ("git fetch from", "git push to") of `url` failing with `failure`;
    `field` is the Workspace field that names `url` (repo, or forge.pushRepo for a fork)."""
    where = f"{operation} {url}"
    token = (f"check the token in {ws.token_env} (the Workspace's tokenEnv) and its access to the repository"
             if ws.token_env else "the repository needs a token: set tokenEnv on the Workspace and export "
                                  "that variable for afe")
    http = f" (HTTP {failure.status})" if failure.status else ""
    k = failure.kind
    if k == AUTH:
        return Unauthenticated(f"{where} was refused: authentication failed{http}; {token}")
    if k == FORBIDDEN:
        return PermissionDenied(f"{where} was refused: the token may not access it{http}; {token}")
    if k == MISSING:
        see = f" and that the token in {ws.token_env} can see it" if ws.token_env else ""
        return NotFound(f"{where} failed: repository not found{http}; check the Workspace's {field}{see}")
    if k == DNS:
        return FailedPrecondition(f"{where} failed: the host name does not resolve ({failure.detail}); "
                                  "check the Workspace's repo, and DNS or the proxy on afe's host")
    if k == TLS:
        return FailedPrecondition(f"{where} failed: the server's TLS certificate was not accepted "
                                  f"({failure.detail}); for a private CA set AFE_CA_FILE for afe")
    if k == CORRUPT:
        return FailedPrecondition(f"{where} failed: the remote sent a corrupt or invalid object "
                                  f"({failure.detail}); repair the repository on the remote (git fsck)")
    if k == REJECTED:
        return PermissionDenied(f"{where} was refused: the remote rejected the update ({failure.detail}); "
                                "check the branch protection rules and hooks of the remote")
    if k == TRANSIENT:
        tries = f" ({attempts} attempts)" if attempts > 1 else ""
        return Unavailable(f"{where} failed{tries}: {failure.detail or 'the remote did not answer'}; "
                           "the remote is unreachable or overloaded; retry the ticket later")
    return FailedPrecondition(f"{where} failed: {failure.detail or 'git exited with an error'}")


def _detail(stderr: str) -> str:
    """The most telling line: the last `fatal:`/`error:` line, without git's prefix."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.lower().startswith(("fatal:", "error:")):
            return _cut(ln.split(":", 1)[1].strip())
    return _cut(lines[-1]) if lines else ""


def _fsck_line(stderr: str) -> str:
    """fsck's own complaint ("object <sha>: missingEmail: ..."), when git printed one."""
    for ln in stderr.splitlines():
        if ln.startswith("error: object ") or ("fsck" in ln.lower() and "object" in ln.lower()):
            return _cut(ln.split(":", 1)[1].strip())
    return ""


def _cut(line: str) -> str:
    return line if len(line) <= 300 else line[:300] + "..."


__all__ = ["TRANSIENT", "Failure", "classify", "error_for"]
