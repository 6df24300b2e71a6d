"""The repositories behind the Workspaces: where each one lives and how git
may reach it (`Remote`: an https URL with the token handed over by askpass,
or a local path), where the tickets' branches are pushed (`push_remote`: the
repository, or the fork named by `forge.pushRepo`), the bare mirror of it
this broker keeps, and git commands that talk to a remote, tried again when
they fail transiently.

With a fork, the mirror's `refs/heads/afe/*` are the fork's (fetched from it),
never the repository's own branches of that name: every reader of a ticket's
pushed branch (a retry's resume point, update-branch, the verification's
checkout, the record's signing check) reads the branch where afe pushes it."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.common import safefs
from services.common.config.model import Workspace
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.common.host.askpass import askpass_env, origin_of
from services.common.host.gitcmd import GitFailed, GitRunner
from services.common.layout import Layout
from services.common.schema.workspace import push_url
from services.common.secrecy.env_secrets import SecretValue
from services.credentials.git import failures as gitfailures

log = logging.getLogger(__name__)

TICKET_BRANCHES = "refs/heads/afe/*"     # the tickets' branches (continuation.branch_for)


@dataclass(frozen=True)
class Remote:
    """Where a workspace's repository lives and how git may reach it."""

    url: str                     # what git is given (never holds credentials)
    local: bool
    env: dict[str, str]          # askpass entries (https with a token) or {}

    def __repr__(self) -> str:  # the env may hold the token
        return f"Remote(url={self.url!r}, local={self.local})"


class Mirrors:
    def __init__(self, runner: GitRunner, layout: Layout, tokens: dict[str, SecretValue], askpass: Path,
                 config_dir: Path | None, lock: Callable[[str], asyncio.Lock]) -> None:
        """`lock(key)`: the lock shared with WorkspaceGit (a mirror's key is its path)."""
        self.git = runner
        self.layout = layout
        self.tokens = tokens
        self.askpass = askpass
        self.config_dir = config_dir
        self._lock = lock
        self.remote_attempts = 3        # tries of a fetch/push that failed transiently (5xx, time-out)
        self.remote_backoff_s = 0.5     # first wait between them; doubles

    def remote(self, ws: Workspace) -> Remote:
        repo = ws.repo.strip()
        if repo.startswith("https://"):
            origin_of(repo)  # refuses userinfo
            env: dict[str, str] = {}
            if ws.token_env:
                secret = self.tokens.get(ws.token_env)
                if secret is None:
                    raise FailedPrecondition(
                        f"workspace {ws.name!r}: environment variable {ws.token_env} (its tokenEnv) is not set "
                        "in the credential broker's environment; export it before starting afe")
                env = askpass_env(self.askpass, repo, secret.reveal())
            return Remote(repo, False, env)
        if "://" in repo and not repo.startswith("file://"):
            raise InvalidArgument(f"workspace {ws.name!r}: repo must be an https:// URL or a local path "
                                  f"(got a {repo.split('://')[0]}:// URL)")
        path = Path(repo.removeprefix("file://"))
        if not path.is_absolute():
            path = (self.config_dir or Path.cwd()) / path
        if not path.exists():
            raise NotFound(f"workspace {ws.name!r}: repository {path} does not exist; check its repo field")
        return Remote(str(path), True, {})

    def push_remote(self, ws: Workspace) -> Remote:
        """Where the ticket's branch is pushed: the Workspace's repository, or with
        `forge.pushRepo` that fork, on the same host and with the same token
        (the askpass entries answer for the host, so they serve both)."""
        remote = self.remote(ws)
        if not ws.forge.push_repo:
            return remote
        url = push_url(remote.url, ws.forge.push_repo) if not remote.local else None
        if url is None:
            raise InvalidArgument(f"workspace {ws.name!r}: forge.pushRepo needs repo to be an https:// URL "
                                  "ending in owner/name; the fork is reached on the same host")
        return Remote(url, False, remote.env)

    def path(self, ws: Workspace) -> Path:
        # With a fork the mirror's ticket branches are the fork's: a mirror of its own.
        ident = ws.repo.strip() + (f"\0push:{ws.forge.push_repo}" if ws.forge.push_repo else "")
        key = hashlib.sha256(ident.encode()).hexdigest()[:24]
        return self.layout.mirrors_dir / f"{key}.git"

    async def remote_git(self, ws: Workspace, remote: Remote, args: list[str], git_dir: Path,
                          operation: str, field: str = "repo") -> None:
        """Run a git command that talks to the remote. A definitive failure (auth,
        not found, DNS, TLS, a corrupt object, a rejected ref) fails at once with
        what to change; a transient one (5xx, time-out, reset) is tried again
        `remote_attempts` times in all, with back-off (see failures.py)."""
        attempts = max(1, self.remote_attempts)
        for attempt in range(1, attempts + 1):
            try:
                await self.git.run(args, git_dir=git_dir, env=remote.env, allow_file=remote.local,
                                   what=operation.split()[0] + " " + operation.split()[1])
                return
            except GitFailed as exc:
                failure = gitfailures.classify(exc.stderr)
                if failure.kind != gitfailures.TRANSIENT or attempt == attempts:
                    raise gitfailures.error_for(failure, ws, operation, remote.url, attempt, field) from None
                wait = self.remote_backoff_s * (2 ** (attempt - 1))
                log.info("%s %s: %s; trying again in %.1fs (attempt %s of %s)", operation, remote.url,
                         failure.detail, wait, attempt + 1, attempts)
                await asyncio.sleep(wait)

    async def update(self, ws: Workspace) -> Path:
        remote = self.remote(ws)
        mirror = self.path(ws)
        async with self._lock(str(mirror)):
            if not (mirror / "HEAD").exists():
                self.layout.mirrors_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
                tmp = Path(tempfile.mkdtemp(prefix=".new-", dir=self.layout.mirrors_dir))
                await self.git.run(["init", "--bare", "-q", "--", str(tmp)], what="git init (mirror)")
                try:
                    await self._fetch(ws, remote, tmp)
                except BaseException:
                    await asyncio.to_thread(safefs.remove_tree, tmp)
                    raise
                os.replace(tmp, mirror)
            else:
                await self._fetch(ws, remote, mirror)
        return mirror

    async def _fetch(self, ws: Workspace, remote: Remote, git_dir: Path) -> None:
        fetch = ["fetch", "--quiet", "--prune", "--no-tags", "--no-recurse-submodules", "--end-of-options"]
        if not ws.forge.push_repo:
            await self.remote_git(ws, remote, [*fetch, remote.url, "+refs/heads/*:refs/heads/*"],
                                  git_dir, "git fetch from")
            return
        # The repository's branches but its afe/* (a negative refspec: neither fetched nor
        # pruned), then the fork's afe/*, pruned when the fork lost them.
        await self.remote_git(ws, remote, [*fetch, remote.url, "+refs/heads/*:refs/heads/*", f"^{TICKET_BRANCHES}"],
                              git_dir, "git fetch from")
        fork = self.push_remote(ws)
        await self.remote_git(ws, fork, [*fetch, fork.url, f"+{TICKET_BRANCHES}:{TICKET_BRANCHES}"],
                              git_dir, "git fetch from", "forge.pushRepo")
