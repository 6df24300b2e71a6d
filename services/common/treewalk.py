"""Walking a tree the sandbox made, without recursion and within limits (R34).

Every host-side walk of a sandbox-writable tree goes through this module.
The sandbox controls the shape of the tree, so nothing here recurses (a
10,000-deep tree would raise `RecursionError` in Python's recursive
`os.fwalk`/`shutil.rmtree`), every directory is opened relative to its
parent's fd with `O_NOFOLLOW | O_DIRECTORY` (a directory swapped for a
symlink mid-walk fails instead of being followed, so a walk never leaves the
tree), and names are bytes (any name the kernel allows, newline and
non-UTF-8 included).

`walk` is for reading (snapshot, chown, search): it is bounded in depth and
in entries and fails with `TreeTooLarge` naming the limit and who set it.
It holds one directory fd per level, so its depth bound also bounds its fds.

`remove_tree` / `empty_dir` are for removal: they must always succeed, so
they are unbounded in depth. They hold at most `_REMOVE_FDS` directory fds:
a directory found deeper than that is first renamed to the top of the tree
being removed (a rename inside the same tree, never across it), which
flattens any depth into a bounded one.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import FailedPrecondition

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

# Defaults, documented in docs/SECURITY.md (R34): deeper than any real source
# tree (git itself refuses paths longer than 4096 bytes on most systems), and
# an entry count far above a large monorepo checkout (linux.git is ~90,000).
DEFAULT_MAX_DEPTH = 256
DEFAULT_MAX_ENTRIES = 1_000_000

_REMOVE_FDS = 64          # directory fds a removal holds at most
_REMOVE_RESCANS = 16      # times a directory the sandbox keeps refilling is scanned again


class TreeTooLarge(FailedPrecondition):
    """A walk went over one of its limits; the message names the limit."""

    def __init__(self, message: str, limit: str, value: int) -> None:
        super().__init__(message)
        self.limit = limit      # "depth" | "entries"
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


def open_dir_at(dir_fd: int, name: bytes | str) -> int | None:
    """Open a directory under dir_fd without following a link; None when it is
    gone or is no longer a directory (swapped for a link or a file)."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            return None
        raise


def list_names(dir_fd: int) -> list[bytes]:
    """The names in a directory, as bytes, sorted."""
    with os.scandir(dir_fd) as it:
        return sorted(os.fsencode(e.name) for e in it)


def walk(root_fd: int, limits: Limits, descend: Callable[[Item], bool] | None = None) -> Iterator[Item]:
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
            sub = open_dir_at(fd, name)
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


def chown_tree_at(root_fd: int, uid: int, gid: int, limits: Limits) -> int:
    """Give root_fd's directory and everything under it to uid:gid; links are
    changed themselves, never followed. Returns how many entries changed."""
    changed = 0
    st = os.fstat(root_fd)
    if (st.st_uid, st.st_gid) != (uid, gid):
        os.fchown(root_fd, uid, gid)
        changed += 1
    for item in walk(root_fd, limits):
        if (item.st.st_uid, item.st.st_gid) != (uid, gid):
            try:
                os.chown(item.name, uid, gid, dir_fd=item.dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            changed += 1
    return changed


def empty_dir(root_fd: int) -> int:
    """Remove everything inside the directory `root_fd`, whatever its depth;
    returns how many entries were removed.

    Iterative; never follows a link (unlink removes a link itself; directories
    are opened with O_NOFOLLOW); never leaves the tree. A directory met deeper
    than `_REMOVE_FDS` levels is renamed into the root (inside the same tree),
    so at most `_REMOVE_FDS` fds are open however deep the tree is. Raises
    OSError only when the tree cannot be removed (e.g. the sandbox keeps
    refilling it, or permissions).
    """
    # Each frame: [fd, name in parent, scandir iterator, rescans].
    stack: list[list] = [[root_fd, b"", os.scandir(root_fd), 0]]
    hoisted = False
    removed = 0
    try:
        while stack:
            frame = stack[-1]
            fd, _name, it, _rescans = frame
            entry = next(it, None)
            if entry is None:
                it.close()
                if len(stack) == 1:
                    # Scan the root again for hoisted directories and entries added meanwhile.
                    # Passes that hoisted something are progress; others are bounded.
                    if not os.listdir(fd):
                        stack.pop()
                        continue
                    frame[3] = 0 if hoisted else frame[3] + 1
                    if frame[3] > _REMOVE_RESCANS:
                        raise OSError(errno.ENOTEMPTY, "the tree kept changing while it was removed")
                    hoisted = False
                    frame[2] = os.scandir(fd)
                    continue
                parent_fd = stack[-2][0]
                try:
                    os.rmdir(frame[1], dir_fd=parent_fd)
                    removed += 1
                except OSError as exc:
                    if exc.errno in (errno.ENOTEMPTY, errno.EEXIST) and frame[3] < _REMOVE_RESCANS:
                        frame[2], frame[3] = os.scandir(fd), frame[3] + 1
                        continue
                    if exc.errno != errno.ENOENT:
                        raise
                stack.pop()
                os.close(fd)
                continue
            name = os.fsencode(entry.name)
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not is_dir:
                try:
                    os.unlink(name, dir_fd=fd)
                    removed += 1
                except FileNotFoundError:
                    pass
                except IsADirectoryError:
                    is_dir = True  # swapped for a directory since the listing: handled below
                if not is_dir:
                    continue
            if len(stack) >= _REMOVE_FDS:
                # Too deep to hold another fd: move this directory to the root and
                # deal with it from there (the root is scanned again at the end).
                try:
                    os.rename(name, b".afe-rm-" + secrets.token_hex(8).encode(), src_dir_fd=fd, dst_dir_fd=root_fd)
                except FileNotFoundError:
                    pass
                hoisted = True
                continue
            sub = open_dir_at(fd, name)
            if sub is None:
                try:  # swapped for a link or a file: remove that instead
                    os.unlink(name, dir_fd=fd)
                    removed += 1
                except (FileNotFoundError, IsADirectoryError):
                    pass
                continue
            try:
                sub_it = os.scandir(sub)
            except BaseException:
                os.close(sub)
                raise
            stack.append([sub, name, sub_it, 0])
    finally:
        for fd, _name, it, _ in stack:
            it.close()
            if fd != root_fd:
                os.close(fd)
    return removed


def remove_tree(path: str | os.PathLike) -> None:
    """Remove `path` (a directory tree, a file or a link) whatever its depth;
    nothing outside it is touched and no link is followed. Missing: no-op."""
    p = Path(path)
    try:
        parent_fd = os.open(p.parent, DIR_FLAGS)
    except FileNotFoundError:
        return
    try:
        try:
            st = os.stat(p.name, dir_fd=parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            try:
                os.unlink(p.name, dir_fd=parent_fd)
            except FileNotFoundError:
                pass
            return
        fd = open_dir_at(parent_fd, p.name)
        if fd is None:  # swapped for a link or a file since the stat
            try:
                os.unlink(p.name, dir_fd=parent_fd)
            except FileNotFoundError:
                pass
            return
        try:
            empty_dir(fd)
        finally:
            os.close(fd)
        try:
            os.rmdir(p.name, dir_fd=parent_fd)
        except FileNotFoundError:
            pass
    finally:
        os.close(parent_fd)
