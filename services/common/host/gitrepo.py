"""Where a local git repository keeps its refs (`git_dir`): the credential
broker's local forge and the CLI's pre-flight checks (`afe check`, `afe init`)
read a repository folder the same way."""

from __future__ import annotations

from pathlib import Path

from services.common.errors import InvalidArgument


def git_dir(path: Path, workspace: str = "") -> Path:
    """The folder holding a repository's refs: `path` itself when bare, `path/.git`
    for a working repository. A linked worktree or submodule (`.git` is a file)
    is refused with what to name instead."""
    dot = path / ".git"
    if dot.is_dir():
        return dot
    if dot.exists():
        raise InvalidArgument(f"workspace {workspace!r}: {path} is a linked worktree or submodule (its .git is a "
                              "file); name the main repository's folder as repo")
    if (path / "HEAD").is_file() and (path / "objects").is_dir() and (path / "refs").is_dir():
        return path
    raise InvalidArgument(f"workspace {workspace!r}: {path} is not a git repository; run `git init` there "
                          "and commit the base branch, or name another folder as repo")
