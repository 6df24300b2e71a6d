"""The tar format as afe writes and reads it (archive.py): POSIX ustar
headers, with a PAX `x` header before an entry whose name or link target is
too long or not ASCII.

Only the encoding lives here; what may be packed and what an unpacked entry
may be (R17-R19, R34) is archive.py's.
"""

from __future__ import annotations

from ..errors import InvalidArgument

BLOCK = 512
MAX_PAX = 64 * 1024             # a PAX header holds a path and a link target: far below this

REGTYPE, DIRTYPE, SYMTYPE, PAXTYPE = b"0", b"5", b"2", b"x"


class BadArchive(InvalidArgument):
    """An archive entry is refused; the message names the entry and why."""


# -- writing -------------------------------------------------------------------

def _octal(n: int, width: int) -> bytes:
    return b"%0*o\0" % (width - 1, n)


def entry_header(name: bytes, typeflag: bytes, *, size: int = 0, mode: int = 0o644, link: bytes = b"",
            mtime: int = 0) -> bytes:
    """One ustar header, preceded by a PAX header when the name or link does not fit."""
    pax = b""
    records = []
    if len(name) > 100 or not name.isascii():
        records.append((b"path", name))
        name = b"pax-long-name"
    if len(link) > 100 or not link.isascii():
        records.append((b"linkpath", link))
        link = b"pax-long-link"
    if records:
        body = b"".join(_pax_record(k, v) for k, v in records)
        pax = _ustar(b"././@PaxHeader", PAXTYPE, len(body), 0o644, b"", 0) + _padded(body)
    return pax + _ustar(name, typeflag, size, mode, link, mtime)


def _pax_record(key: bytes, value: bytes) -> bytes:
    rest = b" " + key + b"=" + value + b"\n"
    n = len(rest) + 1
    while len(b"%d" % n) + len(rest) != n:
        n += 1
    return b"%d" % n + rest


def _ustar(name: bytes, typeflag: bytes, size: int, mode: int, link: bytes, mtime: int) -> bytes:
    h = bytearray(BLOCK)
    h[0:len(name)] = name
    h[100:108] = _octal(mode, 8)
    h[108:116] = _octal(0, 8)
    h[116:124] = _octal(0, 8)
    h[124:136] = _octal(size, 12)
    h[136:148] = _octal(mtime, 12)
    h[148:156] = b" " * 8
    h[156:157] = typeflag
    h[157:157 + len(link)] = link
    h[257:265] = b"ustar\x0000"
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def _padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % BLOCK)


# -- reading -------------------------------------------------------------------

def octal_field(field: bytes, what: str) -> int:
    if field[:1] and field[0] & 0x80:
        raise BadArchive(f"an archive entry's {what} is in base-256 (larger than tar's octal fields)")
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise BadArchive(f"an archive entry's {what} is not an octal number") from None


def parse_pax(body: bytes) -> dict[bytes, bytes]:
    out: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(body):
        sp = body.find(b" ", pos)
        if sp < 0 or not body[pos:sp].isdigit():
            raise BadArchive("an archive PAX header is malformed")
        n = int(body[pos:sp])
        rec = body[sp + 1:pos + n]
        if n <= 0 or pos + n > len(body) or not rec.endswith(b"\n") or b"=" not in rec:
            raise BadArchive("an archive PAX header is malformed")
        key, _, value = rec[:-1].partition(b"=")
        out[key] = value
        pos += n
    return out
