"""Host-side file tools on a ticket's workspace: read, write, list, stat,
remove, mkdir, search. No grpc here: the ticket's caps and messages over
`safefs.Root` (through `paths`), which opens every path component by
component with O_NOFOLLOW (R17-R19). Errors name the path, never the content.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from services.common.errors import AfeError, FailedPrecondition, InvalidArgument, ResourceExhausted
from services.common.safefs import Limits, RelPath, open_regular, walk
from services.sandbox.files.paths import MAX_DEPTH, Root

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


class FileTools:
    """`workspace(ticket_id) -> path` resolves a ticket's workspace root."""

    def __init__(self, workspace: Callable[[str], os.PathLike[str] | str]) -> None:
        self.workspace = workspace

    def _root(self, ticket_id: str) -> Root:
        return Root(os.fspath(self.workspace(ticket_id)))

    # -- read / write ---------------------------------------------------------
    def read(self, ticket_id: str, path: str, max_bytes: int = 0) -> tuple[bytes, int, bool]:
        """(content, size, truncated); at most max_bytes (capped) are returned."""
        rel = RelPath.parse(path)
        if max_bytes < 0:
            raise InvalidArgument("max_bytes must be >= 0 (0 = default)")
        with self._root(ticket_id) as root:
            return root.read(rel, min(max_bytes or DEFAULT_READ_CAP, MAX_READ_CAP))

    def write(self, ticket_id: str, path: str, content: bytes, *, create_parents: bool = False,
              mode: int = 0) -> int:
        rel = RelPath.parse(path)
        if len(content) > MAX_WRITE:
            raise ResourceExhausted(
                f"content is larger than the {MAX_WRITE // (1024 * 1024)} MiB write limit")
        mode = mode or 0o644
        if mode & ~0o777:
            raise InvalidArgument("mode must be permission bits only (e.g. 0o644)")
        with self._root(ticket_id) as root:
            return root.write(rel, content, mode=mode, create_parents=create_parents)

    # -- list / stat -----------------------------------------------------------
    def list_dir(self, ticket_id: str, path: str = "") -> tuple[list[Entry], bool]:
        rel = RelPath.parse(path, allow_root=True)
        with self._root(ticket_id) as root:
            found, truncated = root.list(rel, MAX_LIST)
        return [_entry(name, st) for name, st in found], truncated

    def stat(self, ticket_id: str, path: str) -> Entry:
        rel = RelPath.parse(path, allow_root=True)
        with self._root(ticket_id) as root:
            return _entry(*root.stat(rel))

    # -- remove / mkdir --------------------------------------------------------
    def remove(self, ticket_id: str, path: str, recursive: bool = False) -> None:
        rel = RelPath.parse(path)
        with self._root(ticket_id) as root:
            root.remove(rel, recursive)

    def mkdir(self, ticket_id: str, path: str, parents: bool = False) -> None:
        rel = RelPath.parse(path)
        with self._root(ticket_id) as root:
            root.mkdir(rel, parents)

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
        rel = RelPath.parse(path, allow_root=True)
        parts = rel.parts
        state: dict[str, int] = {"files": 0, "bytes": 0, "truncated": False}   # truncated: a bool
        matches: list[Match] = []
        with self._root(ticket_id) as root:
            try:
                dfd = root.open_dir(parts, shown=rel.shown)
            except FailedPrecondition:
                # a single file
                dfd = root.open_dir(rel.parent)
                try:
                    fd = open_regular(dfd, rel.name, rel.shown)
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
        import sre_parse
    repeats = {sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT, sre_parse.POSSESSIVE_REPEAT} \
        if hasattr(sre_parse, "POSSESSIVE_REPEAT") else {sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT}

    # re's parser is untyped here: its items are (opcode, argument) pairs whose argument's shape depends
    # on the opcode
    def walk(items: Iterable[tuple[Any, Any]], inside_repeat: bool) -> None:
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


def _search_dir(dfd: int, prefix: str, rx: re.Pattern[str], matches: list[Match], limit: int,
                state: dict[str, int]) -> None:
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
            fd = open_regular(item.dir_fd, os.fsdecode(item.name), rel)
        except AfeError:
            continue      # changed under us, or not a regular file: skip it
        _search_fd(fd, rel, rx, matches, limit, state)


def _search_fd(fd: int, rel: str, rx: re.Pattern[str], matches: list[Match], limit: int,
               state: dict[str, int]) -> None:
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
