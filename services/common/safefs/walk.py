"""Walking a tree the sandbox made, without recursion and within limits (R34).

The sandbox controls the shape of the tree, so nothing here recurses (a
10,000-deep tree would raise `RecursionError` in Python's recursive
`os.fwalk`/`shutil.rmtree`), every directory is opened relative to its
parent's fd with `O_NOFOLLOW | O_DIRECTORY` (a directory swapped for a
symlink mid-walk fails instead of being followed, so a walk never leaves the
tree), and names are bytes (any name the kernel allows, newline and
non-UTF-8 included).

`walk` is for reading (snapshot, chown, search, copy, disk usage): it is
bounded in depth and in entries and fails with `TreeTooLarge` naming the
limit and who set it. It holds one directory fd per level, so its depth
bound also bounds its fds.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Generator
from dataclasses import dataclass

from ..errors import FailedPrecondition
from .open import DIR_FLAGS, open_dir_or_none

# Defaults, documented in docs/SECURITY.md (R34): deeper than any real source
# tree (git itself refuses paths longer than 4096 bytes on most systems), and
# an entry count far above a large monorepo checkout (linux.git is ~90,000).
DEFAULT_MAX_DEPTH = 256
DEFAULT_MAX_ENTRIES = 1_000_000


class TreeTooLarge(FailedPrecondition):
    """A walk went over one of its limits; the message names the limit."""

    def __init__(self, message: str, limit: str, value: int) -> None:
        super().__init__(message)
        self.limit = limit      # "depth" | "entries" | "path"
        self.value = value


@dataclass(frozen=True)
class Limits:
    """Bounds of one walk. `what` names the walk in error messages
    (e.g. "the commit snapshot") and `subject` the tree ("the workspace")."""

    what: str
    subject: str = "the workspace"
    max_depth: int = DEFAULT_MAX_DEPTH
    max_entries: int = DEFAULT_MAX_ENTRIES

    def too_deep(self) -> TreeTooLarge:
        return TreeTooLarge(
            f"{self.subject} is deeper than {self.max_depth} directories (limit of {self.what}); "
            "flatten or remove the deepest directories", "depth", self.max_depth)

    def too_many(self) -> TreeTooLarge:
        return TreeTooLarge(
            f"{self.subject} holds more than {self.max_entries} files and directories (limit of {self.what}); "
            "remove files you do not need", "entries", self.max_entries)


@dataclass(frozen=True)
class Item:
    """One entry found by `walk`. `dir_fd` is its parent's fd, valid until
    the walk moves on; act on the entry only through (dir_fd, name)."""

    dir_fd: int
    parent: bytes       # relative path of the parent, '' or ending with '/'
    name: bytes
    st: os.stat_result
    depth: int          # 1 for the root's children

    @property
    def rel(self) -> bytes:
        return self.parent + self.name

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.st.st_mode)


def list_names(dir_fd: int) -> list[bytes]:
    """The names in a directory, as bytes, sorted."""
    with os.scandir(dir_fd) as it:
        return sorted(os.fsencode(e.name) for e in it)


def walk(root_fd: int, limits: Limits, descend: Callable[[Item], bool] | None = None
         ) -> Generator[Item, None, None]:
    """Every entry under `root_fd`, depth first, names sorted, never following a link.

    Directories are yielded before their contents; a directory is entered
    when `descend(item)` is true (default: always). Entries that vanish or
    change type during the walk are skipped. Raises TreeTooLarge when a
    directory to enter is deeper than `limits.max_depth` or when more than
    `limits.max_entries` entries were seen. The caller's root_fd stays open.
    """
    count = 0
    # Each frame: (fd, relative prefix, remaining names reversed, depth of its entries).
    stack: list[tuple[int, bytes, list[bytes], int]] = [(root_fd, b"", list_names(root_fd)[::-1], 1)]
    try:
        while stack:
            fd, prefix, names, depth = stack[-1]
            if not names:
                stack.pop()
                if fd != root_fd:
                    os.close(fd)
                continue
            name = names.pop()
            count += 1
            if count > limits.max_entries:
                raise limits.too_many()
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            item = Item(fd, prefix, name, st, depth)
            yield item
            if not stat.S_ISDIR(st.st_mode) or (descend is not None and not descend(item)):
                continue
            if depth >= limits.max_depth:
                raise limits.too_deep()
            sub = open_dir_or_none(fd, name)
            if sub is None:
                continue
            try:
                sub_names = list_names(sub)
            except BaseException:
                os.close(sub)
                raise
            if count + len(sub_names) > limits.max_entries:
                os.close(sub)
                raise limits.too_many()
            stack.append((sub, prefix + name + b"/", sub_names[::-1], depth + 1))
    finally:
        for fd, *_ in stack:
            if fd != root_fd:
                os.close(fd)


def disk_usage(path: str | os.PathLike[str], stop_above: int, limits: Limits) -> tuple[int, str]:
    """Bytes the tree under `path` takes on disk (st_blocks, a hard-linked
    inode counted once), stopping early past `stop_above`; with "" or the
    reason the walk was refused (too deep, too many entries). A missing
    tree takes nothing."""
    try:
        root = os.open(path, DIR_FLAGS)
    except FileNotFoundError:
        return 0, ""
    seen: set[tuple[int, int]] = set()
    total = 0
    try:
        total += os.fstat(root).st_blocks * 512
        with contextlib.closing(walk(root, limits)) as items:
            for item in items:
                st = item.st
                if st.st_nlink > 1 and not item.is_dir:
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
                if total > stop_above:
                    return total, ""
    except TreeTooLarge as exc:
        return total, str(exc)
    finally:
        os.close(root)
    return total, ""
