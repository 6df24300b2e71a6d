"""Validation of JSON-RPC params: every method declares its fields; unknown
fields, wrong types and out-of-range values are refused with a message that
names the field."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.common.errors import InvalidArgument


@dataclass(frozen=True)
class Field:
    kind: str                      # str | int | bool | strmap | strlist
    required: bool = False
    default: Any = None
    max_len: int = 0               # str / list / map size
    min_len: int = 0
    pattern: re.Pattern[str] | None = None
    pattern_hint: str = ""
    choices: frozenset[str] | None = None
    minimum: int | None = None
    maximum: int | None = None


def _str(name: str, v: Any, f: Field) -> str:
    if not isinstance(v, str):
        raise InvalidArgument(f"'{name}' must be a string")
    if len(v) < f.min_len:
        raise InvalidArgument(f"'{name}' must not be empty" if f.min_len == 1
                              else f"'{name}' must be at least {f.min_len} characters")
    if f.max_len and len(v) > f.max_len:
        raise InvalidArgument(f"'{name}' must be at most {f.max_len} characters")
    if f.pattern is not None and v and not f.pattern.fullmatch(v):
        raise InvalidArgument(f"'{name}' {f.pattern_hint or 'has an invalid format'}")
    if f.choices is not None and v not in f.choices:
        raise InvalidArgument(f"'{name}' must be one of: {', '.join(sorted(f.choices))}")
    return v


def _one(name: str, v: Any, f: Field) -> Any:
    if f.kind == "str":
        return _str(name, v, f)
    if f.kind == "int":
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidArgument(f"'{name}' must be an integer")
        if f.minimum is not None and v < f.minimum:
            raise InvalidArgument(f"'{name}' must be at least {f.minimum}")
        if f.maximum is not None and v > f.maximum:
            raise InvalidArgument(f"'{name}' must be at most {f.maximum}")
        return v
    if f.kind == "bool":
        if not isinstance(v, bool):
            raise InvalidArgument(f"'{name}' must be true or false")
        return v
    if f.kind == "strmap":
        if not isinstance(v, Mapping):
            raise InvalidArgument(f"'{name}' must be an object of strings")
        if f.max_len and len(v) > f.max_len:
            raise InvalidArgument(f"'{name}' may hold at most {f.max_len} entries")
        out = {}
        for k, val in v.items():
            if not isinstance(k, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}", k):
                raise InvalidArgument(f"keys of '{name}' must be names of letters, digits, '_', '.', '-'")
            if not isinstance(val, str) or len(val) > 8192:
                raise InvalidArgument(f"'{name}.{k}' must be a string of at most 8192 characters")
            out[k] = val
        return out
    if f.kind == "strlist":
        if not isinstance(v, list):
            raise InvalidArgument(f"'{name}' must be a list of strings")
        if f.max_len and len(v) > f.max_len:
            raise InvalidArgument(f"'{name}' may hold at most {f.max_len} entries")
        return [_str(f"{name}[{i}]", item, Field("str", choices=f.choices, max_len=200))
                for i, item in enumerate(v)]
    raise AssertionError(f"unknown field kind {f.kind}")


def validate(params: Any, fields: Mapping[str, Field]) -> dict[str, Any]:
    """Checked params with defaults filled in."""
    if params is None:
        params = {}
    if isinstance(params, list):
        raise InvalidArgument("params must be an object with named fields, not a list")
    if not isinstance(params, dict):
        raise InvalidArgument("params must be an object")
    unknown = sorted(set(params) - set(fields))
    if unknown:
        allowed = ", ".join(sorted(fields)) or "none"
        raise InvalidArgument(f"unknown field(s) {', '.join(repr(u) for u in unknown)}; allowed: {allowed}")
    out: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in params or params[name] is None:
            if f.required:
                raise InvalidArgument(f"'{name}' is required")
            out[name] = f.default
            continue
        out[name] = _one(name, params[name], f)
    return out
