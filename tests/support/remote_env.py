"""A remote for tests that talk to a REAL credential broker process (the
scheduler's, the credential broker's own and the system tests): a TLS
smart-HTTP git server (tests/support/fakes/git_http.py) serving bare
repositories, and a fake GitHub API whose branches are the served
repository's real refs."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.fakes.git_http import GitHttpServer, make_bare_repo
from tests.support.fakes.github import FakeGitHub
from tests.support.fakes.tls import TestCert, make_cert

FILES = {"README.md": "# widgets\n", "src/app.py": "print('hi')\n"}
TOKEN_ENV = "GIT_TOKEN"

SANDBOX = """\
sandbox:
  image: afe/sandbox:latest
  limits: {cpus: 1, memory: 256m, pids: 128}
"""


class LiveBranches(dict):
    """`FakeGitHub.branches` read from a bare repository's refs on each lookup."""

    def __init__(self, bare: Path) -> None:
        super().__init__()
        self.bare = bare

    def get(self, name, default=None):
        res = subprocess.run(["git", "--git-dir", str(self.bare), "rev-parse", "--verify", "-q",
                              f"refs/heads/{name}"], capture_output=True, text=True, check=False)
        return res.stdout.strip() or default

    def __contains__(self, name) -> bool:
        return bool(self.get(name))


class HoldingGitHub(FakeGitHub):
    """With `hold_create`, a PR creation is done (the PR exists) but its answer
    waits for `release`: the caller can be killed after the side effect."""

    def __init__(self, token: str, bare: Path) -> None:
        super().__init__(token)
        self.branches = LiveBranches(bare)
        self.hold_create = False
        self.held = asyncio.Event()
        self.release = asyncio.Event()

    async def create_pull(self, request):
        resp = await super().create_pull(request)
        if self.hold_create:
            self.held.set()
            await self.release.wait()
        return resp


@dataclass
class Remote:
    root: Path
    bare: Path
    token: str
    cert: TestCert
    git: GitHttpServer
    github: HoldingGitHub

    def workspace(self, name: str, repo: str = "origin.git", token_env: str = TOKEN_ENV, url: str = "") -> str:
        return (f"kind: Workspace\nname: {name}\nrepo: {url or self.git.url(repo)}\nbaseBranch: main\n"
                f"tokenEnv: {token_env}\n"
                f"forge: {{type: github, repo: acme/widgets, baseUrl: '{self.github.url}'}}\n" + SANDBOX)

    def branches(self, prefix: str = "afe/") -> list[str]:
        out = subprocess.run(["git", "--git-dir", str(self.bare), "for-each-ref", "--format=%(refname:short)",
                              f"refs/heads/{prefix}"], capture_output=True, text=True, check=True).stdout
        return out.split()

    def broker_env(self, **extra: str) -> dict[str, str]:
        return {TOKEN_ENV: self.token, "AFE_CA_FILE": str(self.cert.cert_file), **extra}


@contextlib.asynccontextmanager
async def remote(root: Path) -> AsyncIterator[Remote]:
    token = "tok" + secrets.token_hex(12) + "Zq"
    cert = make_cert(root / "tls")
    served = root / "served"
    served.mkdir()
    bare = make_bare_repo(served, "origin.git", FILES)
    with GitHttpServer(served, token, cert.server_context()) as git:
        async with HoldingGitHub(token, bare) as github:
            yield Remote(served, bare, token, cert, git, github)


def write_config(root: Path, documents: list[str]) -> Path:
    cfg = root / "cfg"
    cfg.mkdir(parents=True, exist_ok=True)
    (cfg / "afe.yaml").write_text("---\n".join(documents))
    return cfg
