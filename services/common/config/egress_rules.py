"""Egress rules (R44): which methods and paths a sandbox may use on a host.

A Workspace's `sandbox.egress` lists host names; an entry may instead be a
mapping that binds the host to methods and paths, or to a named preset:

    egress:
      - pypi.org                                         # the whole host (CONNECT pass-through)
      - {host: registry.npmjs.org, preset: read-only}    # GET and HEAD only
      - {host: github.com, preset: git-fetch}            # clone and fetch, never push
      - {host: api.example.com, methods: [GET], paths: ["/v1/items/**"]}

A host with rules is judged request by request on the decrypted traffic
(services/sandbox/egress/judge.py runs in the ticket's proxy); a request no
rule allows is refused with a 403 that names the rules. Several entries for
one host add up (a request passes when any of them allows it).

Path patterns are absolute and in decoded form: `*` is any characters within
one segment, a `**` segment any number of segments (none too), and a
`?name=value&...` part requires each named query parameter exactly once
with that value. The proxy matches them against the request's path with
escapes decoded and `//` collapsed; a path with dot segments or an
ambiguous escape is refused outright (services/sandbox/egress/judge.py).

This module is the config side, shared by `afe check` (the manifest), the
scheduler (the SandboxSpec) and the sandbox broker (which checks again what
it is sent).
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from services.common.secrecy.redact import secret_kind

_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
EGRESS_RE = re.compile(rf"^\.?(?:{_LABEL}\.)*{_LABEL}$")     # as schema/text.py's (no import: it loads the schema)
METHOD_RE = re.compile(r"^[A-Z][A-Z0-9-]{0,31}$")
NEVER_METHODS = ("CONNECT", "TRACE")        # CONNECT inside a judged tunnel is refused anyway
PATH_CASES = ("sensitive", "insensitive")
PATTERN_MAX = 512
RULES_MAX = 64                              # rule entries of one Workspace
_SEGMENT_CHARS = re.compile(r"^[A-Za-z0-9._~!$&'()*+,;=:@%-]*$")
ENTRY_FIELDS = ("host", "preset", "methods", "paths", "pathCase")


@dataclass(frozen=True)
class EgressRule:
    """One allowance on a host: `methods` (empty: any) on `paths` (empty:
    any). `name` is what a refusal and the run record call it: the preset,
    or where it was written (`sandbox.egress[2]`)."""
    host: str
    methods: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()
    name: str = ""
    ignore_case: bool = False

    def summary(self) -> str:
        preset = PRESETS.get(self.name)
        if preset is not None:
            return preset.summary
        methods = ", ".join(self.methods) if self.methods else "any method"
        paths = ", ".join(self.paths) if self.paths else "any path"
        case = " (paths matched ignoring case)" if self.ignore_case else ""
        return f"{methods} on {paths}{case}"


@dataclass(frozen=True)
class Preset:
    name: str
    clauses: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]     # (methods, paths)
    summary: str


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("read-only", ((("GET", "HEAD"), ()),),
           "GET and HEAD on any path: downloads (npm install, pip download, reading an API); no upload, "
           "publish or other write"),
    Preset("git-fetch", ((("GET",), ("/**/info/refs?service=git-upload-pack",)),
                         (("POST",), ("/**/git-upload-pack",))),
           "git clone and fetch over smart HTTP (GET .../info/refs?service=git-upload-pack, POST "
           ".../git-upload-pack); git push (git-receive-pack) and everything else is refused"),
)}


def show(value: object) -> str:
    """A user-written value quoted in an error, unless it could be a secret."""
    text = str(value)
    return "(value hidden)" if len(text) > 64 or secret_kind(text) is not None else repr(text)


def preset_rules(host: str, preset: str) -> tuple[EgressRule, ...]:
    p = PRESETS[preset]
    return tuple(EgressRule(host=host, methods=m, paths=ps, name=p.name) for m, ps in p.clauses)


def path_pattern_problem(pattern: str) -> str | None:
    """Why a path pattern is not valid (None when it is)."""
    if not isinstance(pattern, str) or not pattern:
        return "must be a non-empty path such as /simple/**"
    if len(pattern) > PATTERN_MAX:
        return f"is longer than {PATTERN_MAX} characters"
    path, _, query = pattern.partition("?")
    if not path.startswith("/"):
        return "must start with / (a path on the host, e.g. /v1/items/**)"
    if "%" in path:
        return "must be written decoded (no %-escapes): the proxy decodes the request's path before matching"
    segments = path.split("/")[1:]
    if any(s == "" for s in segments[:-1]):
        return "has an empty segment (//); write each segment once"
    for s in segments:
        if s in (".", ".."):
            return "has a dot segment (. or ..); write the path it means"
        if "**" in s and s != "**":
            return "uses ** inside a segment; ** stands alone (/a/**/b), * matches within a segment"
        if not _SEGMENT_CHARS.match(s):
            return f"segment {show(s)} has characters a path cannot hold unescaped (spaces, ?, #, \\ ...)"
    if query:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        if not pairs or "*" in query or any(not k for k, _ in pairs):
            return "has a query part that is not name=value pairs (e.g. ?service=git-upload-pack)"
    return None


def method_problem(method: Any) -> str | None:
    if not isinstance(method, str) or not METHOD_RE.match(method):
        return f"{show(method)} is not an HTTP method; write it in capitals (GET, HEAD, POST, ...)"
    if method in NEVER_METHODS:
        return f"{method} cannot be allowed: the proxy does not judge what it carries"
    return None


def parse_entry(raw: Mapping[str, Any], where: str) -> tuple[str | None, tuple[EgressRule, ...], list[tuple[str, str]]]:
    """One mapping of `sandbox.egress` (at `where`, e.g. `sandbox.egress[2]`):
    (host, its rules, problems as (field path, message))."""
    problems: list[tuple[str, str]] = []
    for key in raw:
        if key not in ENTRY_FIELDS:
            problems.append((f"{where}.{key}" if isinstance(key, str) else where,
                             f"unknown field; allowed here: {', '.join(ENTRY_FIELDS)}"))
    host = raw.get("host")
    if not isinstance(host, str) or not EGRESS_RE.match(host):
        problems.append((f"{where}.host", ("write a lower-case host name such as registry.npmjs.org, or "
                         ".example.com for a domain and its subdomains (no scheme, port, path or IP address)")))
        host = None
    elif host.lstrip(".").rsplit(".", 1)[-1].isdigit():
        problems.append((f"{where}.host", f"{show(host)} is an IP address; name a host instead"))
        host = None
    preset = raw.get("preset")
    has_own = "methods" in raw or "paths" in raw
    case = raw.get("pathCase", "sensitive")
    if case not in PATH_CASES:
        problems.append((f"{where}.pathCase", ("is sensitive (the default) or insensitive (for a host that "
                         "treats paths case-insensitively)")))
        case = "sensitive"
    if preset is not None:
        if preset not in PRESETS:
            problems.append((f"{where}.preset", f"{show(preset)} is not a preset; choose one of: "
                             + "; ".join(f"{p.name} ({p.summary})" for p in PRESETS.values())))
        if has_own:
            problems.append((where, ("has both preset and methods/paths; write them as two entries for the "
                             "same host (a request passes when either allows it)")))
        if "pathCase" in raw:
            problems.append((f"{where}.pathCase", "applies to your own paths: remove it from a preset entry"))
        if problems or host is None:
            return host, (), problems
        return host, preset_rules(host, str(preset)), problems
    if not has_own:
        problems.append((where, ("needs methods, paths or a preset; for the whole host write the name alone "
                         f"(- {host or 'host.example'})")))
        return host, (), problems
    methods = _list(raw, "methods", where, problems)
    for i, m in enumerate(methods):
        if (why := method_problem(m)) is not None:
            problems.append((f"{where}.methods[{i}]", why))
    paths = _list(raw, "paths", where, problems)
    for i, p in enumerate(paths):
        if (why := path_pattern_problem(p)) is not None:
            problems.append((f"{where}.paths[{i}]", f"{show(p)} {why}"))
    if "methods" in raw and not methods:
        problems.append((f"{where}.methods", ("is empty, which would allow nothing; list the methods, or leave "
                         "the field out for any method")))
    if "paths" in raw and not paths:
        problems.append((f"{where}.paths", ("is empty, which would allow nothing; list the paths, or leave "
                         "the field out for any path")))
    if problems or host is None:
        return host, (), problems
    rule = EgressRule(host=host, methods=tuple(dict.fromkeys(methods)), paths=tuple(dict.fromkeys(paths)),
                      name=where, ignore_case=case == "insensitive")
    return host, (rule,), problems


def _list(raw: Mapping[str, Any], key: str, where: str, problems: list[tuple[str, str]]) -> list[str]:
    v = raw.get(key)
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        problems.append((f"{where}.{key}", "must be a list of text values, e.g. [GET, HEAD]"))
        return []
    return list(v)


def covers(entry: str, host: str) -> bool:
    """Does egress entry `entry` (exact or .suffix) allow host name `host` (exact or .suffix)?"""
    bare = host.lstrip(".")
    return entry == host or (entry.startswith(".") and (bare == entry[1:] or bare.endswith(entry)))


def overlap_problems(plain: Iterable[str], ruled: Iterable[str]) -> list[str]:
    """A host listed without rules and one with rules must not cover each other:
    the proxy could not say which applies. One message per pair."""
    out = []
    plain, ruled = list(dict.fromkeys(plain)), list(dict.fromkeys(ruled))
    for p in plain:
        for r in ruled:
            if p == r:
                out.append(f"{p} is listed both alone (every request allowed) and with rules; keep one")
            elif covers(p, r):
                out.append(f"{p} (no rules) covers {r}, which has rules; give {p} rules too or list the "
                           "names it should allow one by one")
            elif covers(r, p):
                out.append(f"{r} has rules that cover {p}, listed alone; give {p} rules too or remove it")
    return out


def check_rules(rules: Iterable[EgressRule], egress: Iterable[str]) -> tuple[EgressRule, ...]:
    """What the sandbox broker accepts from a caller: every rule on a host of
    `egress` and not covering or covered by a host without rules, methods and
    patterns valid. Raises ValueError naming the problem."""
    allowed = list(egress)
    rules = tuple(rules)
    if len(rules) > RULES_MAX * 4:
        raise ValueError(f"too many egress rules ({len(rules)})")
    ruled = []
    for r in rules:
        if not EGRESS_RE.match(r.host) or r.host not in allowed:
            raise ValueError(f"egress rule host {r.host[:253]!r} is not in the egress allowlist")
        for m in r.methods:
            if (why := method_problem(m)) is not None:
                raise ValueError(f"egress rule of {r.host}: {why}")
        for p in r.paths:
            if (why := path_pattern_problem(p)) is not None:
                raise ValueError(f"egress rule of {r.host}: path pattern {p[:100]!r} {why}")
        if not r.name or len(r.name) > 64 or not re.fullmatch(r"[A-Za-z0-9._\[\]-]+", r.name):
            raise ValueError(f"egress rule of {r.host}: name {r.name[:64]!r} is not valid")
        ruled.append(r.host)
    problems = overlap_problems([h for h in allowed if h not in ruled], ruled)
    if problems:
        raise ValueError(problems[0])
    return rules


def describe(rules: Iterable[EgressRule]) -> list[str]:
    """One line per host and rule, for `afe check` and the docs: what it allows."""
    seen: set[tuple[str, str]] = set()
    out = []
    for r in rules:
        if (r.host, r.name) in seen:
            continue
        seen.add((r.host, r.name))
        label = f"preset {r.name}" if r.name in PRESETS else r.name
        out.append(f"{r.host}: {label}: {r.summary()}")
    return out
