"""Copying a tree the sandbox made into another directory (R34).

Read through `walk` (iterative, bounded, never following a link) and written
relative to directory fds with `O_NOFOLLOW | O_EXCL`: directories, regular
files and symlinks (copied as links, never followed) keep their owners, modes
(set-id bits dropped) and times; FIFOs, sockets and devices are skipped.
"""

from __future__ import annotations

import logging
import os
import stat

from .open import DIR_FLAGS, open_regular_or_none
from .walk import Limits, walk

log = logging.getLogger(__name__)


def copy_tree(src_fd: int, dst_fd: int, limits: Limits) -> int:
    """Copy the tree under directory fd `src_fd` into the (empty) directory fd
    `dst_fd`. Bounded by `limits` (TreeTooLarge names the limit); returns the
    number of entries copied."""
    count = 0
    # Destination directories still being filled: (source prefix, fd, source stat);
    # a directory's mode and times are set once everything under it is written.
    open_dirs: list[tuple[bytes, int, os.stat_result]] = [(b"", os.dup(dst_fd), os.fstat(src_fd))]

    def close_to(prefix: bytes) -> None:
        while open_dirs[-1][0] != prefix:
            _p, d, st = open_dirs.pop()
            try:
                _finish(d, st)
            finally:
                os.close(d)

    try:
        for item in walk(src_fd, limits):
            close_to(item.parent)
            d = open_dirs[-1][1]
            count += 1
            st, name = item.st, item.name
            if stat.S_ISDIR(st.st_mode):
                os.mkdir(name, 0o700, dir_fd=d)
                open_dirs.append((item.rel + b"/", os.open(name, DIR_FLAGS, dir_fd=d), st))
            elif stat.S_ISREG(st.st_mode):
                _copy_file(name, item.dir_fd, d, st)
            elif stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(name, dir_fd=item.dir_fd), name, dir_fd=d)
                os.chown(name, st.st_uid, st.st_gid, dir_fd=d, follow_symlinks=False)
            else:
                log.debug("tree copy skips a special file")
        close_to(b"")
        _finish(open_dirs[0][1], open_dirs[0][2])
    finally:
        for _p, d, _st in open_dirs:
            os.close(d)
    return count


def _copy_file(name: bytes, s: int, d: int, st: os.stat_result) -> None:
    fi = open_regular_or_none(s, name)    # swapped for a FIFO or a link since the walk: skipped
    if fi is None:
        return
    try:
        fo = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=d)
        try:
            off = 0
            while True:
                n = os.sendfile(fo, fi, off, 1 << 24)
                if n == 0:
                    break
                off += n
            _finish(fo, st)
        finally:
            os.close(fo)
    finally:
        os.close(fi)


def _finish(fd: int, st: os.stat_result) -> None:
    os.fchown(fd, st.st_uid, st.st_gid)
    os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
