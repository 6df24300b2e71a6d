"""A workspace as a bounded tar stream, and back (R17-R19, R34; docs/SCALE.md).

When a ticket's sandbox is on another host, its workspace crosses the
network through the contracts as a tar stream (POSIX ustar, with PAX `x`
headers for long or non-ASCII names): the credential broker's checkout to the
sandbox broker (`WriteWorkspace`), the sandbox's tree back to the credential
broker for a commit, a diff or the kept state (`ReadWorkspace`).

`pack` reads a tree through `walk` (iterative, bounded, never following a
link): directories, regular files (read through the fd we opened, checked
again with `fstat`) and symbolic links (stored as links, their target as
read by `readlink`, never followed); FIFOs, sockets and devices are left
out. `skip` names directories whose content is left out (the directory
itself is stored, empty): `.git` for a snapshot.

The ustar/PAX encoding itself is tarformat.py's.

`Unpacker` is our own push parser of that format, not `tarfile`: the sender
is untrusted, and `tarfile` reads a PAX header of any declared size into
memory and follows its own rules for links. Every entry is checked before
anything is written:

- the name is relative, without `..`, `.` or empty components, at most
  `MAX_PATH` bytes, components at most 255 bytes, at most `max_depth` deep;
- only directories, regular files and symbolic links; hard links, devices,
  FIFOs, GNU sparse files and every other type are refused;
- every component is opened from the root's fd with `O_NOFOLLOW |
  O_DIRECTORY` (`DirCache`), so an entry under a link the archive made
  before (`evil -> /etc`, then `evil/passwd`) is refused, never written
  through; files are created with `O_CREAT | O_EXCL | O_NOFOLLOW` (an entry
  given twice is refused, nothing is overwritten);
- entries, depth and total file bytes are bounded (`ArchiveLimits`), a PAX
  header is at most 64 KiB; modes are 0755/0644 (no set-id bit), owners are
  the extracting process's (the caller hands the tree over).

A refused archive raises `BadArchive` (InvalidArgument) or `TreeTooLarge`
naming the limit; the caller removes what was written.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

from ..errors import FailedPrecondition
from .open import DIR_FLAGS, MAX_COMPONENT, MAX_PATH, DirCache, open_regular_or_none
from .tarformat import (
    BLOCK,
    DIRTYPE,
    MAX_PAX,
    PAXTYPE,
    REGTYPE,
    SYMTYPE,
    BadArchive,
    entry_header,
    octal_field,
    parse_pax,
)
from .walk import DEFAULT_MAX_DEPTH, DEFAULT_MAX_ENTRIES, Item, Limits, TreeTooLarge, walk

CHUNK = 1 << 20                 # bytes per message on the wire
DEFAULT_MAX_BYTES = 10 * 1024 ** 3   # the default workspace disk cap (sandbox.limits.disk)


@dataclass(frozen=True)
class ArchiveLimits:
    """Bounds of one archive (R34). `what` names it in messages
    ("the workspace hand-over"); `max_bytes` bounds the sum of the regular
    files' sizes, `max_file` one file's (0 = `max_bytes`)."""

    what: str
    max_depth: int = DEFAULT_MAX_DEPTH
    max_entries: int = DEFAULT_MAX_ENTRIES
    max_bytes: int = DEFAULT_MAX_BYTES
    max_file: int = 0

    def walk_limits(self) -> Limits:
        return Limits(self.what, max_depth=self.max_depth, max_entries=self.max_entries)

    def too_large(self, total: int) -> TreeTooLarge:
        return TreeTooLarge(f"the workspace holds more than {_size(self.max_bytes)} of files (limit of {self.what}, "
                            f"at least {_size(total)} seen); remove large files you do not need", "bytes",
                            self.max_bytes)

    def file_too_large(self, rel: bytes) -> TreeTooLarge:
        return TreeTooLarge(f"the workspace file {_shown(rel)} is larger than {_size(self.max_file)} (limit of "
                            f"{self.what}); remove it or list it in .gitignore", "file", self.max_file)


def _size(n: int) -> str:
    for unit, size in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} bytes"


def _shown(rel: bytes) -> str:
    return repr(rel[:120].decode("utf-8", "backslashreplace") + ("..." if len(rel) > 120 else ""))


# -- writing -------------------------------------------------------------------

def pack(root_fd: int, limits: ArchiveLimits, skip: Callable[[bytes], bool] | None = None
         ) -> Generator[bytes, None, None]:
    """The tree under `root_fd` as tar chunks (about `CHUNK` bytes each).

    Raises TreeTooLarge past `limits` and FailedPrecondition when a file
    shrinks while it is read (freeze the sandbox around the read)."""
    total = 0
    out = bytearray()

    def descend(item: Item) -> bool:
        return skip is None or not skip(item.name)

    for item in walk(root_fd, limits.walk_limits(), descend=descend):
        st, rel = item.st, item.rel
        if len(rel) > MAX_PATH:
            raise TreeTooLarge(f"a workspace path is longer than {MAX_PATH} bytes (limit of {limits.what}): "
                               f"{_shown(rel)}; shorten its directory or file names", "path", MAX_PATH)
        if stat.S_ISDIR(st.st_mode):
            out += entry_header(rel + b"/", DIRTYPE, mode=0o755)
        elif stat.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(item.name, dir_fd=item.dir_fd)
            except OSError:
                continue
            out += entry_header(rel, SYMTYPE, mode=0o777, link=os.fsencode(target))
        elif stat.S_ISREG(st.st_mode):
            fd = open_regular_or_none(item.dir_fd, item.name)
            if fd is None:
                continue
            try:
                fst = os.fstat(fd)
                size = fst.st_size
                if limits.max_file and size > limits.max_file:
                    raise limits.file_too_large(rel)
                total += size
                if total > limits.max_bytes:
                    raise limits.too_large(total)
                mode = 0o755 if fst.st_mode & stat.S_IXUSR else 0o644
                out += entry_header(rel, REGTYPE, size=size, mode=mode, mtime=int(fst.st_mtime))
                left = size
                while left:
                    data = os.read(fd, min(left, CHUNK))
                    if not data:
                        raise FailedPrecondition(f"the workspace file {_shown(rel)} shrank while it was read; "
                                                 "retry (nothing may write the workspace meanwhile)")
                    out += data
                    left -= len(data)
                    if len(out) >= CHUNK:
                        yield bytes(out)
                        out.clear()
                out += b"\0" * (-size % BLOCK)
            finally:
                os.close(fd)
        # FIFOs, sockets and devices are never content.
        if len(out) >= CHUNK:
            yield bytes(out)
            out.clear()
    out += b"\0" * (2 * BLOCK)
    yield bytes(out)


def pack_path(path: str | os.PathLike[str], limits: ArchiveLimits,
              skip: Callable[[bytes], bool] | None = None) -> Generator[bytes, None, None]:
    """`pack` of the directory at `path` (opened without following a link)."""
    try:
        fd = os.open(path, DIR_FLAGS)
    except FileNotFoundError:
        raise FailedPrecondition("the ticket's workspace does not exist; prepare it first") from None
    try:
        yield from pack(fd, limits, skip)
    finally:
        os.close(fd)


# -- reading -------------------------------------------------------------------

def _check_name(raw: bytes, limits: ArchiveLimits) -> list[bytes]:
    """The components of an entry's name, or BadArchive (R17)."""
    name = raw[:-1] if raw.endswith(b"/") else raw
    shown = _shown(raw)
    if not name:
        raise BadArchive("an archive entry has an empty name")
    if b"\0" in name:
        raise BadArchive(f"the archive entry {shown} holds a NUL byte")
    if name.startswith(b"/"):
        raise BadArchive(f"the archive entry {shown} is an absolute path: entries must be relative (R17)")
    if len(name) > MAX_PATH:
        raise BadArchive(f"the archive entry {shown} is longer than {MAX_PATH} bytes")
    parts = name.split(b"/")
    for p in parts:
        if p == b"..":
            raise BadArchive(f"the archive entry {shown} contains '..': entries must stay inside the workspace (R17)")
        if p in (b"", b"."):
            raise BadArchive(f"the archive entry {shown} has an empty or '.' component")
        if len(p) > MAX_COMPONENT:
            raise BadArchive(f"a component of the archive entry {shown} is longer than {MAX_COMPONENT} bytes")
    if len(parts) > limits.max_depth:
        raise limits.walk_limits().too_deep()
    return parts


class Unpacker:
    """Extracts a tar stream fed in chunks into the empty directory `root_fd`
    (see the module's rules). `feed` each chunk, `finish`, and `close` in any case; counts in
    `entries` and `bytes`."""

    def __init__(self, root_fd: int, limits: ArchiveLimits) -> None:
        self.limits = limits
        self.entries = 0
        self.bytes = 0
        self._dirs = DirCache(root_fd)
        self._buf = bytearray()
        self._pax: dict[bytes, bytes] = {}
        self._state = "header"      # header | pax | data | pad | end
        self._need = BLOCK
        self._fd: int | None = None
        self._left = 0
        self._rel = b""
        self._zeros = 0

    def feed(self, data: bytes) -> None:
        if self._state == "end":
            return   # anything after the end marker is ignored, as tar does
        self._buf += data
        while self._state != "end":
            if self._state == "data":
                if not self._buf:
                    return
                take = min(len(self._buf), self._left)
                self._write(bytes(self._buf[:take]))
                del self._buf[:take]
                self._left -= take
                if self._left == 0:
                    self._close_file()
                    self._state, self._need = "pad", self._pad
                continue
            if len(self._buf) < self._need:
                return
            chunk = bytes(self._buf[:self._need])
            del self._buf[:self._need]
            if self._state == "header":
                self._header(chunk)
            elif self._state == "pax":
                self._pax = parse_pax(chunk[:self._pax_len])
                self._state, self._need = "header", BLOCK
            else:   # pad
                self._state, self._need = "header", BLOCK

    def finish(self) -> None:
        """The stream ended: it must have ended with tar's end marker (two zero blocks)."""
        if self._state != "end" and not (self._state == "header" and self._zeros == 1 and not self._buf):
            raise BadArchive(f"the archive ended in the middle of an entry ({self.entries} entries read); "
                             "the sender stopped early, retry")

    def close(self) -> None:
        """Release the fds (always, also after a refusal)."""
        self._close_file()
        self._dirs.close()

    # -- entries ---------------------------------------------------------------
    def _header(self, h: bytes) -> None:
        if h == b"\0" * BLOCK:
            self._zeros += 1
            if self._zeros == 2:
                self._state = "end"
            return
        if self._zeros:
            raise BadArchive("the archive has a zero block in the middle")
        stored = octal_field(h[148:156], "checksum")
        if stored != sum(h[:148]) + 8 * 32 + sum(h[156:]):
            raise BadArchive("an archive header's checksum is wrong (not a tar stream, or damaged)")
        typeflag = h[156:157]
        size = octal_field(h[124:136], "size")
        name = h[0:100].split(b"\0", 1)[0]
        if h[257:263] == b"ustar\x00" and h[345]:
            name = h[345:500].split(b"\0", 1)[0] + b"/" + name
        link = h[157:257].split(b"\0", 1)[0]
        if typeflag == PAXTYPE:
            if size > MAX_PAX:
                raise BadArchive(f"an archive PAX header is larger than {MAX_PAX} bytes")
            self._pax_len = size
            self._state, self._need = "pax", size + (-size % BLOCK)
            if self._need == 0:
                self._state, self._need = "header", BLOCK
            return
        pax, self._pax = self._pax, {}
        name = pax.get(b"path", name)
        link = pax.get(b"linkpath", link)
        if b"size" in pax:
            if not pax[b"size"].isdigit():
                raise BadArchive("an archive PAX size is not a number")
            size = int(pax[b"size"])
        self.entries += 1
        if self.entries > self.limits.max_entries:
            raise self.limits.walk_limits().too_many()
        parts = _check_name(name, self.limits)
        rel = b"/".join(parts)
        if typeflag in (REGTYPE, b"\0", b"7"):
            self._file(rel, parts, size, octal_field(h[100:108], "mode"))
            return
        if size:
            raise BadArchive(f"the archive entry {_shown(rel)} is not a regular file but carries data")
        if typeflag == DIRTYPE:
            self._mkdir(rel, parts)
        elif typeflag == SYMTYPE:
            if not link or b"\0" in link or len(link) > MAX_PATH:
                raise BadArchive(f"the archive link {_shown(rel)} has an empty or overlong target")
            self._at(rel, parts, lambda dfd, n: os.symlink(link, n, dir_fd=dfd))
        elif typeflag == b"1":
            raise BadArchive(f"the archive entry {_shown(rel)} is a hard link; hard links are refused")
        elif typeflag in (b"3", b"4"):
            raise BadArchive(f"the archive entry {_shown(rel)} is a device file; devices are refused")
        elif typeflag == b"6":
            raise BadArchive(f"the archive entry {_shown(rel)} is a FIFO; FIFOs are refused")
        else:
            raise BadArchive(f"the archive entry {_shown(rel)} has type {typeflag!r}; only directories, "
                             "regular files and symbolic links are accepted")

    def _parent(self, rel: bytes, parts: list[bytes]) -> int:
        dfd = self._dirs.get(b"/".join(parts[:-1]))
        if dfd is None:
            raise BadArchive(f"the archive entry {_shown(rel)} is under a path that is not a directory (a link, a "
                             "file or missing); entries are never written through a link (R18, R19)")
        return dfd

    def _at(self, rel: bytes, parts: list[bytes], op: Callable[[int, bytes], None]) -> None:
        dfd = self._parent(rel, parts)
        try:
            op(dfd, parts[-1])
        except FileExistsError:
            raise BadArchive(f"the archive entry {_shown(rel)} is given twice") from None

    def _mkdir(self, rel: bytes, parts: list[bytes]) -> None:
        self._at(rel, parts, lambda dfd, n: os.mkdir(n, 0o755, dir_fd=dfd))

    def _file(self, rel: bytes, parts: list[bytes], size: int, mode: int) -> None:
        if self.limits.max_file and size > self.limits.max_file:
            raise self.limits.file_too_large(rel)
        if self.bytes + size > self.limits.max_bytes:
            raise self.limits.too_large(self.bytes + size)
        self.bytes += size
        dfd = self._parent(rel, parts)
        perm = 0o755 if mode & 0o100 else 0o644
        try:
            self._fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                               perm, dir_fd=dfd)
        except FileExistsError:
            raise BadArchive(f"the archive entry {_shown(rel)} is given twice") from None
        os.fchmod(self._fd, perm)
        self._rel, self._left, self._pad = rel, size, -size % BLOCK
        if size == 0:
            self._close_file()
            return
        self._state = "data"

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            try:
                n = os.write(self._fd, view)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise FailedPrecondition(f"the workspace's disk is full while writing {_shown(self._rel)} "
                                             f"({self.limits.what}); raise sandbox.limits.disk") from None
                raise
            view = view[n:]

    def _close_file(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    _pad = 0
    _pax_len = 0


def unpack_into(root_fd: int, chunks: Iterator[bytes], limits: ArchiveLimits) -> Unpacker:
    """Feed every chunk into a new Unpacker on `root_fd` and close it."""
    u = Unpacker(root_fd, limits)
    try:
        for c in chunks:
            u.feed(c)
        u.finish()
    finally:
        u.close()
    return u
