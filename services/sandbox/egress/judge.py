"""The egress judge (R44): decides each decrypted request to a host that has
egress rules, inside the ticket's proxy container.

Squid terminates TLS for such hosts (ssl-bump, docs/adr/0007) and asks this
program, as an external ACL helper, about every request: its method, host,
request target (path and query, as the sandbox sent them) and Upgrade
header. The answer is `OK` (a rule allows it) or `ERR` with a message the
403 page shows, and an annotation squid writes into its access log (the
broker reads it back for the event and the run record).

The path is judged in a normal form: percent-escapes decoded once, empty
segments (`//`) dropped, and, with `pathCase: insensitive`, lower case. A
path this form cannot make unambiguous is refused, because servers read it
in different ways: dot segments (`.`, `..`, also encoded or with `;`
parameters), an encoded escape
(`%252e`), a backslash, NUL or control character, a fragment, or anything
that is not an origin-form path. A protocol upgrade (WebSocket, h2c) is
refused: what follows it is not HTTP/1.1 requests the proxy could judge.

Standard library only: the sandbox broker ships this file's source into the
proxy (the proxy image has python3), where it runs as

    python3 -I judge.py rules.json

with `rules.json` written by the broker (`rules_json`).
"""

from __future__ import annotations

import json
import re
import sys
import urllib.parse
from dataclasses import dataclass

PATH_MAX = 8192          # longer request targets are refused
SEGMENTS_MAX = 256
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,32}$")      # an HTTP method (RFC 9110 token)
_ESCAPE = re.compile(r"%[0-9a-fA-F]{2}")
_BAD_ESCAPE = re.compile(r"%(?![0-9a-fA-F]{2})")


@dataclass(frozen=True)
class Clause:
    """One allowance of a host: methods (empty: any) on paths (empty: any)."""
    name: str
    methods: tuple[str, ...]
    paths: tuple[str, ...]
    ignore_case: bool = False
    summary: str = ""


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    code: str           # "allow" | why it was refused (method, path, query, upgrade, unclear-path, ...)
    rules: str          # the names of the rules that decided, comma-separated
    message: str = ""   # for a refusal: what the 403 page says


def decode_path(raw: str) -> tuple[list[str], bool] | str:
    """The segments of a raw origin-form path (no query), decoded, and
    whether it ended with a slash; or why it cannot be judged."""
    if not raw.startswith("/"):
        return "the request target is not a path"
    if len(raw) > PATH_MAX:
        return "the path is too long"
    if "#" in raw:
        return "the path has a fragment"
    if _BAD_ESCAPE.search(raw):
        return "the path has a malformed percent-escape"
    try:
        text = urllib.parse.unquote(raw, encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        return "the path is not UTF-8 once decoded"
    if _ESCAPE.search(text):
        return "the path is encoded twice (an escape decodes to another escape)"
    if "\\" in text:
        return "the path has a backslash"
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in text):
        return "the path has a control character"
    segments = [s for s in text.split("/") if s]
    # `..;x` is `..` to servers that drop path parameters (Tomcat, Spring)
    if any(s.split(";", 1)[0] in (".", "..") for s in segments):
        return "the path has dot segments (. or ..)"
    if len(segments) > SEGMENTS_MAX:
        return "the path has too many segments"
    return segments, text.endswith("/")


def normal_path(raw: str, ignore_case: bool = False) -> str | None:
    """The normal form of a raw path ('/' + decoded segments), None when it cannot be judged."""
    got = decode_path(raw)
    if isinstance(got, str):
        return None
    segments, slash = got
    path = "/" + "/".join(segments) + ("/" if slash and segments else "")
    return path.lower() if ignore_case else path


def _segment_matches(pattern: str, segment: str) -> bool:
    if "*" not in pattern:
        return pattern == segment
    rx = ".*".join(re.escape(part) for part in pattern.split("*"))
    return re.fullmatch(rx, segment, re.DOTALL) is not None


def _segments_match(pattern: list[str], segments: list[str]) -> bool:
    """`**` is any number of segments (none too), `*` any characters within one."""
    # Iterative over (pattern index, segment index) states: at most len(p) * len(s) of them.
    states = {(0, 0)}
    seen: set[tuple[int, int]] = set()
    while states:
        p, s = states.pop()
        if (p, s) in seen:
            continue
        seen.add((p, s))
        if p == len(pattern):
            if s == len(segments):
                return True
            continue
        if pattern[p] == "**":
            states.add((p + 1, s))
            if s < len(segments):
                states.add((p, s + 1))
        elif s < len(segments) and _segment_matches(pattern[p], segments[s]):
            states.add((p + 1, s + 1))
    return False


def _query_pairs(query: str) -> list[tuple[str, str]] | None:
    try:
        return urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=False,
                                      encoding="utf-8", errors="strict")
    except (UnicodeDecodeError, ValueError):
        return None


def path_matches(pattern: str, segments: list[str], query: str, ignore_case: bool = False) -> bool:
    """Does a path pattern (`/a/*/b/**`, optionally `?name=value&...`: each
    named parameter present exactly once with that value) match?"""
    ppath, _, pquery = pattern.partition("?")
    want = [s for s in ppath.split("/") if s]
    have = segments
    if ignore_case:
        want = [s.lower() for s in want]
        have = [s.lower() for s in segments]
    if not _segments_match(want, have):
        return False
    if not pquery:
        return True
    pairs = _query_pairs(query)
    if pairs is None:
        return False
    for name, value in urllib.parse.parse_qsl(pquery, keep_blank_values=True):
        values = [v for k, v in pairs if k == name]
        if values != [value]:
            return False
    return True


def _describe(clauses: list[Clause]) -> str:
    """Each rule once (a preset's clauses share its name and summary)."""
    first = {c.name: c for c in reversed(clauses)}
    return "; ".join(f"{c.name}: {c.summary}" if c.summary else c.name
                     for c in (first[n] for n in dict.fromkeys(c.name for c in clauses)))


def judge(clauses: list[Clause], method: str, target: str, upgrade: str = "") -> Verdict:
    """The verdict on one request to a host whose rules are `clauses`."""
    names = ",".join(dict.fromkeys(c.name for c in clauses))
    shown = _shown(method, target)

    def refuse(code: str, why: str) -> Verdict:
        rules = _describe(clauses) or "none"
        return Verdict(False, code, names, f"{shown} refused: {why} (egress rules of this host: {rules})")

    if not clauses:
        return refuse("no-rule", "no egress rule names this host")
    if upgrade and upgrade != "-":
        return refuse("upgrade", "a protocol upgrade (WebSocket, h2c) is not judged on a host with egress rules")
    if not _TOKEN.match(method) or method == "CONNECT":
        return refuse("method", f"method {method[:32]!r} is not allowed inside a judged connection")
    path, _, query = target.partition("?")
    got = decode_path(path)
    if isinstance(got, str):
        return refuse("unclear-path", got)
    segments, _slash = got
    method_ok = [c for c in clauses if not c.methods or method in c.methods]
    if not method_ok:
        return refuse("method", f"no rule allows {method}")
    for c in method_ok:
        if not c.paths or any(path_matches(p, segments, query, c.ignore_case) for p in c.paths):
            return Verdict(True, "allow", c.name)
    return refuse("path", f"no rule allows {method} on this path")


def _shown(method: str, target: str) -> str:
    """The request as a refusal names it: the path without its query, clipped,
    anything but visible ASCII escaped (it is sandbox-made text)."""
    path = target.partition("?")[0][:200]
    safe = urllib.parse.quote(path, safe="/-._~!$&'()*+,;=:@%")
    return f"{urllib.parse.quote(method[:32], safe='')} {safe}"


def host_clauses(rules: dict[str, list[Clause]], host: str) -> list[Clause]:
    """The clauses of every rule entry naming `host` (exact) or a domain of it (`.example.com`)."""
    host = host.lower().rstrip(".")
    out: list[Clause] = []
    for key, clauses in rules.items():
        if key == host or (key.startswith(".") and (host == key[1:] or host.endswith(key))):
            out.extend(clauses)
    return out


def load_rules(text: str) -> dict[str, list[Clause]]:
    """rules.json: {"hosts": {host: [{name, methods, paths, ignore_case, summary}]}}."""
    data = json.loads(text)
    out: dict[str, list[Clause]] = {}
    for host, entries in (data.get("hosts") or {}).items():
        out[str(host).lower()] = [Clause(name=str(e.get("name", "")), methods=tuple(e.get("methods") or ()),
                                         paths=tuple(e.get("paths") or ()),
                                         ignore_case=bool(e.get("ignore_case")),
                                         summary=str(e.get("summary", ""))) for e in entries]
    return out


def rules_json(rules: dict[str, list[Clause]]) -> str:
    return json.dumps({"hosts": {h: [{"name": c.name, "methods": list(c.methods), "paths": list(c.paths),
                                      "ignore_case": c.ignore_case, "summary": c.summary} for c in cs]
                                 for h, cs in sorted(rules.items())}}, sort_keys=True)


def answer(rules: dict[str, list[Clause]], line: str) -> str:
    """One helper exchange: `CHANNEL METHOD HOST TARGET UPGRADE` (squid's
    %-escaped fields) -> `CHANNEL OK|ERR message=... log=...`."""
    fields = line.split()
    channel = fields[0] if fields else "0"
    try:
        method, host, target, upgrade = (urllib.parse.unquote(f) for f in (fields + ["-"] * 5)[1:5])
        v = judge(host_clauses(rules, host), method, target, upgrade)
    except Exception as exc:  # noqa: BLE001 - never crash squid's helper: refuse instead
        v = Verdict(False, "error", "", f"the egress judge failed ({type(exc).__name__}); refused")
    note = urllib.parse.quote(f"{'allow' if v.allowed else 'deny'}:{v.code}:{v.rules}", safe=":,-._")
    if v.allowed:
        return f"{channel} OK log={note}"
    return f"{channel} ERR message={urllib.parse.quote(v.message, safe='')} log={note}"


def main(argv: list[str]) -> int:
    with open(argv[1], encoding="utf-8") as f:
        rules = load_rules(f.read())
    for line in sys.stdin:
        sys.stdout.write(answer(rules, line.rstrip("\n")) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
