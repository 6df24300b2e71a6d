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
import signal
import socket
import subprocess
import tempfile
import time
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
    opts: str = ""      # the server's -o options (a restart after kill -9 starts it with them again)

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


def start_server(durable: bool = False) -> PgServer:
    """A new server. `durable`: what a commit acknowledged survives a crash
    (fsync and synchronous commit on, as on an operator's server); the
    default trades that for speed, which a test that crashes the server
    cannot use."""
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
    # PostgreSQL cannot listen on port 0 and say which port it got: a free port is
    # picked, and picked again when another process (a parallel test worker) took it first.
    for attempt in range(5):
        port = _free_port()
        opts = (f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={root} "
                "-c max_connections=100 -c shared_buffers=32MB")
        if not durable:
            opts += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        proc = subprocess.run(_as_server_user([str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"),
                                               "-o", opts, "-w", "-t", "60", "start"]),
                              check=False, capture_output=True, text=True)
        if proc.returncode == 0:
            break
        log = (root / "log").read_text(errors="replace") if (root / "log").exists() else ""
        if "Address already in use" not in log or attempt == 4:
            raise RuntimeError(f"the test PostgreSQL server did not start: {proc.stdout}{proc.stderr}\n{log}")
        (root / "log").unlink()
    server = PgServer(bin_dir, root, port, opts)
    server.sql(f"CREATE ROLE {APP_USER} LOGIN PASSWORD '{APP_PASSWORD}'")
    return server


def restart_server(server: PgServer, mode: str) -> None:
    """Restart the server as an operator or a crash would: `pg_ctl restart -m
    fast` (clients are told "terminating connection due to administrator
    command"), `-m immediate` (no goodbye, crash recovery at start), or
    `kill9` (SIGKILL of the postmaster, its backends left to notice, then a
    start)."""
    data = server.root / "data"
    ctl = str(server.bin_dir / "pg_ctl")
    if mode in ("fast", "immediate"):
        proc = subprocess.run(_as_server_user([ctl, "-D", str(data), "-l", str(server.root / "log"), "-m", mode,
                                               "-w", "-t", "60", "restart"]),
                              check=False, capture_output=True, text=True)
    elif mode == "kill9":
        pid = int((data / "postmaster.pid").read_text().split()[0])
        children = _children(pid)
        os.kill(pid, signal.SIGKILL)
        _wait_gone([pid, *children])
        # A postmaster that nobody reaped (no init here) still "exists" for the lock file's check.
        (data / "postmaster.pid").unlink(missing_ok=True)
        (server.root / f".s.PGSQL.{server.port}.lock").unlink(missing_ok=True)
        proc = subprocess.run(_as_server_user([ctl, "-D", str(data), "-l", str(server.root / "log"), "-o",
                                               server.opts, "-w", "-t", "60", "start"]),
                              check=False, capture_output=True, text=True)
    else:
        raise ValueError(f"restart mode {mode!r}: fast, immediate or kill9")
    if proc.returncode != 0:
        log = (server.root / "log").read_text(errors="replace")[-4000:] if (server.root / "log").exists() else ""
        raise RuntimeError(f"the test PostgreSQL server did not restart ({mode}): {proc.stdout}{proc.stderr}\n{log}")


def stop_only(server: PgServer) -> None:
    """Stop the server (an outage); `start_again` ends it."""
    subprocess.run(_as_server_user([str(server.bin_dir / "pg_ctl"), "-D", str(server.root / "data"), "-m", "fast",
                                    "-w", "stop"]), check=True, capture_output=True)


def start_again(server: PgServer) -> None:
    proc = subprocess.run(_as_server_user([str(server.bin_dir / "pg_ctl"), "-D", str(server.root / "data"), "-l",
                                           str(server.root / "log"), "-o", server.opts, "-w", "-t", "60", "start"]),
                          check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the test PostgreSQL server did not start again: {proc.stdout}{proc.stderr}")


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def _wait_gone(pids: list[int], deadline_s: float = 30) -> None:
    """Backends notice their postmaster's death and exit (so the shared memory
    segment is free for a new postmaster)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        alive = [p for p in pids if _running(p)]
        if not alive:
            return
        time.sleep(0.05)
    raise RuntimeError(f"PostgreSQL processes {pids} still run {deadline_s} s after the postmaster was killed")


def _running(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text(errors="replace")
    except OSError:
        return False


def stop_server(server: PgServer) -> None:
    subprocess.run(_as_server_user([str(server.bin_dir / "pg_ctl"), "-D", str(server.root / "data"),
                                    "-m", "immediate", "-w", "stop"]), check=False,
                   capture_output=True)
    shutil.rmtree(server.root, ignore_errors=True)


def open_store_url(url: str, data_dir: Path | None = None):
    """The scheduler's store for an AFE_DATABASE_URL, opened as the scheduler opens it."""
    from services.common.config.database_url import read_database_url
    from services.common.layout import Layout
    from services.common.secrecy.redact import Redactor
    from services.scheduler.store.url import open_store

    data = data_dir or Path(tempfile.gettempdir())
    return open_store(read_database_url(Layout(data, data / "run"), Redactor(), {"AFE_DATABASE_URL": url}))
