"""`afe check`: can each Workspace's repository be reached, and does it have
the base branch? A local repository (a path or file:// URL) is looked at
at once; an https:// one only with `--online` (`git ls-remote`, the token
from the Workspace's tokenEnv given to git by the askpass helper, never in
argv). Git runs as the credential broker runs it: with `AFE_CA_FILE` as its
CA bundle (a git server of a private CA) and the operator's proxy settings,
so what `afe check --online` can read, `afe up` can clone. Returns problem
lines that say what to change."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.config.model import Config, Workspace
from services.common.errors import AfeError
from services.common.secrecy.childenv import proxy_env
from services.common.secrecy.redact import Redactor

if TYPE_CHECKING:
    from services.common.host.gitcmd import GitRunner


def local_path(config: Config, ws: Workspace) -> Path | None:
    repo = ws.repo.strip()
    if repo.startswith("https://"):
        return None
    path = Path(repo.removeprefix("file://")).expanduser()
    return path if path.is_absolute() else config.directory / path


async def _local(config: Config, ws: Workspace, runner: GitRunner) -> str | None:
    from services.common.host.gitrepo import git_dir

    path = local_path(config, ws)
    assert path is not None
    where = f"{ws.source} Workspace {ws.name} repo"
    if not path.exists():
        return (f"{where}: {path} does not exist; create the repository there (git init) or fix repo "
                "(a relative path is relative to the config folder)")
    try:
        gdir = git_dir(path, ws.name)
    except AfeError as exc:
        return f"{where}: {exc.message}"
    res = await runner.run(["rev-parse", "--verify", "--quiet", "--end-of-options",
                            f"refs/heads/{ws.base_branch}^{{commit}}"], git_dir=gdir, check=False,
                           what="git rev-parse")
    if res.returncode != 0:
        heads = await runner.run(["for-each-ref", "--format=%(refname:short)", "refs/heads/"], git_dir=gdir,
                                 check=False, what="git for-each-ref")
        have = ", ".join(heads.out.split()) or "none (commit something first)"
        return (f"{ws.source} Workspace {ws.name} baseBranch: {path} has no branch {ws.base_branch!r}; "
                f"branches: {have}. Set baseBranch or create the branch")
    return None


async def _base_paths(config: Config, ws: Workspace, runner: GitRunner) -> list[str]:
    """Every `verify.base_paths` entry of the Workspace's workflows is on its base branch:
    the clean room takes each from there, so one the branch lacks fails every verification
    to run, found only once a ticket's change waits for its approval."""
    from services.common.host.gitrepo import git_dir

    path = local_path(config, ws)
    assert path is not None
    gdir = git_dir(path, ws.name)
    problems = []
    for wf in sorted(config.workflows.values(), key=lambda w: w.name):
        if wf.workspace != ws.name or wf.verify is None:
            continue
        for p in wf.verify.base_paths:
            name = p.rstrip("/")
            res = await runner.run(["cat-file", "-e", f"refs/heads/{ws.base_branch}:{name}"], git_dir=gdir,
                                   check=False, what="git cat-file")
            if res.returncode != 0:
                problems.append(f"{wf.source} Workflow {wf.name} verify.base_paths: {p!r} is not on "
                                f"{ws.base_branch} of {path}, and every verification takes it from there; "
                                "name a folder or file the base branch has (its tests, e.g. tests/), "
                                "or remove it")
    return problems


async def _remote(ws: Workspace, runner: GitRunner, helper: Path, environ: Mapping[str, str]) -> str | None:
    from services.common.host.askpass import askpass_env

    env: dict[str, str] = {}
    if ws.token_env:
        token = environ.get(ws.token_env, "")
        if not token:
            return f"{ws.source} Workspace {ws.name} tokenEnv: {ws.token_env} is not set; export it and retry"
        runner.redactor.register(token)
        env = askpass_env(helper, ws.repo, token)
    res = await runner.run(["ls-remote", "--heads", "--end-of-options", ws.repo, f"refs/heads/{ws.base_branch}"],
                           env=env, check=False, what="git ls-remote", timeout_s=60)
    if res.returncode != 0:
        err = runner.redactor.redact(res.err.strip().splitlines()[-1] if res.err.strip() else "")
        hint = ("; if a private CA signed the server's certificate, set AFE_CA_FILE to its PEM bundle"
                if "certificate" in err.lower() else "")
        return (f"{ws.source} Workspace {ws.name} repo: cannot read {ws.repo} ({err or 'git failed'}); check "
                f"the URL, the network and that the token in tokenEnv may read the repository{hint}")
    if not res.out.strip():
        return (f"{ws.source} Workspace {ws.name} baseBranch: {ws.repo} has no branch {ws.base_branch!r}; "
                "set baseBranch to an existing branch")
    return None


def git_runner(home: Path, environ: Mapping[str, str]) -> GitRunner:
    """A GitRunner set up as the credential broker's (services/credentials/main.py):
    AFE_CA_FILE as git's CA bundle, the operator's proxy variables."""
    from services.common.host.gitcmd import GitRunner

    ca = environ.get("AFE_CA_FILE")
    return GitRunner(home, Redactor(), ca_file=Path(ca) if ca else None, proxies=proxy_env(environ), timeout_s=60)


def _ca_problem(environ: Mapping[str, str]) -> str | None:
    ca = environ.get("AFE_CA_FILE")
    if ca and not os.path.isfile(ca):
        return (f"AFE_CA_FILE={ca} is not a file: point it at the PEM bundle of the CA that signed your git "
                "server's certificate, or unset it")
    return None


def check_repositories(config: Config, *, online: bool, environ: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(problems, notes) for every Workspace's repository."""
    from services.common.host.askpass import write_helper

    async def go() -> tuple[list[str], list[str]]:
        problems: list[str] = []
        notes: list[str] = []
        if online and (ca_problem := _ca_problem(environ)):
            problems.append(ca_problem)
        with tempfile.TemporaryDirectory(prefix="afe-check-git-") as tmp:
            runner = git_runner(Path(tmp) / "home", environ)
            helper = write_helper(Path(tmp) / "askpass")
            for ws in sorted(config.workspaces.values(), key=lambda w: w.name):
                if local_path(config, ws) is not None:
                    line = await _local(config, ws, runner)
                    if line is None:
                        problems += await _base_paths(config, ws, runner)
                elif online:
                    line = await _remote(ws, runner, helper, environ)
                else:
                    notes.append(f"  note: workspace {ws.name}: {ws.repo} not contacted; `afe check --online` "
                                 "checks that it can be read and has the base branch")
                    continue
                if line:
                    problems.append(line)
        return problems, notes

    return asyncio.run(go())
