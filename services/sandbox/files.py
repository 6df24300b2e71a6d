"""Host-side file tools on a ticket's workspace: read, write, list, stat,
remove, mkdir, search. No grpc here; every path goes through `paths`
(R17-R19). Errors name the path, never the content.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass

from services.common.errors import (
    AfeError,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from services.common.treewalk import Limits, empty_dir, walk

from .paths import (
    MAX_DEPTH,
    Root,
    _classify_open_error,
    changed_during_call,
    open_dir_at,
    show,
    split_relative,
)

DEFAULT_READ_CAP = 1024 * 1024
MAX_READ_CAP = 16 * 1024 * 1024
MAX_WRITE = 16 * 1024 * 1024
MAX_LIST = 10000
DEFAULT_SEARCH_RESULTS = 200
MAX_SEARCH_RESULTS = 5000
SEARCH_FILE_CAP = 2 * 1024 * 1024
SEARCH_TOTAL_CAP = 128 * 1024 * 1024
SEARCH_MAX_FILES = 50000
SEARCH_LINE_CHARS = 400
MAX_PATTERN = 1000

FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


@dataclass(frozen=True)
class Entry:
    name: str
    type: str            # regular | directory | symlink | other
    size: int
    mode: int
    mtime_ms: int


@dataclass(frozen=True)
class Match:
    path: str
    line: int
    text: str


def _type(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "regular"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def _entry(name: str, st: os.stat_result) -> Entry:
    return Entry(name=name, type=_type(st.st_mode), size=st.st_size, mode=stat.S_IMODE(st.st_mode),
                 mtime_ms=int(st.st_mtime_ns // 1_000_000))


def _open_regular(dir_fd: int, name: str, shown: str) -> int:
    """Open a regular file for reading without following links or blocking."""
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise _classify_open_error(exc, dir_fd, name, shown) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (FIFO, socket or device)"
        raise FailedPrecondition(f"{shown} is {kind}")
    return fd


class FileTools:
    """`workspace(ticket_id) -> path` resolves a ticket's workspace root."""

    def __init__(self, workspace: Callable[[str], os.PathLike | str]) -> None:
        self.workspace = workspace

    def _root(self, ticket_id: str) -> Root:
        return Root(os.fspath(self.workspace(ticket_id)))

    # -- read ----------------------------------------------------------------
    def read(self, ticket_id: str, path: str, max_bytes: int = 0) -> tuple[bytes, int, bool]:
        """(content, size, truncated); at most max_bytes (capped) are returned."""
        parts = split_relative(path)
        if max_bytes < 0:
            raise InvalidArgument("max_bytes must be >= 0 (0 = default)")
        cap = min(max_bytes or DEFAULT_READ_CAP, MAX_READ_CAP)
        shown = show(path)
        with self._root(ticket_id) as root:
            dfd = root.open_dir(parts[:-1])
            try:
                fd = _open_regular(dfd, parts[-1], shown)
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
        truncated = len(data) > cap
        return data[:cap], max(size, len(data)), truncated

    # -- write ---------------------------------------------------------------
    def write(self, ticket_id: str, path: str, content: bytes, *, create_parents: bool = False,
              mode: int = 0) -> int:
        parts = split_relative(path)
        if len(content) > MAX_WRITE:
            raise ResourceExhausted(
                f"content is larger than the {MAX_WRITE // (1024 * 1024)} MiB write limit")
        mode = mode or 0o644
        if mode & ~0o777:
            raise InvalidArgument("mode must be permission bits only (e.g. 0o644)")
        shown = show(path)
        name = parts[-1]
        with self._root(ticket_id) as root:
            dfd = root.open_dir(parts[:-1], create=create_parents)
            try:
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    st = None
                if st is not None and stat.S_ISLNK(st.st_mode):
                    raise PermissionDenied(f"{shown} is a symbolic link; symlinks are refused (R19)")
                if st is not None and not stat.S_ISREG(st.st_mode):
                    raise FailedPrecondition(f"{shown} exists and is not a regular file")
                tmp = f".afe-tmp-{secrets.token_hex(8)}"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o600, dir_fd=dfd)
                try:
                    try:
                        view = memoryview(content)
                        while view:
                            n = os.write(fd, view)
                            view = view[n:]
                        root.own_fd(fd)
                        os.fchmod(fd, mode)
                    finally:
                        os.close(fd)
                    # rename replaces whatever is at `name` now (a symlink swapped
                    # in is replaced, never followed); a directory makes it fail.
                    os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                except BaseException as exc:
                    try:
                        os.unlink(tmp, dir_fd=dfd)
                    except OSError:
                        pass
                    if isinstance(exc, OSError):
                        if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                            raise FailedPrecondition(f"{shown} is a directory") from None
                        raise FailedPrecondition(f"{shown}: {os.strerror(exc.errno or 0)}") from None
                    raise
            finally:
                os.close(dfd)
        return len(content)

    # -- list / stat -----------------------------------------------------------
    def list_dir(self, ticket_id: str, path: str = "") -> tuple[list[Entry], bool]:
        parts = split_relative(path, allow_root=True)
        with self._root(ticket_id) as root:
            dfd = root.open_dir(parts, shown=show(path))
            try:
                out: list[Entry] = []
                truncated = False
                with os.scandir(dfd) as it:
                    for e in it:
                        if len(out) >= MAX_LIST:
                            truncated = True
                            break
                        try:
                            out.append(_entry(e.name, e.stat(follow_symlinks=False)))
                        except FileNotFoundError:
                            continue
            finally:
                os.close(dfd)
        out.sort(key=lambda e: e.name)
        return out, truncated

    def stat(self, ticket_id: str, path: str) -> Entry:
        parts = split_relative(path, allow_root=True)
        shown = show(path)
        with self._root(ticket_id) as root:
            if not parts:
                return _entry(".", os.fstat(root.fd))
            dfd = root.open_dir(parts[:-1])
            try:
                try:
                    st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    raise NotFound(f"{shown} does not exist") from None
                if stat.S_ISLNK(st.st_mode):
                    raise PermissionDenied(f"{shown} is a symbolic link; symlinks are refused (R19)")
                return _entry(parts[-1], st)
            finally:
                os.close(dfd)

    # -- remove / mkdir --------------------------------------------------------
    def remove(self, ticket_id: str, path: str, recursive: bool = False) -> None:
        parts = split_relative(path)
        shown = show(path)
        name = parts[-1]
        with self._root(ticket_id) as root:
            dfd = root.open_dir(parts[:-1])
            try:
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    raise NotFound(f"{shown} does not exist") from None
                if stat.S_ISLNK(st.st_mode):
                    raise PermissionDenied(f"{shown} is a symbolic link; symlinks are refused (R19)")
                if stat.S_ISDIR(st.st_mode):
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
                            raise FailedPrecondition(
                                f"{shown} is a non-empty directory: pass recursive") from None
                        raise _classify_open_error(exc, dfd, name, shown) from None
                else:
                    try:
                        os.unlink(name, dir_fd=dfd)
                    except FileNotFoundError:
                        raise NotFound(f"{shown} does not exist") from None
                    except IsADirectoryError:
                        raise FailedPrecondition(f"{shown} changed while being removed; retry") from None
            finally:
                os.close(dfd)

    def mkdir(self, ticket_id: str, path: str, parents: bool = False) -> None:
        parts = split_relative(path)
        shown = show(path)
        with self._root(ticket_id) as root:
            dfd = root.open_dir(parts[:-1], create=parents)
            try:
                try:
                    os.mkdir(parts[-1], 0o755, dir_fd=dfd)
                except FileExistsError:
                    st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
                    if stat.S_ISLNK(st.st_mode):
                        raise PermissionDenied(
                            f"{shown} is a symbolic link; symlinks are refused (R19)") from None
                    if parents and stat.S_ISDIR(st.st_mode):
                        return
                    raise AlreadyExists(f"{shown} already exists") from None
                root.own_at(dfd, parts[-1])
            finally:
                os.close(dfd)

    # -- search ----------------------------------------------------------------
    def search(self, ticket_id: str, pattern: str, path: str = "", *, regex: bool = False,
               max_results: int = 0) -> tuple[list[Match], bool]:
        if not pattern or len(pattern) > MAX_PATTERN or "\x00" in pattern:
            raise InvalidArgument(f"pattern must be 1-{MAX_PATTERN} characters without NUL")
        if max_results < 0:
            raise InvalidArgument("max_results must be >= 0 (0 = default)")
        limit = min(max_results or DEFAULT_SEARCH_RESULTS, MAX_SEARCH_RESULTS)
        try:
            rx = re.compile(pattern if regex else re.escape(pattern))
        except re.error as exc:
            raise InvalidArgument(f"pattern is not a valid regular expression: {exc.msg}") from None
        if regex:
            check_regex_is_linear(pattern)
        parts = split_relative(path, allow_root=True)
        state = {"files": 0, "bytes": 0, "truncated": False}
        matches: list[Match] = []
        with self._root(ticket_id) as root:
            shown = show(path)
            try:
                dfd = root.open_dir(parts, shown=shown)
            except FailedPrecondition:
                # a single file
                dfd = root.open_dir(parts[:-1])
                try:
                    fd = _open_regular(dfd, parts[-1], shown)
                finally:
                    os.close(dfd)
                _search_fd(fd, "/".join(parts), rx, matches, limit, state)
                return matches, bool(state["truncated"])
            try:
                _search_dir(dfd, "/".join(parts), rx, matches, limit, state)
            finally:
                os.close(dfd)
        return matches, bool(state["truncated"])


def check_regex_is_linear(pattern: str) -> None:
    """Refuse the regex shapes that backtrack catastrophically (a repeat
    inside a repeat, a repeated alternation, backreferences): a search must
    not hang a broker thread."""
    try:
        import re._parser as sre_parse  # Python >= 3.11
    except ImportError:  # pragma: no cover
        import sre_parse  # type: ignore[no-redef]
    repeats = {sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT, sre_parse.POSSESSIVE_REPEAT} \
        if hasattr(sre_parse, "POSSESSIVE_REPEAT") else {sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT}

    def walk(items, inside_repeat: bool) -> None:
        for op, av in items:
            if op in (sre_parse.GROUPREF, sre_parse.GROUPREF_EXISTS):
                raise InvalidArgument("regex backreferences are not supported in search")
            if op in repeats:
                _lo, hi, sub = av
                if inside_repeat and hi > 1:
                    raise InvalidArgument(
                        "nested repetition like (a+)+ is not supported in search; simplify the regex")
                walk(sub, inside_repeat or hi > 1)
            elif op is sre_parse.SUBPATTERN:
                walk(av[-1], inside_repeat)
            elif op is sre_parse.BRANCH:
                if inside_repeat:
                    raise InvalidArgument("a repeated alternation like (a|b)* is not supported in search; "
                                          "use a character class")
                for b in av[1]:
                    walk(b, inside_repeat)
            elif op in (sre_parse.ASSERT, sre_parse.ASSERT_NOT):
                walk(av[1], inside_repeat)

    walk(sre_parse.parse(pattern), False)


SEARCH_LIMITS = Limits("search", "the searched directory", max_depth=MAX_DEPTH)


def _search_dir(dfd: int, prefix: str, rx: re.Pattern, matches: list[Match], limit: int,
                state: dict) -> None:
    """An iterative, bounded walk (R34); `.git` directories are not searched."""
    base = os.fsencode(prefix + "/") if prefix else b""
    for item in walk(dfd, SEARCH_LIMITS, descend=lambda it: it.name != b".git"):
        if state["truncated"]:
            return
        if not stat.S_ISREG(item.st.st_mode):
            continue
        rel = os.fsdecode(base + item.rel)
        state["files"] += 1
        if state["files"] > SEARCH_MAX_FILES or state["bytes"] > SEARCH_TOTAL_CAP:
            state["truncated"] = True
            return
        try:
            fd = _open_regular(item.dir_fd, os.fsdecode(item.name), rel)
        except AfeError:
            continue      # changed under us, or not a regular file: skip it
        _search_fd(fd, rel, rx, matches, limit, state)


def _search_fd(fd: int, rel: str, rx: re.Pattern, matches: list[Match], limit: int, state: dict) -> None:
    try:
        data = os.read(fd, SEARCH_FILE_CAP)
    finally:
        os.close(fd)
    state["bytes"] += len(data)
    if b"\x00" in data[:8192]:
        return
    text = data.decode("utf-8", "replace")
    for i, line in enumerate(text.splitlines(), 1):
        if rx.search(line[:4096]):
            if len(matches) >= limit:
                state["truncated"] = True
                return
            matches.append(Match(rel, i, line[:SEARCH_LINE_CHARS]))
