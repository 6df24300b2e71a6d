"""Ticket workspaces on the host: mirror cache, prepare, commit, diff, push.

Layout per ticket (see services/common/layout.py):
  mirrors/<key>.git        bare mirror of the Workspace's repo (fetched on reuse)
  git/<ticket>.git         the ticket's own bare git dir, objects borrowed from
                           the mirror through `objects/info/alternates`
  workspaces/<ticket>/     the checkout the sandbox writes

Host git never runs with the workspace as its repository or work tree after
the initial checkout: commits are built from a safe walk of the workspace
(`snapshot.py`, `capture.py`) into the ticket's private git dir. The sandbox
can therefore never touch a config, hook, attribute file, object or ref that
host git uses. The checkout itself is in `checkout.py`, spare checkouts in
`spares.py`; remotes and the mirror in `mirrors.py`; where a ticket continues
from across retries (its kept state, update-branch) in `continuation.py`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from services.common import layout as layout_mod
from services.common import safefs
from services.common.config.model import Workspace
from services.common.errors import AfeError, FailedPrecondition, Internal, InvalidArgument
from services.common.layout import Layout
from services.common.schema.text import NODE_ID_RE
from services.common.secrecy.env_secrets import SecretValue
from services.credentials.workspaces import capture, checkout, compiled, continuation
from services.credentials.workspaces.continuation import KEPT_REF, author_env, branch_for

CHECKPOINT_REF = "refs/afe/checkpoints/"   # + node, in the ticket's git dir: its state after that node
from services.common.host.gitcmd import GitFailed, GitRunner
from services.credentials.git.mirrors import Mirrors
from services.credentials.workspaces.spares import Spares

log = logging.getLogger(__name__)

DEFAULT_DIFF_BYTES = 1024 * 1024

__all__ = ["DEFAULT_DIFF_BYTES", "KEPT_REF", "Committed", "Prepared", "WorkspaceGit", "branch_for"]


@dataclass(frozen=True)
class Prepared:
    base_sha: str
    branch: str


@dataclass(frozen=True)
class Committed:
    sha: str
    changed: bool
    files_changed: int
    # Other git repositories inside the workspace whose files are in the commit as
    # plain content (paths relative to the workspace root, "." for the root itself).
    nested_repositories: tuple[str, ...] = ()


class WorkspaceGit:
    def __init__(self, runner: GitRunner, layout: Layout, tokens: dict[str, SecretValue],
                 askpass: Path, config_dir: Path | None = None, spares_dir: Path | None = None,
                 scratch_git: bool = True) -> None:
        """`spares_dir` (private, on the data dir's filesystem) enables spare
        checkouts: after preparing a workspace, the next checkout of the same
        base commit is made in the background, so the next ticket on that
        repository only renames it into place. `scratch_git` gives each
        workspace a `.git` of its own for the sandbox's use (checkout.scratch_repo)."""
        self.git = runner
        self.layout = layout
        self.tokens = tokens
        self.askpass = askpass
        self.config_dir = config_dir
        self.spares_dir = spares_dir
        self.scratch_git = scratch_git
        self._locks: dict[str, asyncio.Lock] = {}
        self.mirrors = Mirrors(runner, layout, tokens, askpass, config_dir, self._lock)
        self.spares = Spares(spares_dir, self._populate, _remove_tree)

    def _lock(self, key: str) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    async def _rev(self, git_dir: Path, rev: str) -> str | None:
        res = await self.git.run(["rev-parse", "--verify", "--quiet", "--end-of-options", rev],
                                 git_dir=git_dir, check=False, what="git rev-parse")
        return res.out.strip() or None if res.returncode == 0 else None

    async def base_tip(self, ws: Workspace) -> str:
        """The base branch's tip in the repository now (the mirror fetched first); "" without one."""
        mirror = await self.mirrors.update(ws)
        return await self._rev(mirror, f"refs/heads/{ws.base_branch}") or ""

    # -- prepare -----------------------------------------------------------
    async def prepare(self, ws: Workspace, ticket_id: str, into: Path | None = None) -> Prepared:
        """The ticket's git dir and its checkout at <data>/workspaces/<ticket>.
        With `into` (a new folder, private to this broker): the checkout goes
        there instead, for a sandbox broker on another host (CheckoutArchive);
        once prepared, that is the branch's head."""
        branch = branch_for(ticket_id)
        gitdir = self.layout.gitdir(ticket_id)
        work = into or self.layout.workspace(ticket_id)
        async with self._lock("ticket:" + ticket_id):
            if (gitdir / "afe-ready").exists() and (into is not None or work.is_dir()):
                base = await self._rev(gitdir, "refs/afe/base")
                head = await self._rev(gitdir, f"refs/heads/{branch}")
                if base and head:
                    if into is not None:
                        await self._populate(gitdir, into, head, gitdir / "afe-checkout.index")
                    return Prepared(base, branch)
            mirror = await self.mirrors.update(ws)
            head, checkout, base = await continuation.resume_point(self, mirror, ticket_id, ws)
            await asyncio.to_thread(_remove_tree, gitdir)
            self.layout.gitdirs_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            # HEAD on the ticket's branch from the start; both refs in one update
            await self.git.run(["init", "--bare", "-q", f"--initial-branch={branch}", "--", str(gitdir)],
                               what="git init")
            alternates = gitdir / "objects" / "info" / "alternates"
            alternates.write_text(str(mirror / "objects") + "\n")
            await self.git.run(["update-ref", "--stdin", "-z"], git_dir=gitdir, what="git update-ref",
                               stdin=f"update refs/afe/base\0{base}\0\0update refs/heads/{branch}\0{head}\0\0".encode())
            if into is None:
                if work.exists() or work.is_symlink():
                    await asyncio.to_thread(_remove_tree, work)
                self.layout.workspaces_dir.mkdir(parents=True, exist_ok=True, mode=0o711)
            if checkout != base or not self.spares.take(mirror, base, work):
                await self._populate(gitdir, work, checkout, gitdir / "afe-checkout.index")
            (gitdir / "afe-ready").write_text(ws.name + "\n")
            log.info("prepared workspace for ticket %s from %s@%s", ticket_id, ws.name, base[:12])
            self.spares.schedule(mirror, base)
            return Prepared(base, branch)

    async def _revs(self, git_dir: Path, revs: list[str]) -> list[str | None]:
        """Each of `revs` resolved (None when it names nothing), with one git process.
        A name with a space or a control character names no ref (git refuses them
        in ref names) and is not sent: it would be read as more than one name."""
        asked = [r for r in revs if r.isprintable() and not any(c.isspace() for c in r)]
        res = await self.git.run(["cat-file", "--batch-check=%(objectname)"], git_dir=git_dir,
                                 stdin="".join(r + "\n" for r in asked).encode(), what="git cat-file")
        lines = res.out.splitlines()
        if len(lines) != len(asked):
            raise Internal(f"git cat-file answered {len(lines)} lines for {len(asked)} names")
        found = {r: None if line.endswith((" missing", " ambiguous")) else line.strip()
                 for r, line in zip(asked, lines, strict=True)}
        return [found.get(r) for r in revs]

    async def update_branch(self, ws: Workspace, ticket_id: str) -> tuple[str, bool, list[str]]:
        """Merge the base branch into the ticket's pushed branch (continuation.py)."""
        return await continuation.update_branch(self, ws, ticket_id)

    async def _populate(self, git_dir: Path, target: Path, sha: str, index: Path) -> None:
        """Check `sha` out into the new folder `target` and hand it to the sandbox user."""
        await checkout.populate(self.git, git_dir, target, sha, index, scratch_git=self.scratch_git)
        if os.geteuid() == 0:
            await self._chown(target)

    async def idle(self) -> None:
        """Wait for background spare checkouts."""
        await self.spares.idle()

    async def close(self) -> None:
        await self.spares.close()

    async def _chown(self, work: Path) -> None:
        """Hand the checkout to the sandbox user: the same bounded, no-follow
        fix-up the sandbox broker runs on every create (`safefs.chown_tree`)."""
        await asyncio.to_thread(_chown_tree, work, layout_mod.SANDBOX_UID, layout_mod.SANDBOX_GID)

    # -- snapshot ----------------------------------------------------------
    def _ticket_gitdir(self, ticket_id: str) -> Path:
        gitdir = self.layout.gitdir(ticket_id)
        if not (gitdir / "afe-ready").exists():
            raise FailedPrecondition(f"ticket {ticket_id} has no prepared workspace; prepare it first")
        return gitdir

    async def snapshot_tree(self, ticket_id: str, work: Path | None = None) -> capture.Snapshot:
        """Capture the workspace (or `work`: a private copy of a workspace on
        another host, unpacked by handover.py) into the ticket's git dir."""
        return await capture.write_tree(self.git, self._ticket_gitdir(ticket_id),
                                        work or self.layout.workspace(ticket_id),
                                        ("refs/afe/base", f"refs/heads/{branch_for(ticket_id)}"))

    # -- commit ------------------------------------------------------------
    async def commit(self, ws: Workspace, ticket_id: str, message: str, work: Path | None = None) -> Committed:
        branch = branch_for(ticket_id)
        async with self._lock("ticket:" + ticket_id):
            gitdir = self._ticket_gitdir(ticket_id)
            snap = await self.snapshot_tree(ticket_id, work)
            tree, repos = snap.tree, snap.nested_repositories
            if repos:
                log.warning("ticket %s: the workspace holds other git repositories, committed as plain files: %s",
                            ticket_id, ", ".join(repos[:20]))
            parent = await self._rev(gitdir, f"refs/heads/{branch}")
            if parent is None:
                raise FailedPrecondition(f"ticket {ticket_id}: branch {branch} is missing; prepare the workspace again")
            parent_tree = await self._rev(gitdir, f"{parent}^{{tree}}")
            if parent_tree == tree:
                return Committed(parent, False, 0, repos)
            changed = await self.git.run(["diff-tree", "-r", "-z", "--name-status", "--no-renames",
                                          "--end-of-options", parent_tree or parent, tree],
                                         git_dir=gitdir, what="git diff-tree")
            changes = compiled.changed_paths(changed.stdout)
            compiled.check(ws, ticket_id, changes)      # no compiled files a reviewer cannot read
            env = author_env(ws)
            msg = (message.strip() or f"afe: changes for ticket {ticket_id}") + "\n"
            res = await self.git.run(["commit-tree", "-p", parent, "-F", "-", tree], git_dir=gitdir,
                                     env=env, stdin=msg.encode(), what="git commit-tree")
            sha = res.out.strip()
            await self.git.run(["update-ref", "--end-of-options", f"refs/heads/{branch}", sha, parent],
                               git_dir=gitdir, what="git update-ref")
            files = len(changes)
            log.info("committed %s files for ticket %s as %s", files, ticket_id, sha[:12])
            return Committed(sha, True, files, repos)

    # -- checkpoint and restore (a takeover's new attempt, docs/SCALE.md) -------
    async def checkpoint(self, ws: Workspace, ticket_id: str, node: str) -> str:
        """Keep the workspace's state after `node` completed: its safe snapshot (the tree a commit
        would take) as a commit on top of the branch head, under CHECKPOINT_REF + node in the
        ticket's git dir. Nothing is pushed and the branch does not move. Returns the commit."""
        ref = _checkpoint_ref(node)
        async with self._lock("ticket:" + ticket_id):
            gitdir = self._ticket_gitdir(ticket_id)
            tree = (await self.snapshot_tree(ticket_id)).tree
            head = await self._rev(gitdir, f"refs/heads/{branch_for(ticket_id)}")
            if head is None:
                raise FailedPrecondition(f"ticket {ticket_id}: its branch is missing; prepare the workspace again")
            res = await self.git.run(["commit-tree", "-p", head, "-F", "-", tree], git_dir=gitdir,
                                     env=author_env(ws), stdin=f"afe checkpoint after node {node}\n".encode(),
                                     what="git commit-tree (checkpoint)")
            sha = res.out.strip()
            await self.git.run(["update-ref", "--end-of-options", ref, sha], git_dir=gitdir,
                               what="git update-ref (checkpoint)")
            return sha

    async def restore(self, ticket_id: str, node: str) -> str:
        """Put the workspace back to its state after `node` (its checkpoint; "": the branch head,
        no node changed the workspace since it was prepared or committed): empty it without
        following a link, then check that commit out into it as a fresh checkout. Files the
        Workspace's .gitignore excludes are not in a checkpoint and do not come back, as after a
        retry. Refused, the workspace untouched, when that node's checkpoint was never kept."""
        async with self._lock("ticket:" + ticket_id):
            gitdir = self._ticket_gitdir(ticket_id)
            head = await self._rev(gitdir, f"refs/heads/{branch_for(ticket_id)}")
            if head is None:
                raise FailedPrecondition(f"ticket {ticket_id}: its branch is missing; prepare the workspace again")
            target = await self._rev(gitdir, _checkpoint_ref(node)) if node else head
            if target is None:
                raise FailedPrecondition(f"ticket {ticket_id}: no checkpoint was kept after node {node!r} here; "
                                         "the workspace is left as it is")
            work = self.layout.workspace(ticket_id)
            await asyncio.to_thread(_empty_workspace, work)
            await checkout.fill(self.git, gitdir, work, target, gitdir / "afe-restore.index", head,
                                scratch_git=self.scratch_git)
            if os.geteuid() == 0:
                await self._chown(work)
            log.info("ticket %s: workspace restored to %s (%s)", ticket_id, target[:12],
                     f"after node {node}" if node else "the branch head")
            return target

    # -- diff --------------------------------------------------------------
    async def diff(self, ticket_id: str, max_bytes: int = 0, work: Path | None = None) -> tuple[str, bool]:
        """The workspace's current changes against the base, for display."""
        limit = max_bytes if max_bytes > 0 else DEFAULT_DIFF_BYTES
        async with self._lock("ticket:" + ticket_id):
            gitdir = self._ticket_gitdir(ticket_id)
            tree = (await self.snapshot_tree(ticket_id, work)).tree
            base = await self._rev(gitdir, "refs/afe/base")
            res = await self.git.run(["diff", "--no-ext-diff", "--no-textconv", "--no-color", "--no-renames",
                                      "--end-of-options", f"{base}^{{tree}}", tree],
                                     git_dir=gitdir, what="git diff")
        data = res.stdout
        truncated = len(data) > limit
        if truncated:
            data = data[:limit]
        return data.decode("utf-8", "replace").rstrip("\ufffd") if truncated else data.decode("utf-8", "replace"), truncated

    # -- push --------------------------------------------------------------
    async def push(self, ws: Workspace, ticket_id: str) -> tuple[str, str]:
        """Push the ticket's branch to the repository, or to the fork of `forge.pushRepo`."""
        branch = branch_for(ticket_id)
        remote = self.mirrors.push_remote(ws)
        async with self._lock("ticket:" + ticket_id):
            gitdir = self._ticket_gitdir(ticket_id)
            sha = await self._rev(gitdir, f"refs/heads/{branch}")
            if sha is None:
                raise FailedPrecondition(f"ticket {ticket_id}: nothing to push; commit first")
            # Pushing the same sha again is a no-op: a push repeated after a crash is idempotent (R37).
            await self.mirrors.remote_git(ws, remote, ["push", "--quiet", "--no-verify", "--no-recurse-submodules",
                                                "--end-of-options", remote.url,
                                                f"+refs/heads/{branch}:refs/heads/{branch}"],
                                   gitdir, "git push to", "forge.pushRepo" if ws.forge.push_repo else "repo")
            log.info("pushed %s for ticket %s to %s", branch, ticket_id, remote.url)
            return branch, sha

    # -- release -----------------------------------------------------------
    async def release(self, ticket_id: str, ws: Workspace | None = None, work: Path | None = None) -> None:
        """Remove the ticket's git dir and workspace; with `ws`, keep the
        workspace's (or `work`'s, see snapshot_tree) last state in the mirror
        first (`continuation.keep`, for a retry)."""
        async with self._lock("ticket:" + ticket_id):
            if ws is not None:
                try:
                    await continuation.keep(self, ws, ticket_id, work)
                except (GitFailed, AfeError, OSError) as exc:
                    log.warning("ticket %s: could not keep its workspace for a retry: %s", ticket_id, exc)
            await asyncio.to_thread(_remove_workspace, self.layout.workspace(ticket_id))
            await asyncio.to_thread(_remove_tree, self.layout.gitdir(ticket_id))
        self._locks.pop("ticket:" + ticket_id, None)


def _remove_workspace(path: Path) -> None:
    """A workspace that is a mount point (the sandbox broker's disk cap, R34)
    is emptied and left for the sandbox broker, which unmounts it and removes
    the folder; any other workspace is removed whole."""
    if os.path.ismount(path):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            safefs.empty_dir(fd)
        finally:
            os.close(fd)
        return
    _remove_tree(path)


def _checkpoint_ref(node: str) -> str:
    if not NODE_ID_RE.match(node or ""):
        raise InvalidArgument(f"{node!r} is not a node id (letters, digits, _ and -, at most 63)")
    return CHECKPOINT_REF + node


def _empty_workspace(path: Path) -> None:
    """Remove everything inside the workspace folder (kept: it may be the sandbox's mount), never
    following a link (R34)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        safefs.empty_dir(fd)
    finally:
        os.close(fd)


def _remove_tree(path: Path) -> None:
    """Remove a workspace (or any tree) whatever its depth, iteratively, never
    following a link (R34: a ticket's workspace never outlives it)."""
    safefs.remove_tree(path)


HANDOVER_LIMITS = safefs.Limits("the workspace hand-over to the sandbox")   # depth 256, 1,000,000 entries


def _chown_tree(root: Path, uid: int, gid: int) -> int:
    """Give a checkout to uid:gid: an iterative, bounded walk that never
    follows a link (R34); returns the entries changed."""
    return safefs.chown_tree(root, uid, gid, HANDOVER_LIMITS)
