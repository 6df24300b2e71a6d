"""`Doc`: one manifest document being checked. Typed getters read a field
and record an error that names the field and says what to change (and
never quotes a value that could be a secret, see `text.show`); each
returns a default after recording an error so every problem is collected."""

from __future__ import annotations

import math
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

from .text import ENV_NAME_RE, ENV_NAME_WHAT, is_loopback, show

__all__ = ["Doc", "check_api_url"]

_MISSING = object()


class Doc:
    """One document being validated: typed field access that records errors."""

    def __init__(self, errors: list[str], where: str, data: Mapping[str, Any]) -> None:
        self.errors = errors
        self.where = where
        self.data = data
        self.secret_paths: set[str] = set()
        self.named = False

    def error(self, path: str, message: str) -> None:
        if path in self.secret_paths:
            return  # already refused as a secret; one message per field is enough
        self.errors.append(f"{self.where} {path}: {message}")

    def secret(self, path: str, kind: str) -> None:
        self.error(path, f"looks like a secret ({kind}). Never write a secret into a manifest: put it "
                   "in an environment variable and write that variable's NAME in tokenEnv / apiKeyEnv "
                   "(or an agent's env list) instead (R28)")
        self.secret_paths.add(path)

    def fields(self, obj: Mapping[str, Any], path: str, allowed: tuple[str, ...], required: tuple[str, ...] = (),
               hint: str = "") -> bool:
        """Refuse unknown keys and report missing required ones. False on missing."""
        ok = True
        for key in obj:
            if key not in allowed:
                shown = isinstance(key, str) and show(key) != "(value hidden)"
                where = f"{path}{'.' if path else ''}{key}" if shown else (path or "(document)")
                what = f"field {key!r}" if shown else "a field"
                self.error(where, f"unknown {what}; allowed here: {', '.join(allowed)}{hint}")
        for key in required:
            if key not in obj or obj[key] is None:
                self.error(f"{path}{'.' if path else ''}{key}", "required field is missing; add it")
                ok = False
        return ok

    # Typed getters. Each returns `default` (after recording an error) on a bad value.

    def text(self, obj: Mapping[str, Any], key: str, path: str, default: Any = None, *,
             pattern: re.Pattern[str] | None = None, what: str = "") -> Any:
        v = obj.get(key, _MISSING)
        if v is _MISSING or v is None:
            return default
        if not isinstance(v, str) or not v.strip():
            self.error(path, "must be a non-empty text value")
            return default
        if pattern is not None and not pattern.match(v):
            self.error(path, f"{show(v)} is not valid; {what}")
            return default
        return v

    def choice(self, obj: Mapping[str, Any], key: str, path: str, choices: tuple[str, ...],
               default: Any = None) -> Any:
        v = obj.get(key, _MISSING)
        if v is _MISSING or v is None:
            return default
        if v not in choices:
            self.error(path, f"{show(v)} is not one of: {', '.join(choices)}")
            return default
        return v

    def integer(self, obj: Mapping[str, Any], key: str, path: str, default: int, *, minimum: int = 0) -> int:
        v = obj.get(key, _MISSING)
        if v is _MISSING or v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            self.error(path, f"must be a whole number (>= {minimum})")
            return default
        if v < minimum:
            self.error(path, f"must be at least {minimum}")
            return default
        return v

    def number(self, obj: Mapping[str, Any], key: str, path: str, default: float, *,
               positive: bool = True) -> float:
        v = obj.get(key, _MISSING)
        if v is _MISSING or v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            self.error(path, "must be a number")
            return default
        if positive and v <= 0:
            self.error(path, "must be greater than 0")
            return default
        return float(v)

    def str_list(self, obj: Mapping[str, Any], key: str, path: str, *,
                 pattern: re.Pattern[str] | None = None, what: str = "",
                 choices: tuple[str, ...] | None = None, nonempty: bool = False,
                 unique: bool = True) -> tuple[str, ...]:
        """A list of non-empty strings; a set unless `unique=False` (an argv)."""
        v = obj.get(key, _MISSING)
        if v is _MISSING or v is None:
            if nonempty:
                self.error(path, "required list is missing; add it")
            return ()
        if not isinstance(v, list):
            self.error(path, "must be a list, e.g. [a, b]")
            return ()
        if nonempty and not v:
            self.error(path, "must not be empty")
        out: list[str] = []
        for i, item in enumerate(v):
            p = f"{path}[{i}]"
            if not isinstance(item, str) or not item:
                self.error(p, "must be a non-empty text value")
                continue
            if pattern is not None and not pattern.match(item):
                self.error(p, f"{show(item)} is not valid; {what}")
                continue
            if choices is not None and item not in choices:
                self.error(p, f"{show(item)} is not one of: {', '.join(choices)}")
                continue
            if unique and item in out:
                self.error(p, f"{show(item)} is listed twice; remove the duplicate")
                continue
            out.append(item)
        return tuple(out)

    def env_name(self, obj: Mapping[str, Any], key: str, path: str) -> str | None:
        name: str | None = self.text(obj, key, path, None, pattern=ENV_NAME_RE,
                         what=ENV_NAME_WHAT)
        return name

    def mapping(self, obj: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any] | None:
        v = obj.get(key, _MISSING)
        if v is _MISSING or v is None:
            return None
        if not isinstance(v, dict):
            self.error(path, "must be a mapping (key: value pairs)")
            return None
        return v


def check_api_url(doc: Doc, value: str, path: str) -> None:
    """An API base URL: https://, or http:// to this machine only; never with user@."""
    parts = urllib.parse.urlsplit(value)
    if parts.username or parts.password or "@" in parts.netloc:
        doc.error(path, "must not hold credentials; remove user@/user:password@")
    elif parts.scheme == "https" and parts.hostname:
        return
    elif parts.scheme == "http" and is_loopback(parts.hostname):
        return  # a local test or inference server on this machine
    else:
        doc.error(path, "must be an https:// URL (http:// is accepted only for localhost)")

