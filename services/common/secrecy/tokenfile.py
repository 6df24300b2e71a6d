"""The UI token file (`<data>/ui-token`, 0600): a fresh random token written
atomically. `afe token rotate` (services/cli/token.py) writes it; the gateway
reads and watches it (gateway/tokens.py)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def new_token() -> str:
    """A fresh random UI token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def write_token_file(path: Path, token: str | None = None) -> str:
    """Atomically replace `path` with a new 0600 token file; return the token."""
    token = token or new_token()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, (token + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return token
