"""Marks on the comments afe writes back to GitHub (docs/GITHUB.md,
"Reporting back"), so a report is edited rather than posted again after a
crash (R37).

Each comment of (repository, issue, ticket, step) ends with an HTML comment
(`<!-- afe-report ticket step mac -->`, invisible on GitHub) whose `mac` is
an HMAC-SHA256, keyed by a secret only the credential broker holds
(`<data>/credentials/report.key`, made on first use, mode 0600), over the
repository, the issue number, the ticket and the step. Someone else cannot
write a valid mark for a report afe has not posted yet; one who copies a
posted mark into a later comment of their own is not taken for afe's,
because the earliest comment with the mark wins.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path

STEP = re.compile(r"^[a-z0-9_-]{1,40}$")
MAX_BODY_CHARS = 60_000        # GitHub takes 65536; room for the mark


def load_key(path: Path) -> bytes:
    """The broker's report key, made (32 random bytes, 0600) when absent."""
    try:
        data = path.read_bytes()
        if len(data) >= 32:
            return data
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, secrets.token_bytes(32))
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)           # first writer wins; a concurrent start reads the same key
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_bytes()


def mark(key: bytes, repo: str, number: str, ticket_id: str, step: str) -> str:
    msg = f"{repo.lower()}\n{number}\n{ticket_id}\n{step}".encode()
    mac = hmac.new(key, msg, hashlib.sha256).hexdigest()[:40]
    return f"<!-- afe-report {ticket_id} {step} {mac} -->"


def marked(body: str, the_mark: str) -> str:
    """The body as posted: clipped to GitHub's limit, the mark on its own last line."""
    body = body.rstrip()
    if len(body) > MAX_BODY_CHARS:
        body = body[:MAX_BODY_CHARS] + "\n\n(cut: too long for a comment)"
    return f"{body}\n\n{the_mark}"


def carries(body: object, the_mark: str) -> bool:
    """Does a comment's body end with exactly this mark (constant-time compare)?"""
    if not isinstance(body, str):
        return False
    tail = body.rstrip().rsplit("\n", 1)[-1].strip()
    return hmac.compare_digest(tail.encode(), the_mark.encode())
