"""Where a ticket continues from across retries (Engine.reopen, a node's
retries, a restarted scheduler): the ticket keeps its branch `afe/<ticket>`.

`resume_point` picks the head and checkout a new workspace starts from (the
pushed branch, else the state kept at release), `keep` stores a released
workspace's last state in the mirror for that, and `update_branch` merges the
base branch into the pushed branch on the host (R37: `--force-with-lease`,
nothing pushed on a conflict). They work on a `WorkspaceGit`'s git runner,
mirrors and locks; host.py holds the rest of a workspace's life.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.config.model import Workspace
from services.common.errors import FailedPrecondition, NotFound
from services.common.layout import check_ticket_id

if TYPE_CHECKING:
    from services.credentials.workspaces.gitwork import GitWork as WorkspaceGit

log = logging.getLogger(__name__)

KEPT_REF = "refs/afe/kept/"     # + ticket id, in the mirror: a released workspace's last state


def branch_for(ticket_id: str) -> str:
    return f"afe/{check_ticket_id(ticket_id)}"


def author_env(ws: Workspace) -> dict[str, str]:
    """The Workspace's author as git's author and committer of the commits afe makes."""
    return {"GIT_AUTHOR_NAME": ws.author.name, "GIT_AUTHOR_EMAIL": ws.author.email,
            "GIT_COMMITTER_NAME": ws.author.name, "GIT_COMMITTER_EMAIL": ws.author.email}


async def resume_point(wg: WorkspaceGit, mirror: Path, ticket_id: str, ws: Workspace) -> tuple[str, str, str]:
    """(branch head, commit to check out, base) of a ticket's workspace.

    A new ticket starts at the base branch's head. A ticket that ran
    before (a retry, Engine.reopen) continues on its own branch: the
    pushed `afe/<ticket>` when the remote has it (it may hold an
    update-branch merge), else the branch it had when its workspace was
    released; the checkout is the kept workspace (uncommitted work
    included) when it sits on that head. The base is where the branch
    forked from the base branch now."""
    branch = branch_for(ticket_id)
    kept_ref = f"{KEPT_REF}{ticket_id}"
    base, kept, kept_head, pushed = await wg._revs(mirror, [
        f"refs/heads/{ws.base_branch}^{{commit}}", f"{kept_ref}^{{commit}}", f"{kept_ref}^1",
        f"refs/heads/{branch}^{{commit}}"])
    if base is None:
        raise NotFound(f"workspace {ws.name!r}: branch {ws.base_branch!r} does not exist in "
                       f"{wg.mirrors.remote(ws).url}; check the Workspace's baseBranch")
    if not kept:
        kept_head = None
    head = pushed or kept_head
    if head is None:
        return base, base, base
    fork = await wg.git.run(["merge-base", "--end-of-options", head, base], git_dir=mirror, check=False,
                            what="git merge-base")
    fork_sha = fork.out.strip() if fork.returncode == 0 and fork.out.strip() else base
    checkout = kept if kept and kept_head == head else head
    log.info("ticket %s continues on %s at %s", ticket_id, branch, head[:12])
    return head, checkout, fork_sha


async def keep(wg: WorkspaceGit, ws: Workspace, ticket_id: str, work: Path | None = None) -> None:
    """Before the workspace goes: its last state (a commit of the safe
    snapshot on top of the branch head) under `refs/afe/kept/<ticket>` in
    the mirror, which only the host reads. A retry starts from it."""
    gitdir = wg.layout.gitdir(ticket_id)
    work = work or wg.layout.workspace(ticket_id)
    if not (gitdir / "afe-ready").exists() or not work.is_dir():
        return
    if not any(os.scandir(work)):
        # A prepared workspace is never empty (checkout, scratch .git): an
        # empty one lost its content (a disk-capped workspace whose image
        # went first). Keeping it would make a retry start from nothing.
        log.warning("ticket %s: its workspace is empty; nothing kept for a retry", ticket_id)
        return
    head = await wg._rev(gitdir, f"refs/heads/{branch_for(ticket_id)}")
    if head is None:
        return
    tree = (await wg.snapshot_tree(ticket_id, work)).tree
    env = author_env(ws)
    res = await wg.git.run(["commit-tree", "-p", head, "-F", "-", tree], git_dir=gitdir, env=env,
                           stdin=f"afe: workspace of ticket {ticket_id} when it ended\n".encode(),
                           what="git commit-tree (keep)")
    sha = res.out.strip()
    # The objects the mirror lacks (everything past the base it lent), copied as a pack: no transport.
    lent = await wg._rev(gitdir, "refs/afe/base")
    objects = await wg.git.run(["rev-list", "--objects", "--end-of-options", sha,
                                *([f"^{lent}"] if lent else [])], git_dir=gitdir, what="git rev-list (keep)")
    pack = await wg.git.run(["pack-objects", "-q", "--stdout"], git_dir=gitdir, stdin=objects.stdout,
                            what="git pack-objects (keep)")
    mirror = wg.mirrors.path(ws)
    async with wg._lock(str(mirror)):
        await wg.git.run(["unpack-objects", "-q"], git_dir=mirror, stdin=pack.stdout,
                         what="git unpack-objects (keep)")
        await wg.git.run(["update-ref", "--end-of-options", f"{KEPT_REF}{ticket_id}", sha], git_dir=mirror,
                         what="git update-ref (keep)")


async def update_branch(wg: WorkspaceGit, ws: Workspace, ticket_id: str) -> tuple[str, bool, list[str]]:
    """Merge the base branch into the ticket's pushed branch, on the host,
    and push the merge (to the fork of `forge.pushRepo`, where the branch
    lives then; the mirror's branch is the fork's, mirrors.py). Returns
    (new head, changed, conflicting paths); with conflicts nothing is pushed."""
    branch = branch_for(ticket_id)
    remote = wg.mirrors.push_remote(ws)
    async with wg._lock("ticket:" + ticket_id):
        mirror = await wg.mirrors.update(ws)
        head = await wg._rev(mirror, f"refs/heads/{branch}^{{commit}}")
        if head is None:
            raise FailedPrecondition(f"ticket {ticket_id} has no pushed branch {branch}; retry the ticket "
                                     "so it opens its pull request first")
        base = await wg._rev(mirror, f"refs/heads/{ws.base_branch}^{{commit}}")
        if base is None:
            raise NotFound(f"workspace {ws.name!r}: branch {ws.base_branch!r} does not exist")
        up = await wg.git.run(["merge-base", "--is-ancestor", "--end-of-options", base, head],
                              git_dir=mirror, check=False, what="git merge-base")
        if up.returncode == 0:
            return head, False, []
        res = await wg.git.run(["merge-tree", "--write-tree", "--name-only", "--no-messages", "-z",
                                "--end-of-options", head, base], git_dir=mirror, check=False, what="git merge-tree")
        parts = [p.decode("utf-8", "replace") for p in res.stdout.split(b"\0")]
        if res.returncode == 1:
            files: list[str] = []
            for p in parts[1:]:
                if not p:
                    break          # the end of the conflicted files
                files.append(p)
            return head, False, sorted(set(files))
        if res.returncode != 0:
            raise FailedPrecondition(f"cannot merge {ws.base_branch} into {branch}: {res.err.strip()[:300]}")
        tree = parts[0].strip()
        env = author_env(ws)
        msg = f"Merge {ws.base_branch} into {branch}\n\nafe ticket {ticket_id}: update branch\n"
        out = await wg.git.run(["commit-tree", "-p", head, "-p", base, "-F", "-", tree], git_dir=mirror,
                               env=env, stdin=msg.encode(), what="git commit-tree")
        sha = out.out.strip()
        # --force-with-lease: a branch that moved meanwhile is never overwritten.
        await wg.mirrors.remote_git(ws, remote, ["push", "--quiet", "--no-verify", "--no-recurse-submodules",
                                          f"--force-with-lease=refs/heads/{branch}:{head}",
                                          "--end-of-options", remote.url,
                                          f"{sha}:refs/heads/{branch}"], mirror, "git push to",
                                   "forge.pushRepo" if ws.forge.push_repo else "repo")
        await wg.git.run(["update-ref", "--end-of-options", f"refs/heads/{branch}", sha, head],
                         git_dir=mirror, what="git update-ref")
        log.info("updated %s of ticket %s with %s: %s", branch, ticket_id, ws.base_branch, sha[:12])
        return sha, True, []
