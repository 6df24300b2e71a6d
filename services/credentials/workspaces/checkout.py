"""A ticket's checkout: a commit written into a new folder by host git (the
only time host git has the workspace as its work tree, before any sandbox
exists), with, optionally, a scratch `.git` of the workspace's own for the
sandbox's `git status`/`git diff`. Handing the folder to the sandbox user is
host.py's (`WorkspaceGit._chown`).

The one other time: `fill`, a workspace restored for a new attempt
(RestoreWorkspace), emptied first without following a link, while the
scheduler holds the ticket's sandbox frozen, so nothing in it can plant a
path between the emptying and the checkout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from pathlib import Path

from services.common.errors import FailedPrecondition
from services.common.host.gitcmd import GitRunner
from services.common.safefs import remove_tree


async def populate(git: GitRunner, git_dir: Path, target: Path, sha: str, index: Path, *,
                   scratch_git: bool) -> None:
    """Check `sha` of `git_dir` out into the new folder `target` (`index` is a
    temporary index file, removed after); with `scratch_git`, add `scratch_repo`."""
    target.mkdir(mode=0o755)  # noqa: ASYNC240 - one mkdir on the local disk
    try:
        await git.run(["-c", "checkout.workers=0", "read-tree", "--reset", "-u", "--end-of-options", sha],
                      git_dir=git_dir, work_tree=target, env={"GIT_INDEX_FILE": str(index)},
                      what="git checkout")
    finally:
        index.unlink(missing_ok=True)  # noqa: ASYNC240 - one unlink of a local temp file
    if scratch_git:
        await scratch_repo(git, git_dir, target, sha)


async def fill(git: GitRunner, git_dir: Path, target: Path, sha: str, index: Path, scratch_sha: str, *,
               scratch_git: bool) -> None:
    """Check `sha` out into the existing, empty folder `target` (a workspace emptied for a new
    attempt, RestoreWorkspace); with `scratch_git`, its `.git` holds `scratch_sha` (the branch head,
    what the sandbox's `git diff` compares with)."""
    if any(os.scandir(target)):
        raise FailedPrecondition(f"{target.name}: the workspace is not empty; it cannot be restored into")
    try:
        await git.run(["-c", "checkout.workers=0", "read-tree", "--reset", "-u", "--end-of-options", sha],
                      git_dir=git_dir, work_tree=target, env={"GIT_INDEX_FILE": str(index)},
                      what="git checkout")
    finally:
        index.unlink(missing_ok=True)  # noqa: ASYNC240 - one unlink of a local temp file
    if scratch_git:
        # The workspace may be its own mount by now (the sandbox broker's disk cap): the pack is
        # written beside the git dir and copied in (git renames its temporary file into place).
        packs = git_dir / "afe-restore-pack"
        packs.mkdir(exist_ok=True)
        try:
            await scratch_repo(git, git_dir, target, scratch_sha, pack_dir=packs)
        finally:
            with contextlib.suppress(OSError):
                remove_tree(packs)


def _copy_packs(made: Path, into: Path) -> None:
    for f in sorted(made.glob("pack-*")):
        shutil.copyfile(f, into / f.name)


async def scratch_repo(git: GitRunner, git_dir: Path, target: Path, sha: str, pack_dir: Path | None = None) -> None:
    """Give the workspace a `.git` of its own, for the sandbox's `git status`/`git diff`:
    a shallow repository holding only the base commit, on branch `workspace`.
    It is written now, before any sandbox exists; host git never reads it again.
    `pack_dir`: write the pack there first (the git dir's file system) and copy it in."""
    scratch = target / ".git"
    await git.run(["init", "-q", "--bare", "--", str(scratch)], what="git init (scratch)")
    objects = await git.run(["rev-list", "--objects", "--no-walk", "--end-of-options", sha],
                            git_dir=git_dir, what="git rev-list")
    into = scratch / "objects" / "pack"
    await git.run(["pack-objects", "-q", "--", str((pack_dir or into) / "pack")],
                  git_dir=git_dir, stdin=objects.stdout, what="git pack-objects")
    if pack_dir is not None:
        await asyncio.to_thread(_copy_packs, pack_dir, into)
    (scratch / "shallow").write_text(sha + "\n")
    await git.run(["config", "core.bare", "false"], git_dir=scratch)
    await git.run(["update-ref", "--end-of-options", "refs/heads/workspace", sha], git_dir=scratch)
    await git.run(["symbolic-ref", "HEAD", "refs/heads/workspace"], git_dir=scratch)
    await git.run(["read-tree", "--end-of-options", sha], git_dir=scratch,
                  env={"GIT_INDEX_FILE": str(scratch / "index")}, what="git read-tree (scratch)")
