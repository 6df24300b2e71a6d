"""Opening paths under a root directory fd without following a link (R17-R19).

A relative path is checked first (`split_relative`: no absolute path, `..`,
`.`, NUL byte or empty component), then opened one component at a time from
its parent's fd with `O_NOFOLLOW` (and `O_DIRECTORY` for directories): a
symlink anywhere on the path -- including one swapped in while a call runs --
makes the open fail instead of being followed. Errors say what was wrong
with the path; a symlink is named as such.

Two flavours: the strict openers (`open_dir_at`, `open_regular`) raise an
`AfeError` naming the path, for a caller's own request; the quiet ones
(`open_dir_or_none`, `open_regular_or_none`) return None when the entry is
gone or is no longer what was expected, for walks over a tree that changes.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from typing import Self

from ..errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Never follow a link, never block on a FIFO, never take a terminal.
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY

MAX_PATH = 4096
MAX_COMPONENT = 255
MAX_DEPTH = 128


def show(path: str) -> str:
    """A path as it may appear in an error message (quoted, bounded)."""
    return repr(path[:200] + ("..." if len(path) > 200 else ""))


def split_relative(path: str, *, allow_root: bool = False) -> list[str]:
    """Components of a relative tool path, or InvalidArgument (R17)."""
    if not isinstance(path, str):
        raise InvalidArgument("path must be a string")
    if "\x00" in path:
        raise InvalidArgument("path must not contain NUL bytes")
    if path in ("", "."):
        if allow_root:
            return []
        raise InvalidArgument("path must name a file inside the workspace, relative to its root")
    if len(path.encode("utf-8", "surrogateescape")) > MAX_PATH:
        raise InvalidArgument(f"path is longer than {MAX_PATH} bytes")
    if path.startswith("/"):
        raise InvalidArgument(f"path {show(path)} is absolute: give a path relative to the workspace root")
    parts = path.split("/")
    for p in parts:
        if p == "":
            raise InvalidArgument(f"path {show(path)} has an empty component (a trailing or doubled '/')")
        if p == "..":
            raise InvalidArgument(f"path {show(path)} contains '..': paths must stay inside the workspace")
        if p == ".":
            raise InvalidArgument(f"path {show(path)} contains '.': write it without '.' components")
        if len(p.encode("utf-8", "surrogateescape")) > MAX_COMPONENT:
            raise InvalidArgument(f"a component of {show(path)} is longer than {MAX_COMPONENT} bytes")
    if len(parts) > MAX_DEPTH:
        raise InvalidArgument(f"path {show(path)} is nested deeper than {MAX_DEPTH} levels")
    return parts


@dataclass(frozen=True)
class RelPath:
    """A checked relative path: its components and its text for messages."""

    parts: list[str]
    text: str

    @classmethod
    def parse(cls, path: str, *, allow_root: bool = False) -> Self:
        return cls(split_relative(path, allow_root=allow_root), path)

    @property
    def shown(self) -> str:
        return show(self.text)

    @property
    def parent(self) -> list[str]:
        return self.parts[:-1]

    @property
    def name(self) -> str:
        return self.parts[-1]


def is_link_at(dir_fd: int, name: str | bytes) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def classify_open_error(exc: OSError, parent_fd: int, name: str, shown: str) -> Exception:
    """Turn an open failure into a clear AfeError; symlinks are named as such."""
    if is_link_at(parent_fd, name) or exc.errno == errno.ELOOP:
        return PermissionDenied(f"{shown} is or passes through a symbolic link; symlinks are refused (R19)")
    if exc.errno == errno.ENOENT:
        return NotFound(f"{shown} does not exist")
    if exc.errno == errno.ENOTDIR:
        return FailedPrecondition(f"{shown}: a component is not a directory")
    if exc.errno == errno.EISDIR:
        return FailedPrecondition(f"{shown} is a directory")
    if exc.errno == errno.ENXIO:
        return FailedPrecondition(f"{shown} is not a regular file")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return PermissionDenied(f"{shown}: permission denied")
    return FailedPrecondition(f"{shown}: {os.strerror(exc.errno or 0)}")


def changed_during_call(exc: OSError) -> NotFound | FailedPrecondition:
    """The AfeError for an OSError raised because the tree changed mid-call."""
    code = errno.errorcode.get(exc.errno or 0, "error")
    if exc.errno == errno.ENOENT:
        return NotFound("a directory on the path was removed while the call ran; retry")
    return FailedPrecondition(f"the workspace changed while the call ran ({code}); retry")


def open_dir_at(parent_fd: int, name: str, shown: str) -> int:
    """The directory `name` under parent_fd, or an AfeError naming `shown`."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        raise classify_open_error(exc, parent_fd, name, shown) from None


def open_dir_or_none(dir_fd: int, name: bytes | str) -> int | None:
    """Open a directory under dir_fd without following a link; None when it is
    gone or is no longer a directory (swapped for a link or a file)."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            return None
        raise


def open_regular(dir_fd: int, name: str, shown: str) -> int:
    """Open a regular file for reading without following links or blocking."""
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise classify_open_error(exc, dir_fd, name, shown) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (FIFO, socket or device)"
        raise FailedPrecondition(f"{shown} is {kind}")
    return fd


def open_regular_or_none(dir_fd: int, name: bytes | str) -> int | None:
    """Open a regular file under dir_fd without following a link; None if it is not one now."""
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO, errno.ENOTDIR, errno.EISDIR):
            return None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


class DirCache:
    """Directory fds under `root_fd` by relative path (bytes, '/'-separated),
    each opened from its parent's fd with O_NOFOLLOW|O_DIRECTORY, ancestors one
    by one (no recursion); None for one that is gone or is not a directory
    now. At most `max_open` are held: past that the cache starts again.
    The caller's root_fd stays open."""

    def __init__(self, root_fd: int, max_open: int = 256) -> None:
        self.root_fd = root_fd
        self.max_open = max_open
        self._fds: dict[bytes, int | None] = {b"": root_fd}

    def get(self, rel: bytes) -> int | None:
        if len(self._fds) > self.max_open:
            self.close()
        missing = []
        while rel not in self._fds:
            missing.append(rel)
            rel = rel.rpartition(b"/")[0]
        for sub in reversed(missing):
            parent, _, name = sub.rpartition(b"/")
            pfd = self._fds[parent]
            self._fds[sub] = None if pfd is None else open_dir_or_none(pfd, name)
        return self._fds[missing[0]] if missing else self._fds[rel]

    def close(self) -> None:
        for key, fd in self._fds.items():
            if key and fd is not None:
                os.close(fd)
        self._fds = {b"": self.root_fd}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
