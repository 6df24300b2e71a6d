"""AFE_DATABASE_URL: read once at start, never repeated (R29).

Accepted: `sqlite:///abs/path.db`, `sqlite:relative/path.db` (relative to
the data dir), optionally with userinfo (`sqlite://user:pw@/abs/path.db`),
which SQLite ignores; a password is registered with the redactor. Unset or
empty means the default file `<data>/afe.db`.
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

from services.common.errors import ConfigError
from services.common.layout import Layout
from services.common.redact import Redactor
from services.common.secrets import take_secret_env

ENV = "AFE_DATABASE_URL"


def store_path(layout: Layout, redactor: Redactor, environ: dict | None = None) -> Path:
    """Where the SQLite store lives; removes the variable from the environment."""
    if environ is None:
        taken = take_secret_env([ENV], redactor)
        url = taken[ENV].reveal() if ENV in taken else ""
    else:
        url = environ.get(ENV, "")
    if not url:
        return layout.store_file
    parts = urllib.parse.urlsplit(url)
    if parts.password:
        redactor.register(urllib.parse.unquote(parts.password))
    if parts.scheme != "sqlite":
        # Never repeat the URL: it may carry a password.
        raise ConfigError(f"{ENV}: only sqlite URLs are supported by this afe "
                          f"(sqlite:///absolute/path.db or sqlite:relative/path.db)")
    path = urllib.parse.unquote(parts.path)
    if not path or path == "/":
        raise ConfigError(f"{ENV}: the sqlite URL names no file; use sqlite:///absolute/path.db")
    p = Path(path)
    if not p.is_absolute():
        p = layout.data_dir / p
    return Path(os.path.normpath(p))
