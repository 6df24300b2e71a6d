"""Capturing the workspace tree without trusting it.

The workspace is written by the sandbox, possibly while we read it. Host git
never reads it: we walk it ourselves through `services.common.safefs`, every
component opened relative to its parent's fd with `O_NOFOLLOW`, so a directory swapped for a symlink mid-walk
fails instead of being followed. Regular files are read through the fd we
opened (checked again with `fstat`), symlinks are recorded as links (mode
120000, target from `readlink` relative to the parent fd) and never
followed, FIFOs, sockets and devices are skipped, and every `.git` entry is
skipped (the sandbox's scratch repository is not content). Names are bytes:
a newline, a tab or a non-UTF-8 byte in a name is committed as it is (the
index is fed NUL-separated).

The walk is iterative and bounded (`SNAPSHOT_LIMITS`, R34): a tree deeper
or larger than the limits fails the commit with a message naming the limit.
Any other git repository found inside the workspace (a directory holding a
`.git`, or a bare repository's HEAD + objects/ + refs/) is reported in
`Scan.repos`, so the commit can warn the reviewer that it is committed as
plain files.

Blobs are written straight into the ticket's private object store as loose
objects; the caller builds the tree with `git update-index --index-info` into
a private index and `git write-tree`.
"""

from __future__ import annotations

import hashlib
import os
import stat
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from services.common import safefs
from services.common.errors import FailedPrecondition

MAX_FILE_BYTES = 100 * 1024 * 1024
MAX_PATH_BYTES = 4096                                     # git's own limit on Linux (PATH_MAX)
SNAPSHOT_LIMITS = safefs.Limits("the commit snapshot")   # depth 256, 1,000,000 entries (R34)

# A directory holding `.git` (a directory or a gitlink file), or HEAD + objects/ + refs/
# (a bare repository), is another repository: committed as plain content, so reported.
_BARE_SHAPE = {b"HEAD", b"objects", b"refs"}


@dataclass(frozen=True)
class Entry:
    mode: str          # 100644 | 100755 | 120000
    sha: str
    path: bytes        # relative, '/'-separated


class ObjectWriter:
    """Writes loose objects into a git object directory (idempotent).

    `known` holds blob ids already in the repository (or its alternates),
    e.g. every blob of the base tree, so unchanged files are not written again.
    """

    def __init__(self, objects_dir: Path, known: set[str] | None = None) -> None:
        self.objects_dir = objects_dir
        self.known = known if known is not None else set()

    def write_blob(self, data: bytes) -> str:
        header = b"blob %d\0" % len(data)
        sha = hashlib.sha1(header + data).hexdigest()
        if sha in self.known:
            return sha
        folder = self.objects_dir / sha[:2]
        path = folder / sha[2:]
        if path.exists():
            return sha
        folder.mkdir(exist_ok=True)
        tmp = folder / f".tmp-{os.getpid()}-{sha[2:10]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444)
        try:
            os.write(fd, zlib.compress(header + data, 1))
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return sha


def _is_dot_git(name: bytes) -> bool:
    """`.git` and the names Windows/macOS file systems treat as `.git`
    (`.GIT`, `.git.`, `.git ` and the 8.3 short name `git~1`): never content."""
    low = name.lower().rstrip(b". ")
    return low in (b".git", b"git~1")


def _read_fd(fd: int, size_hint: int) -> bytes:
    chunks = []
    total = 0
    while True:
        b = os.read(fd, max(65536, min(size_hint, 16 * 1024 * 1024)))
        if not b:
            break
        total += len(b)
        if total > MAX_FILE_BYTES:
            raise FailedPrecondition(f"a workspace file is larger than {MAX_FILE_BYTES >> 20} MiB; "
                                     "remove it from the workspace or list it in .gitignore")
        chunks.append(b)
    return b"".join(chunks)


@dataclass
class Scan:
    """What a walk found: files and links (relative paths), every directory,
    and the bytes of every `.gitignore` (read through its own fd)."""

    files: list[bytes]
    links: dict[bytes, bytes]
    dirs: list[bytes]
    gitignores: dict[bytes, bytes]
    repos: list[bytes] = field(default_factory=list)   # nested repositories ('' = the root's bare shape)


def _open_root(root: Path) -> int:
    try:
        return os.open(root, safefs.DIR_FLAGS)
    except FileNotFoundError:
        raise FailedPrecondition("the ticket's workspace does not exist; prepare it first") from None
    except OSError as exc:
        raise FailedPrecondition(f"the ticket's workspace cannot be opened ({exc.strerror})") from None


def scan(root: Path, limits: safefs.Limits = SNAPSHOT_LIMITS) -> Scan:
    """Walk `root` without following anything; list what could be content."""
    result = Scan([], {}, [], {})
    root_fd = _open_root(root)
    try:
        _walk(root_fd, result, limits)
    finally:
        os.close(root_fd)
    return result


def _shown(rel: bytes) -> str:
    return repr(rel[:80].decode("utf-8", "backslashreplace") + ("..." if len(rel) > 80 else ""))


def skeleton(root_fd: int, found: Scan) -> None:
    """Recreate, under the empty directory root_fd, the directories of `found`
    and their .gitignore bytes: every mkdir relative to its parent's fd, so a
    path of any length works (for `git check-ignore` on a private copy)."""
    stack: list[tuple[bytes, int]] = [(b"", root_fd)]

    def put_gitignore(prefix: bytes, fd: int) -> None:
        data = found.gitignores.get(prefix)
        if data is not None:
            gfd = os.open(b".gitignore", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                          0o600, dir_fd=fd)
            try:
                os.write(gfd, data)
            finally:
                os.close(gfd)

    put_gitignore(b"", root_fd)
    try:
        for rel in found.dirs:  # pre-order: a parent comes before its children
            while not rel.startswith(stack[-1][0]):
                os.close(stack.pop()[1])
            name = rel[len(stack[-1][0]):]
            os.mkdir(name, 0o700, dir_fd=stack[-1][1])
            fd = os.open(name, safefs.DIR_FLAGS, dir_fd=stack[-1][1])
            stack.append((rel + b"/", fd))
            put_gitignore(rel + b"/", fd)
    finally:
        for _prefix, fd in stack[1:]:
            os.close(fd)


def _walk(root_fd: int, out: Scan, limits: safefs.Limits) -> None:
    """One iterative, bounded walk (R34); `.git` entries are never entered or kept."""
    seen: dict[bytes, set[bytes]] = {}   # directory -> names that make a repository shape
    for item in safefs.walk(root_fd, limits, descend=lambda it: not _is_dot_git(it.name)):
        name, rel, st = item.name, item.rel, item.st
        if len(rel) > MAX_PATH_BYTES:
            raise safefs.TreeTooLarge(
                f"a workspace path is longer than {MAX_PATH_BYTES} bytes (limit of the commit snapshot): "
                f"{_shown(rel)}; shorten its directory or file names", "path", MAX_PATH_BYTES)
        if _is_dot_git(name):
            seen.setdefault(item.parent, set()).add(b".git")  # a directory or a gitlink file
            continue
        if (name == b"HEAD" and stat.S_ISREG(st.st_mode)) or (name in _BARE_SHAPE and stat.S_ISDIR(st.st_mode)):
            seen.setdefault(item.parent, set()).add(name)
        if stat.S_ISLNK(st.st_mode):
            try:
                out.links[rel] = os.fsencode(os.readlink(name, dir_fd=item.dir_fd))
            except OSError:
                continue
        elif stat.S_ISDIR(st.st_mode):
            out.dirs.append(rel)
        elif stat.S_ISREG(st.st_mode):
            out.files.append(rel)
            if name == b".gitignore":
                fd = safefs.open_regular_or_none(item.dir_fd, name)
                if fd is not None:
                    try:
                        out.gitignores[item.parent] = _read_fd(fd, 65536)[:1 << 20]
                    finally:
                        os.close(fd)
        # FIFOs, sockets and devices are never content.
    for parent, marks in seen.items():
        if parent == b"" and marks == {b".git"}:
            continue  # the workspace's own scratch repository (never content)
        if b".git" in marks or marks >= _BARE_SHAPE:
            out.repos.append(parent.rstrip(b"/"))
    out.repos.sort()


def materialize(root: Path, found: Scan, ignored: set[bytes], writer: ObjectWriter) -> list[Entry]:
    """Read every kept file again, component by component with O_NOFOLLOW, into blobs."""
    entries: list[Entry] = []
    for rel, target in found.links.items():
        if rel not in ignored:
            entries.append(Entry("120000", writer.write_blob(target), rel))
    root_fd = _open_root(root)
    try:
        with safefs.DirCache(root_fd) as dirs:   # at most 256 directory fds open
            for rel in found.files:
                if rel in ignored:
                    continue
                parent, _, name = rel.rpartition(b"/")
                dfd = dirs.get(parent)
                fd = None if dfd is None else safefs.open_regular_or_none(dfd, name)
                if fd is None:
                    continue
                try:
                    fst = os.fstat(fd)
                    data = _read_fd(fd, fst.st_size)
                finally:
                    os.close(fd)
                mode = "100755" if fst.st_mode & stat.S_IXUSR else "100644"
                entries.append(Entry(mode, writer.write_blob(data), rel))
    finally:
        os.close(root_fd)
    entries.sort(key=lambda e: e.path)
    return entries


def capture(root: Path, writer: ObjectWriter, ignored: set[bytes] | None = None) -> list[Entry]:
    """Scan and materialize in one go (no ignore rules unless given)."""
    return materialize(root, scan(root), ignored or set(), writer)


def index_info(entries: list[Entry]) -> bytes:
    """Input for `git update-index -z --index-info`."""
    return b"".join(b"%s %s\t%s\0" % (e.mode.encode(), e.sha.encode(), e.path) for e in entries)
