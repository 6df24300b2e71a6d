"""Fixtures for the credential broker tests: a TLS smart-HTTP git server that
demands a token, local bare repositories, and a helper to build a Config and
talk to the REAL broker servicer over a Unix socket."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from services._gen.afe.credentials.v1 import credentials_pb2_grpc as pb_grpc
from services.common.config.model import Config, ForgeConfig, Model, Workspace
from services.common.layout import Layout
from services.common.rpc import grpcutil
from tests.support.credential_broker import credential_broker
from tests.support.fakes.git_http import GitHttpServer, make_bare_repo
from tests.support.fakes.tls import make_cert

TOKEN_ENV = "AFE_TEST_GIT_TOKEN"
WRONG_ENV = "AFE_TEST_WRONG_TOKEN"

FILES = {"README.md": "# widgets\n", "src/app.py": "print('hi')\n", ".gitignore": "*.pyc\nbuild/\n"}


@pytest.fixture(scope="session")
def git_token() -> str:
    # Deliberately NOT shaped like any known token kind: only registration
    # with the redactor can hide it.
    return "tok" + secrets.token_hex(12) + "Zq"


@pytest.fixture(scope="session")
def session_dir():
    d = Path(tempfile.mkdtemp(prefix="afe-cbs-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def tls(session_dir):
    return make_cert(session_dir / "tls")


@pytest.fixture(scope="session")
def git_server(session_dir, tls, git_token):
    root = session_dir / "served"
    root.mkdir()
    make_bare_repo(root, "origin.git", FILES)
    with GitHttpServer(root, git_token, tls.server_context()) as server:
        yield server


@pytest.fixture
def closed_port():
    """A loopback port that refuses connections: bound (so nobody else takes it), never listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def make_config(directory: Path, *workspaces: Workspace, models: tuple[Model, ...] = ()) -> Config:
    return Config(directory=directory, workspaces={w.name: w for w in workspaces},
                  models={m.name: m for m in models})


def remote_workspace(server: GitHttpServer, name: str = "remote", repo: str = "origin.git", **kw) -> Workspace:
    kw.setdefault("token_env", TOKEN_ENV)
    return Workspace(name=name, repo=server.url(repo), forge=ForgeConfig(type="github", repo="acme/widgets"), **kw)


def local_workspace(path: Path, name: str = "local", **kw) -> Workspace:
    return Workspace(name=name, repo=str(path), **kw)


@pytest.fixture
def local_origin(short_tmp) -> Path:
    root = short_tmp / "repos"
    root.mkdir()
    return make_bare_repo(root, "origin.git", FILES)


@contextlib.asynccontextmanager
async def broker_stub(config: Config, layout: Layout, *, secrets_: dict[str, str] | None = None, ca_file=None):
    """(stub, redactor) talking to the real servicer as the scheduler."""
    from services.common.secrecy.redact import Redactor

    redactor = Redactor()
    async with credential_broker(config, layout, secrets=secrets_, redactor=redactor,
                                 ca_file=ca_file) as (sock, key), grpcutil.open_channel(sock, key) as ch:
        yield pb_grpc.CredentialBrokerStub(ch), redactor


def git_plain(*args: str, cwd: Path | None = None, env: dict | None = None, check: bool = True,
              stdin: bytes | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=cwd, env={**base, **(env or {})}, capture_output=True,
                          check=check, input=stdin, timeout=timeout)


def all_objects(git_dir: Path) -> bytes:
    """Every object's content in a repository (and its alternates)."""
    res = git_plain("--git-dir", str(git_dir), "cat-file", "--batch-all-objects", "--batch")
    return res.stdout


def tree_listing(git_dir: Path, rev: str) -> dict[str, tuple[str, str]]:
    out = git_plain("--git-dir", str(git_dir), "ls-tree", "-r", "-z", rev).stdout
    result = {}
    for item in out.split(b"\0"):
        if not item:
            continue
        meta, _, path = item.partition(b"\t")
        mode, _type, sha = meta.decode().split()
        result[path.decode()] = (mode, sha)
    return result


def files_under(root: Path) -> list[Path]:
    out = []
    for dirpath, _dirs, names in os.walk(root):
        out += [Path(dirpath) / n for n in names]
    return out
