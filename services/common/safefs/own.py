"""Ownership fix-up of a tree, never following a link (R34).

The one implementation both brokers use: the sandbox broker when it hands a
workspace to the sandbox uid on every create, the credential broker when it
hands over a fresh checkout. The tree is walked by `walk` (iterative,
bounded, directories opened from their parent's fd with O_NOFOLLOW), and
every change is `fchownat(AT_SYMLINK_NOFOLLOW)` relative to the parent's fd,
so a link is changed itself and a link swapped in during the walk cannot
redirect it outside the tree. A deeper or larger tree fails naming the limit.
"""

from __future__ import annotations

import contextlib
import os

from .open import DIR_FLAGS
from .walk import Limits, walk


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


def chown_tree(path: str | os.PathLike[str], uid: int, gid: int, limits: Limits) -> int:
    """`chown_tree_at` on the directory at `path`, itself opened with O_NOFOLLOW
    (a link given as the tree fails with ELOOP instead of being followed)."""
    fd = os.open(path, DIR_FLAGS)
    try:
        return chown_tree_at(fd, uid, gid, limits)
    finally:
        os.close(fd)


def own_at(dir_fd: int, name: str | bytes, uid: int, gid: int) -> None:
    """Give a new entry to uid:gid when this process may (root); the link
    itself when it is one. Best effort: the entry stays usable either way."""
    if os.geteuid() == 0:
        with contextlib.suppress(OSError):
            os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)


def own_fd(fd: int, uid: int, gid: int) -> None:
    """`own_at` for an entry held open."""
    if os.geteuid() == 0:
        with contextlib.suppress(OSError):
            os.fchown(fd, uid, gid)
