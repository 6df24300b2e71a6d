"""`Root`: an open directory and the operations on the paths under it (R17-R19).

Like Go's `os.Root`: every operation takes a path relative to the root
(`RelPath`, checked by `split_relative`), opens it one component at a time
from the root's fd with `O_NOFOLLOW`, and acts through the fd it opened, so
no symlink -- on the path or at the end of it, present from the start or
swapped in while the call runs -- is ever followed. Writes go to a temporary
file renamed over the target on the same directory fd (a link swapped in is
replaced, never written through). New entries belong to the root's owner.
Errors are `AfeError`s naming the path, never its content; an OSError raised
because the tree changed under a call becomes a clear error on exit.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from typing import Self

from ..errors import AlreadyExists, FailedPrecondition, NotFound, PermissionDenied
from .open import (
    DIR_FLAGS,
    RelPath,
    changed_during_call,
    classify_open_error,
    open_dir_at,
    open_regular,
    show,
)
from .own import chown_tree_at, own_at, own_fd
from .remove import empty_dir
from .walk import Item, Limits, walk

_LINK_REFUSED = "{} is a symbolic link; symlinks are refused (R19)"


class Root:
    """An open root directory. Use as a context manager."""

    MISSING = "the directory does not exist"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        try:
            self.fd = os.open(path, DIR_FLAGS)
        except OSError as exc:
            raise NotFound(self.MISSING) from exc
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
            # The tree changed under a call (a directory held open was removed
            # or swapped): a clear error, never a raw OSError.
            raise changed_during_call(exc) from None

    # -- opening -------------------------------------------------------------
    def open_dir(self, parts: list[str], *, create: bool = False, shown: str = "") -> int:
        """An fd for the directory named by `parts` (the root itself when
        empty), walking one O_NOFOLLOW|O_DIRECTORY open per component.
        With create=True, missing components are made (owned like the root)."""
        fd = os.dup(self.fd)
        try:
            for i, name in enumerate(parts):
                where = shown or show("/".join(parts[:i + 1]))
                try:
                    nfd = os.open(name, DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise NotFound(f"{where} does not exist") from None
                    self.mkdir_at(fd, name)
                    nfd = open_dir_at(fd, name, where)
                except OSError as exc:
                    raise classify_open_error(exc, fd, name, show("/".join(parts[:i + 1]))) from None
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
        """New entries belong to the root's owner (for a workspace, the sandbox
        uid), so its owner can keep working on what was written."""
        own_at(dir_fd, name, self.uid, self.gid)

    def own_fd(self, fd: int) -> None:
        own_fd(fd, self.uid, self.gid)

    def _lstat(self, dfd: int, rel: RelPath) -> os.stat_result:
        """The entry itself (never a link's target); a link is refused."""
        try:
            st = os.stat(rel.name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            raise NotFound(f"{rel.shown} does not exist") from None
        if stat.S_ISLNK(st.st_mode):
            raise PermissionDenied(_LINK_REFUSED.format(rel.shown))
        return st

    # -- operations ------------------------------------------------------------
    def read(self, rel: RelPath, cap: int) -> tuple[bytes, int, bool]:
        """(content, size, truncated) of a regular file; at most `cap` bytes."""
        dfd = self.open_dir(rel.parent)
        try:
            fd = open_regular(dfd, rel.name, rel.shown)
        finally:
            os.close(dfd)
        try:
            size = os.fstat(fd).st_size
            chunks = []
            got = 0
            while got <= cap:
                b = os.read(fd, min(cap + 1 - got, 1 << 20))
                if not b:
                    break
                chunks.append(b)
                got += len(b)
        finally:
            os.close(fd)
        data = b"".join(chunks)
        return data[:cap], max(size, len(data)), len(data) > cap

    def write(self, rel: RelPath, content: bytes, *, mode: int = 0o644, create_parents: bool = False) -> int:
        """Replace (or create) a regular file with `content`: a temporary file
        in the same directory, renamed over the name on the directory fd."""
        shown, name = rel.shown, rel.name
        dfd = self.open_dir(rel.parent, create=create_parents)
        try:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISLNK(st.st_mode):
                raise PermissionDenied(_LINK_REFUSED.format(shown))
            if st is not None and not stat.S_ISREG(st.st_mode):
                raise FailedPrecondition(f"{shown} exists and is not a regular file")
            tmp = f".afe-tmp-{secrets.token_hex(8)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                try:
                    view = memoryview(content)
                    while view:
                        view = view[os.write(fd, view):]
                    self.own_fd(fd)
                    os.fchmod(fd, mode)
                finally:
                    os.close(fd)
                # rename replaces whatever is at `name` now (a symlink swapped
                # in is replaced, never followed); a directory makes it fail.
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException as exc:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                if isinstance(exc, OSError):
                    if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                        raise FailedPrecondition(f"{shown} is a directory") from None
                    raise FailedPrecondition(f"{shown}: {os.strerror(exc.errno or 0)}") from None
                raise
        finally:
            os.close(dfd)
        return len(content)

    def list(self, rel: RelPath, max_entries: int) -> tuple[list[tuple[str, os.stat_result]], bool]:
        """(name, lstat) of the entries of a directory, sorted by name, at most
        `max_entries`; with whether there were more."""
        dfd = self.open_dir(rel.parts, shown=rel.shown)
        out: list[tuple[str, os.stat_result]] = []
        truncated = False
        try:
            with os.scandir(dfd) as it:
                for e in it:
                    if len(out) >= max_entries:
                        truncated = True
                        break
                    try:
                        out.append((e.name, e.stat(follow_symlinks=False)))
                    except FileNotFoundError:
                        continue
        finally:
            os.close(dfd)
        out.sort(key=lambda pair: pair[0])
        return out, truncated

    def stat(self, rel: RelPath) -> tuple[str, os.stat_result]:
        """(name, lstat) of an entry; a link is refused."""
        if not rel.parts:
            return ".", os.fstat(self.fd)
        dfd = self.open_dir(rel.parent)
        try:
            return rel.name, self._lstat(dfd, rel)
        finally:
            os.close(dfd)

    def remove(self, rel: RelPath, recursive: bool = False) -> None:
        """Remove a file, or a directory (with `recursive`, whatever it holds)."""
        shown, name = rel.shown, rel.name
        dfd = self.open_dir(rel.parent)
        try:
            st = self._lstat(dfd, rel)
            if not stat.S_ISDIR(st.st_mode):
                try:
                    os.unlink(name, dir_fd=dfd)
                except FileNotFoundError:
                    raise NotFound(f"{shown} does not exist") from None
                except IsADirectoryError:
                    raise FailedPrecondition(f"{shown} changed while being removed; retry") from None
                return
            if recursive:
                sub = open_dir_at(dfd, name, shown)
                try:
                    empty_dir(sub)  # iterative, any depth, never follows a link (R34)
                except OSError as exc:
                    raise changed_during_call(exc) from None
                finally:
                    os.close(sub)
            try:
                os.rmdir(name, dir_fd=dfd)
            except OSError as exc:
                if exc.errno == errno.ENOTEMPTY:
                    raise FailedPrecondition(f"{shown} is a non-empty directory: pass recursive") from None
                raise classify_open_error(exc, dfd, name, shown) from None
        finally:
            os.close(dfd)

    def mkdir(self, rel: RelPath, parents: bool = False) -> None:
        shown = rel.shown
        dfd = self.open_dir(rel.parent, create=parents)
        try:
            try:
                os.mkdir(rel.name, 0o755, dir_fd=dfd)
            except FileExistsError:
                st = os.stat(rel.name, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    raise PermissionDenied(_LINK_REFUSED.format(shown)) from None
                if parents and stat.S_ISDIR(st.st_mode):
                    return
                raise AlreadyExists(f"{shown} already exists") from None
            self.own_at(dfd, rel.name)
        finally:
            os.close(dfd)

    def walk(self, rel: RelPath, limits: Limits, descend: Callable[[Item], bool] | None = None) -> Iterator[Item]:
        """`walk` under the directory `rel` (bounded, never following a link)."""
        dfd = self.open_dir(rel.parts, shown=rel.shown)
        try:
            yield from walk(dfd, limits, descend)
        finally:
            os.close(dfd)

    def chown(self, rel: RelPath, uid: int, gid: int, limits: Limits) -> int:
        """`chown_tree_at` on the directory `rel`; returns entries changed."""
        dfd = self.open_dir(rel.parts, shown=rel.shown)
        try:
            return chown_tree_at(dfd, uid, gid, limits)
        finally:
            os.close(dfd)
