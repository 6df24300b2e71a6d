"""Turning a workspace into a git tree in the ticket's private git dir.

The workspace is read only through `snapshot` (a no-follow, bounded walk
via `services.common.safefs`); host git never sees the workspace itself. It
sees the blobs `snapshot` wrote, an index fed NUL-separated, and -- to apply
the workspace's `.gitignore` files -- a private copy holding only the
directory skeleton and the `.gitignore` bytes read through their own fds.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from services.common import safefs
from services.common.host.gitcmd import GitFailed, GitRunner
from services.credentials.workspaces import snapshot


@dataclass(frozen=True)
class Snapshot:
    tree: str
    entries: int
    nested_repositories: tuple[str, ...]


def _repos_in(found: snapshot.Scan, entries: list[snapshot.Entry]) -> tuple[str, ...]:
    """The nested repositories of a scan that contribute at least one committed entry."""
    out = []
    for repo in found.repos:
        prefix = repo + b"/" if repo else b""
        if any(e.path.startswith(prefix) for e in entries):
            out.append(repo.decode("utf-8", "backslashreplace") or ".")
    return tuple(out)


async def write_tree(git: GitRunner, gitdir: Path, work: Path, known_refs: tuple[str, ...]) -> Snapshot:
    """Capture `work` into `gitdir` as a tree; blobs already under `known_refs` are not written again."""
    found = await asyncio.to_thread(snapshot.scan, work)
    ignored = await _ignored(git, gitdir, found)
    writer = snapshot.ObjectWriter(gitdir / "objects", await _known_blobs(git, gitdir, known_refs))
    entries = await asyncio.to_thread(snapshot.materialize, work, found, ignored, writer)
    fd, index = tempfile.mkstemp(prefix="afe-snapshot-", suffix=".index", dir=gitdir)
    os.close(fd)
    os.unlink(index)
    try:
        env = {"GIT_INDEX_FILE": index}
        await git.run(["update-index", "-z", "--add", "--index-info"], git_dir=gitdir, env=env,
                      stdin=snapshot.index_info(entries), what="git update-index")
        res = await git.run(["write-tree"], git_dir=gitdir, env=env, what="git write-tree")
    finally:
        Path(index).unlink(missing_ok=True)  # noqa: ASYNC240 - one unlink of a local temp file
    return Snapshot(res.out.strip(), len(entries), _repos_in(found, entries))


async def _known_blobs(git: GitRunner, gitdir: Path, refs: tuple[str, ...]) -> set[str]:
    """Blob ids of `refs` (the base and the branch head): already stored, never rewritten."""
    known: set[str] = set()
    for ref in refs:
        res = await git.run(["ls-tree", "-r", "-z", "--end-of-options", ref], git_dir=gitdir,
                            check=False, what="git ls-tree")
        for item in res.stdout.split(b"\0"):
            meta = item.partition(b"\t")[0].split()
            if len(meta) == 3 and meta[1] == b"blob":
                known.add(meta[2].decode())
    return known


async def _ignored(git: GitRunner, gitdir: Path, found: snapshot.Scan) -> set[bytes]:
    """Paths the workspace's .gitignore files exclude, decided by git on a private copy
    holding only the directory skeleton and the .gitignore bytes we read safely."""
    if not found.gitignores:
        return set()
    candidates = [*found.files, *found.links]
    if not candidates:
        return set()
    tmp = Path(tempfile.mkdtemp(prefix="afe-ignore-", dir=gitdir))
    try:
        def build() -> None:
            fd = os.open(tmp, safefs.DIR_FLAGS)
            try:
                snapshot.skeleton(fd, found)
            finally:
                os.close(fd)

        await asyncio.to_thread(build)
        res = await git.run(["check-ignore", "--no-index", "-z", "--stdin"], git_dir=gitdir,
                            work_tree=tmp, stdin=b"".join(p + b"\0" for p in candidates),
                            check=False, what="git check-ignore")
        if res.returncode not in (0, 1):
            raise GitFailed("git check-ignore failed", res.returncode, "")
    finally:
        await asyncio.to_thread(safefs.remove_tree, tmp)
    return {p for p in res.stdout.split(b"\0") if p}
