"""A throwaway PostgreSQL server for tests: `initdb` into a temporary folder,
`pg_ctl start` listening on a Unix socket in that folder and on 127.0.0.1 at
a free port (password login, for the credential tests), stopped and removed
at the end. Never the machine's own cluster.

As root, the server runs as the `postgres` system user that Debian's
`postgresql` package creates (initdb refuses root). Each test gets its own
database (`fresh_database`), so tests never see each other's rows.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

ADMIN = "afe_admin"            # the superuser initdb creates (trust over the Unix socket)
APP_USER = "afe_app"           # a password user for TCP logins
APP_PASSWORD = "pg-Test-Password-7c1e5a"


def find_bin_dir() -> Path | None:
    """The newest installed PostgreSQL's bin folder, or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def skip_reason() -> str | None:
    if find_bin_dir() is None:
        return "PostgreSQL server binaries (initdb, pg_ctl) are not installed: apt-get install postgresql"
    if os.geteuid() == 0:
        try:
            import pwd

            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no `postgres` user to run the test server as"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PgServer:
    bin_dir: Path
    root: Path          # temp folder: data/ and the socket
    port: int

    @property
    def socket_dir(self) -> Path:
        return self.root

    def admin_url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{ADMIN}@/{dbname}?host={self.socket_dir}&port={self.port}"

    def app_url(self, dbname: str, password: str = APP_PASSWORD) -> str:
        """A TCP URL with a password, as an operator would write one."""
        return f"postgresql://{APP_USER}:{password}@127.0.0.1:{self.port}/{dbname}"

    def sql(self, statement: str, dbname: str = "postgres") -> None:
        import psycopg

        with psycopg.connect(self.admin_url(dbname), autocommit=True) as db:
            db.execute(statement)

    def fresh_database(self) -> str:
        """A new empty database owned by the password user; returns its name."""
        name = "t_" + uuid.uuid4().hex[:16]
        self.sql(f'CREATE DATABASE "{name}" OWNER {APP_USER} TEMPLATE template0')
        return name

    def drop_database(self, name: str) -> None:
        self.sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _as_server_user(argv: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *argv]
    return argv


def start_server() -> PgServer:
    bin_dir = find_bin_dir()
    assert bin_dir is not None, skip_reason()
    root = Path(tempfile.mkdtemp(prefix="afe-pg-", dir="/tmp"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    data = root / "data"
    subprocess.run(_as_server_user([str(bin_dir / "initdb"), "-D", str(data), "-U", ADMIN, "-E", "UTF8",
                                    "--locale=C", "--auth-local=trust", "--auth-host=scram-sha-256",
                                    "--no-sync"]),
                   check=True, capture_output=True, text=True)
    port = _free_port()
    opts = (f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={root} "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=100 "
            "-c shared_buffers=32MB")
    proc = subprocess.run(_as_server_user([str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"),
                                           "-o", opts, "-w", "-t", "60", "start"]),
                          check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        log = (root / "log").read_text() if (root / "log").exists() else ""
        raise RuntimeError(f"the test PostgreSQL server did not start: {proc.stdout}{proc.stderr}\n{log}")
    server = PgServer(bin_dir, root, port)
    server.sql(f"CREATE ROLE {APP_USER} LOGIN PASSWORD '{APP_PASSWORD}'")
    return server


def stop_server(server: PgServer) -> None:
    subprocess.run(_as_server_user([str(server.bin_dir / "pg_ctl"), "-D", str(server.root / "data"),
                                    "-m", "immediate", "-w", "stop"]), check=False,
                   capture_output=True)
    shutil.rmtree(server.root, ignore_errors=True)


def open_store_url(url: str, data_dir: Path | None = None):
    """The scheduler's store for an AFE_DATABASE_URL, opened as the scheduler opens it."""
    from services.common.layout import Layout
    from services.common.redact import Redactor
    from services.scheduler.database_url import open_store, read_database_url

    data = data_dir or Path(tempfile.gettempdir())
    return open_store(read_database_url(Layout(data, data / "run"), Redactor(), {"AFE_DATABASE_URL": url}))
