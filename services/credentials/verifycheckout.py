"""The clean-room checkout of a head for its verification (R41).

`<data>/workspaces/<ticket>-verify` is a NEW folder every time: the commit
`sha` (the pull request's head a person is asked to approve), with each of
`base_paths` replaced by the base branch's version of it. Built with git
plumbing on a temporary index of the ticket's private git dir, never a work
tree the sandbox wrote:

    read-tree <sha>                       # the head, in a temporary index
    ls-tree -r <sha> -- <path>            # the head's entries under each path: removed
    ls-tree -r <base> -- <path>           # the base's entries: added
    update-index -z --index-info          # both, in one go
    write-tree; commit-tree -p <sha>      # the commit checked out

then checked out like a ticket's workspace (checkout.populate) and handed to
the sandbox user. The base is the base branch's tip in the mirror, fetched
now. A `sha` the ticket's git dir does not know (a person pushed to the
branch) is fetched into the mirror, whose objects the git dir borrows.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from services.common.config import Workspace
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.common.layout import verify_id
from services.common.schema.verify import MAX_BASE_PATHS, base_path_problem

from .continuation import author_env
from .workspaces import _remove_workspace

if TYPE_CHECKING:
    from .workspaces import WorkspaceGit

log = logging.getLogger(__name__)

SHA_RE = re.compile(r"^[0-9a-f]{40}$")
_LITERAL = {"GIT_LITERAL_PATHSPECS": "1"}   # a path is a path, never a glob or a magic pathspec


@dataclass(frozen=True)
class Verification:
    sha: str          # the head
    base_sha: str     # the base branch's tip the base paths came from
    tree: str         # the tree checked out
    commit: str       # the commit checked out
    workspace_ticket: str



def check_base_paths(paths: list[str] | tuple[str, ...]) -> list[str]:
    """Relative paths inside the repository, normalised ("tests/" -> "tests");
    refused: empty, absolute, `..`, `.git`, control characters."""
    if len(paths) > MAX_BASE_PATHS:
        raise InvalidArgument(f"at most {MAX_BASE_PATHS} base paths; list fewer, wider folders")
    out: list[str] = []
    for raw in paths:
        problem = base_path_problem(raw)
        if problem:
            raise InvalidArgument(f"base path {raw[:200]!r} {problem}")
        p = str(PurePosixPath(raw))
        if p not in out:
            out.append(p)
    return out


async def prepare(wg: WorkspaceGit, ws: Workspace, ticket_id: str, sha: str,
                  base_paths: list[str], into: Path | None = None) -> Verification:
    """The checkout at <data>/workspaces/<ticket>-verify, or with `into` (a new folder,
    private to this broker) there instead, for a sandbox broker on another host."""
    sha = (sha or "").lower()
    if not SHA_RE.match(sha):
        raise InvalidArgument("sha must be a full commit SHA (40 hex digits)")
    paths = check_base_paths(base_paths)
    vid = verify_id(ticket_id)
    target = into or wg.layout.workspace(vid)   # checks the id (at most 63 characters)
    gitdir = wg._ticket_gitdir(ticket_id)
    async with wg._lock("ticket:" + ticket_id):
        # the base's tip and any commit a person pushed to the branch
        mirror = await wg.mirrors.update(ws)
        if await wg._rev(gitdir, sha + "^{commit}") is None:
            raise NotFound(f"commit {sha[:12]} is in neither the ticket's git dir nor the repository "
                           f"of workspace {ws.name!r}; push it to the pull request's branch")
        base = await wg._rev(mirror, f"refs/heads/{ws.base_branch}") or ""
        if paths and not base:
            raise FailedPrecondition(f"workspace {ws.name!r}: base branch {ws.base_branch!r} is missing in its "
                                     "repository; fix base_branch or push the branch")
        commit = sha
        if paths:
            commit = await _with_base_paths(wg, ws, gitdir, sha, base, paths)
        tree = await wg._rev(gitdir, commit + "^{tree}") or ""
        if into is None:
            await asyncio.to_thread(_clear, target)
            wg.layout.workspaces_dir.mkdir(parents=True, exist_ok=True, mode=0o711)
        await wg._populate(gitdir, target, commit, gitdir / "afe-verify-checkout.index")
    log.info("ticket %s: verification checkout of %s (%s from %s)", ticket_id, sha[:12],
             ", ".join(paths) or "no base paths", base[:12] or "-")
    return Verification(sha, base, tree, commit, vid)


async def _with_base_paths(wg: WorkspaceGit, ws: Workspace, gitdir: Path, sha: str, base: str,
                           paths: list[str]) -> str:
    """A commit (child of `sha`) whose tree is `sha`'s with `paths` taken from `base`."""
    index = gitdir / "afe-verify.index"
    env = {"GIT_INDEX_FILE": str(index), **_LITERAL}
    try:
        await wg.git.run(["read-tree", "--end-of-options", sha], git_dir=gitdir, env=env, what="git read-tree")
        drop = await wg.git.run(["ls-tree", "-r", "-z", "--full-tree", sha, "--", *paths], git_dir=gitdir,
                                env=env, what="git ls-tree")
        take = await wg.git.run(["ls-tree", "-r", "-z", "--full-tree", base, "--", *paths], git_dir=gitdir,
                                env=env, what="git ls-tree")
        info = b"".join(b"0 " + b"0" * 40 + b"\t" + e.split(b"\t", 1)[1] + b"\0"
                        for e in drop.stdout.split(b"\0") if b"\t" in e)
        info += take.stdout
        if info:
            await wg.git.run(["update-index", "-z", "--index-info"], git_dir=gitdir, env=env, stdin=info,
                             what="git update-index")
        tree = (await wg.git.run(["write-tree"], git_dir=gitdir, env=env, what="git write-tree")).out.strip()
    finally:
        index.unlink(missing_ok=True)
    msg = (f"afe verification of {sha}\n\n{', '.join(paths)} from {ws.base_branch} at {base}\n").encode()
    res = await wg.git.run(["commit-tree", "-p", sha, "-F", "-", tree], git_dir=gitdir, env=author_env(ws),
                           stdin=msg, what="git commit-tree")
    return res.out.strip()


def _clear(target: Path) -> None:
    if target.exists() or target.is_symlink():
        _remove_workspace(target)
    if target.exists() or target.is_symlink():
        raise FailedPrecondition(f"the old verification folder {target.name} is still mounted; remove its "
                                 "sandbox (DestroySandbox) first")


async def release(wg: WorkspaceGit, ticket_id: str) -> None:
    """Remove the verification folder (nothing when there is none)."""
    await asyncio.to_thread(_remove_only, wg.layout.workspace(verify_id(ticket_id)))


def _remove_only(target: Path) -> None:
    if target.exists() or target.is_symlink():
        _remove_workspace(target)
