"""Redaction of secrets from text: registered values, secret-looking
patterns and URL userinfo (R27, R30).

One `Redactor` per process, built in the composition root and handed to the
logging filter, the gRPC error interceptor and whatever else emits text.
"""

from __future__ import annotations

import base64
import logging
import math
import re
import threading
import urllib.parse
from collections.abc import Iterable

MASK = "[redacted]"
_SCAN_VALUES = 24  # registered forms checked with substring scans before the regex runs

# Secret-looking shapes. Used both to redact text and (by the manifest
# validator) to refuse values.
SECRET_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("GitHub token", re.compile(r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{16,}")),
    ("GitHub fine-grained token", re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}")),
    ("API key (sk-)", re.compile(r"\bsk-[A-Za-z0-9_\-]{16,}")),
    ("Slack token", re.compile(r"\bxox[abposr]-[A-Za-z0-9\-]{10,}")),
    ("AWS access key", re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b")),
    ("JWT", re.compile(r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}")),
    ("bearer credential", re.compile(r"(?i)(?<=\bbearer )[A-Za-z0-9._~+/=\-]{12,}")),
]

# Literal text that every match of a pattern contains: a pattern only runs on
# text holding one of its literals (same result, a fraction of the cost on
# ordinary text such as command output and events). `_GATES` are shorter
# literals that each of those contains: one scan of the text for the gate
# stands for the scans of all the literals behind it.
_LITERALS: dict[str, tuple[str, ...]] = {
    "GitHub token": ("ghp_", "gho_", "ghu_", "ghs_", "ghr_"),
    "GitHub fine-grained token": ("github_pat_",),
    "API key (sk-)": ("sk-",),
    "Slack token": ("xox",),
    "AWS access key": ("AKIA", "ASIA"),
    "JWT": ("eyJ",),
}
_GATES: dict[str, str] = {
    "GitHub token": "gh",
    "AWS access key": "IA",
}
_LOWER_LITERALS: dict[str, str] = {"bearer credential": "bearer"}
# The shortest run of token characters (`_TOKEN_CHARS`) that every match of a
# pattern contains, e.g. "ghp_" + 16 letters or digits for a GitHub token:
# text without such a run cannot match, whatever its literals.
_MIN_RUNS: dict[str, int] = {
    "GitHub token": 20,
    "GitHub fine-grained token": 31,
    "API key (sk-)": 19,
    "Slack token": 15,
    "AWS access key": 20,
    "JWT": 11,
}

_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)([^/@\s:]*)(?::[^/@\s]*)?@")
_TOKEN_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=_-"
_TOKENISH = re.compile(r"[A-Za-z0-9+/=_\-]{32,}")
# `_TOKENISH.search(text) is not None` without the regex engine's cost per
# character: the text's UTF-8 bytes mapped to b"a" (a token character) or
# b" " (anything else, including every byte of a non-ASCII character: the
# class is ASCII only), then one substring search for 32 token characters.
# The same map rules out the patterns whose matches hold long runs.
_TOKEN_TABLE = bytes(0x61 if chr(b) in _TOKEN_CHARS else 0x20 for b in range(256))


def _token_map(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass").translate(_TOKEN_TABLE)


def has_token_run(text: str, length: int = 32) -> bool:
    """True when `text` holds a run of `length` or more token characters."""
    return b"a" * length in _token_map(text)


# (pattern, its shortest token run, gate, literals, lower-case literal): the
# checks `Redactor.redact` makes, cheapest first, before it runs a pattern.
_PLAN = [(pat, _MIN_RUNS.get(name, 0), _GATES.get(name), _LITERALS.get(name), _LOWER_LITERALS.get(name))
         for name, pat in SECRET_PATTERNS]
_RUN_STEPS = [(n, b"a" * n) for n in sorted({*_MIN_RUNS.values(), 32})]


def _longest_run_step(text: str) -> int:
    """The largest of `_RUN_STEPS` that `text` holds a token run of (0 if none)."""
    runs = _token_map(text)
    found = 0
    for n, needle in _RUN_STEPS:
        if needle not in runs:
            break
        found = n
    return found


def shannon_entropy(s: str) -> float:
    if not s:
        return 0.0
    counts: dict[str, int] = {}
    for ch in s:
        counts[ch] = counts.get(ch, 0) + 1
    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in counts.values())


# A path segment made of words: "src", "ShoppingCartButton", "my-module_2".
# Possessive quantifiers: the runs cannot overlap, so this is the same language
# without catastrophic backtracking (the plain form took minutes on a
# 100-character run of digits and letters: a ReDoS through command output).
_WORDY_SEGMENT = re.compile(r"(?:[A-Z]?[a-z]++|[0-9]++|[_\-]++)++")


def _looks_like_path(s: str) -> bool:
    """`src/components/ShoppingCartCheckoutButton/index` is a path, not a key.

    Every '/'-separated segment must read as words (lower-case runs, Camel
    case, digits, '-' and '_'): random base64 almost never does, since any
    segment with two capitals in a row or a capital after a digit fails.
    """
    parts = s.strip("/").split("/")
    return len(parts) >= 2 and all(p and _WORDY_SEGMENT.fullmatch(p) for p in parts)


def looks_high_entropy(s: str) -> bool:
    """A long run of token characters with the entropy of random bytes.

    Hex digests (git SHAs) are common and harmless in our data, so pure hex
    strings of 40 or 64 characters are not counted.
    """
    if len(s) < 32 or not _TOKENISH.fullmatch(s):
        return False
    if re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", s):
        return False
    if _looks_like_path(s):
        return False
    classes = sum(bool(re.search(p, s)) for p in (r"[a-z]", r"[A-Z]", r"[0-9]"))
    return classes >= 2 and shannon_entropy(s) >= 4.0


def secret_kind(value: str) -> str | None:
    """Name the kind of secret `value` looks like, or None."""
    for name, pat in SECRET_PATTERNS:
        if pat.search(value):
            return name
    if _URL_USERINFO.search(value) and urllib.parse.urlsplit(value.strip()).password:
        return "URL with a password"
    for run in _TOKENISH.findall(value):
        if looks_high_entropy(run):
            return "long high-entropy string"
    return None


class Redactor:
    """Replaces registered secret values and secret-looking strings with a mask."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._values: list[str] = []
        # (values, their regex), replaced as a whole so a reader on another
        # thread never sees a half-updated pair.
        self._compiled: tuple[tuple[str, ...], re.Pattern[str] | None] = ((), None)
        for s in secrets:
            self.register(s)

    def register(self, value: str | bytes | None) -> None:
        """Register a secret value (and its common encodings)."""
        if not value:
            return
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if len(value) < 4:
            return  # too short to redact without destroying ordinary text
        forms = {value, urllib.parse.quote(value, safe=""), base64.b64encode(value.encode()).decode()}
        with self._lock:
            for f in forms:
                if f not in self._values:
                    self._values.append(f)
            self._values.sort(key=len, reverse=True)
            values = tuple(self._values)
            self._compiled = (values, re.compile("|".join(re.escape(v) for v in values)))

    @property
    def count(self) -> int:
        return len(self._values)

    def holds(self, text: str) -> bool:
        """Does `text` contain a registered secret value (in one of its registered forms)?"""
        values, _ = self._compiled
        return any(v in text for v in values)

    def redact(self, text: str) -> str:
        if not text:
            return text
        values, rx = self._compiled
        # A few values: plain substring scans are far cheaper than the
        # alternation; the regex still does the replacing.
        if rx is not None and (len(values) > _SCAN_VALUES or any(v in text for v in values)):
            text = rx.sub(MASK, text)
        if "@" in text and "://" in text:
            text = _URL_USERINFO.sub(lambda m: m.group(1) + MASK + "@", text)
        longest = -1   # the text's longest token run step, found when first needed and after any change
        for pat, run, gate, literals, lower in _PLAN:
            if run:
                if longest < 0:
                    longest = _longest_run_step(text)
                if run > longest:
                    continue
            if gate is not None and gate not in text:
                continue
            if literals is not None and not any(lit in text for lit in literals):
                continue
            if lower is not None and lower not in text.lower():
                continue
            new = pat.sub(MASK, text)
            if new != text:
                text, longest = new, -1
        if longest < 0:
            longest = _longest_run_step(text)
        if longest < 32:  # the common case: no long token-like run at all
            return text
        return _TOKENISH.sub(lambda m: MASK if looks_high_entropy(m.group(0)) else m.group(0), text)

    def redact_obj(self, obj: object) -> object:
        """Redact every string inside a JSON-like structure."""
        if isinstance(obj, str):
            return self.redact(obj)
        if isinstance(obj, dict):
            return {self.redact(str(k)): self.redact_obj(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.redact_obj(v) for v in obj]
        return obj


class RedactingFilter(logging.Filter):
    """Logging filter that renders each record's message and redacts it."""

    def __init__(self, redactor: Redactor) -> None:
        super().__init__()
        self.redactor = redactor

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string must not lose the record
            msg = str(record.msg)
        record.msg = self.redactor.redact(msg)
        record.args = None
        if record.exc_info:
            import traceback

            record.exc_text = self.redactor.redact("".join(traceback.format_exception(*record.exc_info)))
            record.exc_info = None
        if record.stack_info:
            record.stack_info = self.redactor.redact(record.stack_info)
        return True
