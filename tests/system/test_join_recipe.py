"""docs/SCALE.md "Several machines", followed as written: the blocks marked
`<!-- join recipe: ... -->` are read from the page and run with the page's
host names and paths replaced by this test's (the one-host extras each
`afe up` needs beside another on one machine are added, as the page says):

- `afe certs` makes the CA and the certificates;
- a real PostgreSQL server of the test's own gets the page's SQL, its
  postgresql.conf lines (TLS with the CA's certificate) and pg_hba.conf lines
  (only TLS with a certificate of the CA), and is reloaded;
- the first machine's `afe up` and a second one's `afe up --join` run with
  their own data folders and ports on one host and one database, both
  become ready, and a ticket filed through either runs (to its approval).

Before the first machine starts, `--join` is refused because the database
holds no deployment yet; the other refusals (a CA that does not match, a
SQLite store, a database without TLS, one that does not answer, missing
flags) are checked against the same server with the real CLI."""

from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import psycopg
import pytest

from services.common import demo
from tests.foundation.launcher_support import Afe, base_env
from tests.support import postgres
from tests.support.temp_roots import remove_temp_root, temp_root

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "SCALE.md"
PASSWORD = "join-Recipe-" + secrets.token_hex(6)


def recipe() -> dict[str, str]:
    """The page's marked blocks by name."""
    blocks = re.findall(r"<!-- join recipe: ([^>]+?) -->\n```[a-z]*\n(.*?)```", PAGE.read_text(), re.DOTALL)
    found = dict(blocks)
    assert set(found) == {"admin", "sql", "postgresql.conf", "pg_hba.conf", "first machine",
                          "further machine"}, sorted(found)
    return found


class Here:
    """The page's names and paths, and this test's for them."""

    def __init__(self, base: Path, server: postgres.PgServer) -> None:
        self.base = base
        self.admin_pki = base / "admin-pki"     # /srv/afe-pki: where `afe certs` runs
        self.host_pki = base / "host-pki"       # /etc/afe-pki: what each machine was given
        self.db_tls = server.root / "afe-tls"   # /etc/postgresql/afe: the database host's copies
        self.config = base / "cfg"              # /etc/afe: the manifests, the same on every machine
        self.server = server

    def text(self, block: str, machine: str = "") -> str:
        out = block
        for page, ours in (("/srv/afe-pki", str(self.admin_pki)), ("/etc/afe-pki", str(self.host_pki)),
                           ("/etc/postgresql/afe", str(self.db_tls)), ("/etc/afe", str(self.config)),
                           ("/var/lib/afe", str(self.base / machine / "data")), ("db.internal", "localhost"),
                           ("10.0.0.0/8", "127.0.0.1/32"), (":5432/", f":{self.server.port}/"),
                           ("CHANGE-ME", PASSWORD)):
            out = out.replace(page, ours)
        return out


def commands(block: str) -> list[list[str]]:
    joined = block.replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def afe_argv(words: list[str]) -> list[str]:
    assert words[0] == "afe", words
    return [sys.executable, "-m", "services.cli.main", *words[1:]]


def run_shell_block(block: str, env: dict[str, str]) -> list[list[str]]:
    """`export` lines go into `env`; returns the other commands (afe ...)."""
    rest = []
    for words in commands(block):
        if words[0] == "export":
            name, _, value = words[1].partition("=")
            env[name] = value
        else:
            rest.append(words)
    return rest


def start(words: list[str], env: dict[str, str], base: Path) -> Afe:
    """An `afe up` of the page with what a second one on the same host needs (the page says so)."""
    one_host = ["--run", str(base / "run"), "--listen", "127.0.0.1:0", "--ops-port", "0",
                "--instance", f"join-{secrets.token_hex(4)}", "--no-images"]   # the images: `make images-ready`
    proc = subprocess.Popen(afe_argv(words) + one_host, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    afe = Afe(base, proc)

    def pump() -> None:
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, b""):
            afe.output.append(line.decode("utf-8", "replace"))

    threading.Thread(target=pump, daemon=True).start()
    return afe


def drop(words: list[str], *flags: str) -> list[str]:
    """`words` without each flag and its value."""
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w in flags:
            skip = True
        else:
            out.append(w)
    return out


def cli(words: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(afe_argv(words), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


@pytest.fixture(scope="module")
def deployment():
    """The admin and database steps of the page, on a PostgreSQL server of this module's own."""
    reason = postgres.skip_reason()
    if reason:
        pytest.skip(reason)
    base = temp_root("afe-join-")
    server = postgres.start_server()
    try:
        here = Here(base, server)
        steps = recipe()
        for words in run_shell_block(here.text(steps["admin"]), {}):
            done = cli(words, base_env())
            assert done.returncode == 0, done.stderr
        # "copy ca.pem, db.pem and db.key to /etc/postgresql/afe/ (owned by postgres, 0600)"
        here.db_tls.mkdir(mode=0o700)
        for name in ("ca.pem", "db.pem", "db.key"):
            shutil.copy(here.admin_pki / name, here.db_tls / name)
            os.chmod(here.db_tls / name, 0o600)
        if os.geteuid() == 0:
            for p in (here.db_tls, *here.db_tls.iterdir()):
                shutil.chown(p, "postgres", "postgres")
        for statement in here.text(steps["sql"]).split(";"):
            if statement.strip():
                server.sql(statement)
        data = server.root / "data"
        with open(data / "postgresql.conf", "a") as conf:
            conf.write("\n" + here.text(steps["postgresql.conf"]))
        hba = data / "pg_hba.conf"
        hba.write_text(here.text(steps["pg_hba.conf"]) + hba.read_text())
        server.sql("SELECT pg_reload_conf()")
        # "copy ca.pem and the machine's certificate and key to /etc/afe-pki/ (0600)"
        here.host_pki.mkdir(mode=0o700)
        for name in ("ca.pem", "afe-1.pem", "afe-1.key", "afe-2.pem", "afe-2.key"):
            shutil.copy(here.admin_pki / name, here.host_pki / name)
            os.chmod(here.host_pki / name, 0o600)
        demo.materialize(here.config)
        yield here, steps
    finally:
        postgres.stop_server(server)
        remove_temp_root(base)


@pytest.fixture
def closed_port():
    """A loopback port that refuses connections: bound, never listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def test_two_machines_on_one_database_from_the_recipe_each_runs_a_ticket_filed_through_it(deployment):
    here, steps = deployment
    base = here.base
    env1, env2 = base_env(), base_env()
    [first] = run_shell_block(here.text(steps["first machine"], "m1"), env1)
    [further] = run_shell_block(here.text(steps["further machine"], "m2"), env2)
    assert first[:2] == ["afe", "up"] and further[:3] == ["afe", "up", "--join"]

    # The database holds no deployment until the first machine has started: --join says so.
    early = subprocess.run([*afe_argv(further), "--run", str(base / "m2" / "run"), "--no-images"], cwd=ROOT,
                           env=env2, capture_output=True, text=True, timeout=60, check=False)
    assert early.returncode == 1
    assert ("holds no afe deployment yet: start the first machine without --join on it"
            in early.stdout), early.stdout + early.stderr

    # The database lets in only TLS with a certificate of the CA (positive control of the pg_hba lines).
    url = env1["AFE_DATABASE_URL"]
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(url + "?sslmode=disable", connect_timeout=5).close()

    machines: list[Afe] = []
    try:
        machines.append(start(first, env1, base / "m1"))
        machines[0].wait_up()
        machines.append(start(further, env2, base / "m2"))
        machines[1].wait_up()
        assert "afe up: joining the deployment on the PostgreSQL database afe on localhost port " \
               f"{here.server.port}" in machines[1].text()

        tickets = {}
        for i, afe in enumerate(machines):
            p = afe.cli("ticket", "create", "--workflow", "demo-fix", "--title", f"add() subtracts (machine {i + 1})")
            assert p.returncode == 0, p.stdout + p.stderr
            found = re.search(r"^created (\S+) ", p.stdout, re.MULTILINE)
            assert found, p.stdout
            tickets[i] = found.group(1)
        for i, tid in tickets.items():
            watched = machines[i].cli("ticket", "watch", tid, "--until-waiting", timeout=400)
            assert watched.returncode == 6, watched.stdout[-3000:] + watched.stderr[-2000:]
        # One deployment: each machine shows the ticket filed through the other.
        for i, tid in tickets.items():
            other = machines[1 - i].cli("ticket", "show", tid, "--json")
            assert other.returncode == 0 and '"waiting_approval"' in other.stdout, other.stdout[-2000:]
        # Each machine's credential broker checks the fences in the shared database.
        for afe in machines:
            assert "fences are checked in the PostgreSQL database afe on localhost" in afe.text(), afe.text()[-3000:]
        # Cancelled through the other machine: the owner sees it on its heartbeat and tears the ticket down.
        for i, tid in tickets.items():
            assert machines[1 - i].cli("ticket", "cancel", tid).returncode == 0
        for i, tid in tickets.items():
            assert machines[i].cli("ticket", "watch", tid, timeout=120).returncode == 5
    finally:
        for afe in reversed(machines):
            afe.stop(30)


def test_r39_join_refuses_a_database_of_another_ca_or_without_tls_saying_what_to_change(deployment, pg_url, closed_port):
    here, steps = deployment
    base = here.base
    env = base_env()
    [further] = run_shell_block(here.text(steps["further machine"], "m3"), env)
    extra = ["--run", str(base / "m3" / "run"), "--no-images"]

    def refused(words: list[str], environ: dict[str, str]) -> str:
        done = subprocess.run(afe_argv(words) + extra, cwd=ROOT, env=environ, capture_output=True, text=True,
                              timeout=60, check=False)
        assert done.returncode != 0, done.stdout
        return done.stdout + done.stderr

    # A CA that does not match: another deployment's CA and a certificate of it.
    other = base / "other-pki"
    assert cli(["afe", "certs", str(other), "--name", "afe-2"], base_env()).returncode == 0
    swapped = [w.replace(str(here.host_pki), str(other)) for w in further]
    out = refused(swapped, env)
    assert "is not signed by the CA" in out and f"{other}/ca.pem (--ca): give the deployment's ca.pem" in out, out
    assert PASSWORD not in out
    # This machine's certificate of another CA, with the deployment's CA.
    mixed = [w.replace(f"{here.host_pki}/afe-2.", f"{other}/afe-2.") for w in further]
    out = refused(mixed, env)
    assert f"the certificate {other}/afe-2.pem (--tls-cert) is not signed by the CA {here.host_pki}/ca.pem" in out
    # A SQLite store.
    out = refused(further, {**env, "AFE_DATABASE_URL": f"sqlite:///{base}/m3.db"})
    assert "--join: a sqlite store is one machine's; the machines of a deployment share one PostgreSQL" in out
    # A database without TLS (the session's server).
    out = refused(further, {**env, "AFE_DATABASE_URL": pg_url})
    assert "does not speak TLS: set ssl = on with a certificate of the deployment CA" in out, out
    # A database that does not answer.
    out = refused(further, {**env, "AFE_DATABASE_URL": f"postgresql://afe:x@localhost:{closed_port}/afe"})
    assert f"cannot reach the PostgreSQL database afe on localhost port {closed_port}" in out, out
    # The TLS files left out.
    out = refused(drop(further, "--tls-cert", "--tls-key"), env)
    assert "--join needs --tls-cert, --tls-key: the link to the database leaves this machine" in out, out
    # A password on the command line.
    out = refused([*further, "--database-url", env["AFE_DATABASE_URL"]], {**env, "AFE_DATABASE_URL": ""})
    assert "--database-url holds a password" in out and PASSWORD not in out
