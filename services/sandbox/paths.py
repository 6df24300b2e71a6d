"""Path rules for the host-side file tools (R17-R19).

A tool path is relative to the workspace root. `split_relative` refuses
absolute paths, `..`, `.`, NUL bytes and empty components (which covers a
trailing slash and `//`). `Root` then opens every component from the root
directory fd with `O_NOFOLLOW` (and `O_DIRECTORY` for directories), so a
symlink anywhere on the path -- including one the sandbox swaps in while a
call is in progress -- makes the open fail instead of being followed.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Self

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied

MAX_PATH = 4096
MAX_COMPONENT = 255
MAX_DEPTH = 128

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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


def _classify_open_error(exc: OSError, parent_fd: int, name: str, shown: str) -> Exception:
    """Turn an open failure into a clear AfeError; symlinks are named as such."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except OSError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        return PermissionDenied(f"{shown} is or passes through a symbolic link; symlinks are refused (R19)")
    if exc.errno == errno.ENOENT:
        return NotFound(f"{shown} does not exist")
    if exc.errno == errno.ENOTDIR:
        return FailedPrecondition(f"{shown}: a component is not a directory")
    if exc.errno == errno.ELOOP:
        return PermissionDenied(f"{shown} is or passes through a symbolic link; symlinks are refused (R19)")
    if exc.errno == errno.EISDIR:
        return FailedPrecondition(f"{shown} is a directory")
    if exc.errno == errno.ENXIO:
        return FailedPrecondition(f"{shown} is not a regular file")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return PermissionDenied(f"{shown}: permission denied")
    return FailedPrecondition(f"{shown}: {os.strerror(exc.errno or 0)}")


def open_dir_at(parent_fd: int, name: str, shown: str) -> int:
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        raise _classify_open_error(exc, parent_fd, name, shown) from None


def changed_during_call(exc: OSError) -> NotFound | FailedPrecondition:
    """The AfeError for an OSError raised because the tree changed mid-call."""
    code = errno.errorcode.get(exc.errno or 0, "error")
    if exc.errno == errno.ENOENT:
        return NotFound("a directory on the path was removed while the call ran; retry")
    return FailedPrecondition(f"the workspace changed while the call ran ({code}); retry")


class Root:
    """An open workspace root. Use as a context manager; every method takes
    components from `split_relative`."""

    def __init__(self, path: str) -> None:
        try:
            self.fd = os.open(path, DIR_FLAGS)
        except OSError as exc:
            raise NotFound("the ticket's workspace does not exist: create the sandbox first") from exc
        st = os.fstat(self.fd)
        self.uid, self.gid = st.st_uid, st.st_gid

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close()
        if isinstance(exc, OSError):
            # The sandbox changed the tree under a call (a directory we hold
            # open was removed or swapped): a clear error, never a raw OSError
            # that would surface as an internal error.
            raise changed_during_call(exc) from None


    def open_dir(self, parts: list[str], *, create: bool = False, shown: str = "") -> int:
        """An fd for the directory named by `parts` (the root itself when
        empty), walking one O_NOFOLLOW|O_DIRECTORY open per component.
        With create=True, missing components are made (owned like the root)."""
        fd = os.dup(self.fd)
        try:
            for i, name in enumerate(parts):
                try:
                    nfd = os.open(name, DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise NotFound(f"{shown or show('/'.join(parts[:i + 1]))} does not exist") from None
                    self.mkdir_at(fd, name)
                    try:
                        nfd = os.open(name, DIR_FLAGS, dir_fd=fd)
                    except OSError as exc:
                        where = shown or show("/".join(parts[:i + 1]))
                        raise _classify_open_error(exc, fd, name, where) from None
                except OSError as exc:
                    raise _classify_open_error(exc, fd, name, show("/".join(parts[:i + 1]))) from None
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def mkdir_at(self, dir_fd: int, name: str, mode: int = 0o755) -> None:
        try:
            os.mkdir(name, mode, dir_fd=dir_fd)
        except FileExistsError:
            return
        self.own_at(dir_fd, name)

    def own_at(self, dir_fd: int, name: str) -> None:
        """New entries belong to the workspace owner (the sandbox uid), so the
        sandbox can keep working on what the host tools write."""
        if os.geteuid() == 0:
            try:
                os.chown(name, self.uid, self.gid, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                pass

    def own_fd(self, fd: int) -> None:
        if os.geteuid() == 0:
            try:
                os.fchown(fd, self.uid, self.gid)
            except OSError:
                pass
