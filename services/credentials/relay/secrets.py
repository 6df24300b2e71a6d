"""No secret of the broker goes back through the relay (R32): an upstream that
echoes a key (in a header, an error, a streamed answer) has it replaced with
a mask before the bytes reach the sandbox.

`SecretForms` are every secret the credential broker holds (all model keys
and forge tokens, not only the key of the request's Model) in the spellings
an answer may carry: as is, percent-encoded, base64 (standard and URL-safe)
and JSON-escaped. `StreamRedactor` masks them in a byte stream cut anywhere:
it holds back only the end of a chunk that could be the start of a secret
(at most the longest form less one byte), so an answer that carries no
secret's beginning at a chunk's end streams with no delay at all, and the
masked stream is the same wherever the chunks were cut.
"""

from __future__ import annotations

import base64
import json
import re
import urllib.parse
from collections.abc import Iterable

MASK = b"[redacted]"
MIN_SECRET = 8        # shorter values would mask ordinary text (no key or token is this short)


def _spellings(value: str) -> set[str]:
    raw = value.encode()
    out = {value, urllib.parse.quote(value, safe=""), base64.b64encode(raw).decode(),
           base64.urlsafe_b64encode(raw).decode(), json.dumps(value)[1:-1]}
    out |= {f.replace("/", "\\/") for f in out}         # JSON may escape '/'
    out |= {f.rstrip("=") for f in out}                 # base64 without padding
    return {f for f in out if len(f) >= MIN_SECRET}


class SecretForms:
    """The byte forms of a set of secrets, with what streaming needs."""

    def __init__(self, secrets: Iterable[str]) -> None:
        forms = {f.encode() for s in secrets if s and len(s) >= MIN_SECRET for f in _spellings(s)}
        self.forms = tuple(sorted(forms, key=len, reverse=True))
        self.longest = len(self.forms[0]) if self.forms else 0
        self._rx = re.compile(b"|".join(re.escape(f) for f in self.forms)) if self.forms else None
        # Every proper prefix (the start of a secret cut at a chunk's end) and their first bytes.
        self._prefixes = frozenset(f[:k] for f in self.forms for k in range(1, len(f)))
        self._first = re.compile(b"[" + b"".join(re.escape(bytes([b])) for b in sorted({f[0] for f in self.forms}))
                                 + b"]") if self.forms else None
        self._bytes = frozenset(b for f in self.forms for b in f)
        # Every form begins with one of these: text holding none of them holds no form (a fast scan).
        self._anchors = tuple({f[:MIN_SECRET] for f in self.forms})
        self._lower = tuple(f.decode().lower() for f in self.forms)

    def __bool__(self) -> bool:
        return bool(self.forms)

    def redact(self, data: bytes) -> tuple[bytes, int]:
        """(data with every whole form masked, how many were)."""
        if self._rx is None or not any(a in data for a in self._anchors):
            return data, 0
        out, n = self._rx.subn(MASK, data)
        return out, n

    def cut(self, data: bytes) -> tuple[bytes, bytes, int]:
        """(what may be sent, masked; the rest to hold until more comes; how many
        were masked). The rest is the end of `data` that could begin a form
        (a whole form that a longer one extends, too), moved back to the start
        of a form it would cut in two."""
        cut = len(data) - self.held(data)
        pieces: list[bytes] = []
        pos = n = 0
        if self._rx is not None and any(a in data for a in self._anchors):
            for m in self._rx.finditer(data):
                if m.end() > cut:
                    cut = min(cut, m.start())
                    break
                pieces += (data[pos:m.start()], MASK)
                pos, n = m.end(), n + 1
        if not pieces:
            return data[:cut], data[cut:], 0
        pieces.append(data[pos:cut])
        return b"".join(pieces), data[cut:], n

    def held(self, data: bytes) -> int:
        """How many bytes at the end of `data` could be the start of a secret."""
        n = len(data)
        if not n or self._first is None or data[-1] not in self._bytes:   # e.g. an SSE event's or JSON's end
            return 0
        for m in self._first.finditer(data, max(0, n - self.longest + 1)):
            if data[m.start():] in self._prefixes:
                return n - m.start()
        return 0

    def in_name(self, name: str) -> bool:
        """A header name that spells a secret (names are case-insensitive)."""
        low = name.lower()
        return any(f in low for f in self._lower)

    def redact_text(self, text: str) -> tuple[str, int]:
        data, n = self.redact(text.encode("utf-8", "surrogateescape"))
        return (data.decode("utf-8", "surrogateescape"), n) if n else (text, 0)


class StreamRedactor:
    """`feed` each chunk, send what it returns, then send `finish()`."""

    def __init__(self, forms: SecretForms) -> None:
        self.forms = forms
        self.masked = 0
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes:
        if not self.forms:
            return chunk
        data = self._tail + chunk if self._tail else chunk
        out, self._tail, n = self.forms.cut(data)
        self.masked += n
        return out

    def finish(self) -> bytes:
        """What was held back (only the start of a secret that never came whole), masked."""
        out, n = self.forms.redact(self._tail)
        self._tail = b""
        self.masked += n
        return out
