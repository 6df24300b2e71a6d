"""Removing a tree the sandbox made, whatever its depth (R34).

Removal must always succeed, so unlike `walk` it is unbounded in depth. It
never follows a link (unlink removes a link itself; directories are opened
with O_NOFOLLOW relative to their parent's fd) and never leaves the tree. It
holds at most `_REMOVE_FDS` directory fds: a directory found deeper than that
is first renamed to the top of the tree being removed (a rename inside the
same tree, never across it), which flattens any depth into a bounded one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from .open import DIR_FLAGS, open_dir_or_none

_REMOVE_FDS = 64          # directory fds a removal holds at most
_REMOVE_RESCANS = 16      # times a directory the sandbox keeps refilling is scanned again


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
    stack: list[list[Any]] = [[root_fd, b"", os.scandir(root_fd), 0]]
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
                with contextlib.suppress(FileNotFoundError):
                    os.rename(name, b".afe-rm-" + secrets.token_hex(8).encode(), src_dir_fd=fd, dst_dir_fd=root_fd)
                hoisted = True
                continue
            sub = open_dir_or_none(fd, name)
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


def remove_tree(path: str | os.PathLike[str]) -> None:
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
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p.name, dir_fd=parent_fd)
            return
        fd = open_dir_or_none(parent_fd, p.name)
        if fd is None:  # swapped for a link or a file since the stat
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p.name, dir_fd=parent_fd)
            return
        try:
            empty_dir(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(p.name, dir_fd=parent_fd)
    finally:
        os.close(parent_fd)


def remove_dirs_except(root: str | os.PathLike[str], keep: set[str]) -> set[str]:
    """Remove each folder directly in `root` whose name is not in `keep` (links and
    files are left alone); returns the names removed. A missing `root`: nothing."""
    gone: set[str] = set()
    with contextlib.suppress(FileNotFoundError), os.scandir(root) as entries:
        for entry in entries:
            if entry.name not in keep and entry.is_dir(follow_symlinks=False):
                remove_tree(entry.path)
                gone.add(entry.name)
    return gone
