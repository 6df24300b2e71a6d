"""AFE_DATABASE_URL: read once at start, never repeated (R29).

Accepted:
- unset or empty: the embedded SQLite store `<data>/afe.db` (the default);
- `sqlite:///abs/path.db`, `sqlite:relative/path.db` (relative to the data
  dir), optionally with userinfo (`sqlite://user:pw@/abs/path.db`), which
  SQLite ignores;
- `postgresql://user:password@host:port/dbname?sslmode=...` (or
  `postgres://`): a PostgreSQL server that several schedulers may share
  (services/scheduler/store/store.py). Any libpq URL parameter may follow.

A password is registered with the redactor, and the whole value too when it
comes from the environment. Errors and logs name the backend, the host, the
port and the database (`DatabaseTarget.where`), never the URL.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from services.common.errors import ConfigError
from services.common.layout import Layout
from services.common.secrecy.env_secrets import take_secret_env
from services.common.secrecy.redact import Redactor

ENV = "AFE_DATABASE_URL"
PG_SCHEMES = ("postgresql", "postgres")
CONNECT_TIMEOUT_S = 10


@dataclass(frozen=True)
class DatabaseTarget:
    """Where the store lives. `conninfo` (PostgreSQL) is the secret URL; it is
    left out of repr and of every message."""

    backend: str                       # "sqlite" or "postgresql"
    where: str                         # safe description for messages
    path: Path | None = None           # sqlite
    conninfo: str = field(default="", repr=False)   # postgresql


def read_database_url(layout: Layout, redactor: Redactor,
                      environ: Mapping[str, str] | None = None) -> DatabaseTarget:
    """Parse AFE_DATABASE_URL; removes the variable from the environment when
    `environ` is None (the process's own, read once at start)."""
    if environ is None:
        taken = take_secret_env([ENV], redactor)
        url = taken[ENV].reveal() if ENV in taken else ""
    else:
        url = environ.get(ENV, "")
    if not url:
        return _sqlite(layout.store_file)
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:
        raise ConfigError(f"{ENV} is not a URL; write sqlite:///absolute/path.db or "
                          "postgresql://user:password@host:port/database") from None
    if password:
        redactor.register(urllib.parse.unquote(password))
    # Never repeat the URL: it may carry a password.
    if parts.scheme == "sqlite":
        path = urllib.parse.unquote(parts.path)
        if not path or path == "/":
            raise ConfigError(f"{ENV}: the sqlite URL names no file; use sqlite:///absolute/path.db")
        p = Path(path)
        if not p.is_absolute():
            p = layout.data_dir / p
        return _sqlite(Path(os.path.normpath(p)))
    if parts.scheme in PG_SCHEMES:
        return _postgresql(url, parts)
    raise ConfigError(f"{ENV}: the URL scheme must be sqlite or postgresql (sqlite:///absolute/path.db or "
                      "postgresql://user:password@host:port/database)")


def store_path(layout: Layout, redactor: Redactor, environ: Mapping[str, str] | None = None) -> Path:
    """Where the SQLite store lives (for callers that only know SQLite)."""
    target = read_database_url(layout, redactor, environ)
    if target.path is None:
        raise ConfigError(f"{ENV} names a PostgreSQL database; this caller needs a SQLite file")
    return target.path


def _sqlite(path: Path) -> DatabaseTarget:
    return DatabaseTarget("sqlite", f"the SQLite store {path}", path=path)


def _postgresql(url: str, parts: urllib.parse.SplitResult) -> DatabaseTarget:
    import psycopg
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    try:
        params = conninfo_to_dict(url)
    except psycopg.Error:   # its text may quote the URL
        raise ConfigError(f"{ENV}: the postgresql URL does not parse; write "
                          "postgresql://user:password@host:port/database (percent-encode special characters "
                          "in the password)") from None
    if not all(p.strip().isdigit() for p in str(params.get("port") or "5432").split(",")):
        raise ConfigError(f"{ENV}: the port in the postgresql URL must be a number (5432 by default)")
    host = str(params.get("host") or "the local socket")
    port = str(params.get("port") or "5432")
    dbname = str(params.get("dbname") or params.get("user") or "")
    if not dbname:
        raise ConfigError(f"{ENV}: the postgresql URL names no database; add /DATABASE after the host")
    extra: dict[str, str | int] = {}
    if "connect_timeout" not in params:
        extra["connect_timeout"] = CONNECT_TIMEOUT_S
    if "application_name" not in params:
        extra["application_name"] = "afe-scheduler"
    conninfo = make_conninfo(url, **extra) if extra else url
    where = f"the PostgreSQL database {dbname} on {host} port {port}"
    return DatabaseTarget("postgresql", where, conninfo=conninfo)
