"""The egress allowlist (R10-R12): validating the listed host names and
rendering the squid configuration of a ticket's proxy.

The proxy allows only the listed names (exact `host.example` or suffix
`.example`), plain HTTP only to ports 80/443, CONNECT only to 443; it refuses
IP-literal destinations in every spelling (dotted, decimal, octal, hex, v6)
and any name that resolves to a loopback, link-local, private, CGNAT or
metadata address (except subnets the operator exempts with
`--allow-private`, used by tests and `afe doctor` for their own target, and a
ticket's `egress_private` entries: the Workspace's `sandbox.egressPrivate`,
an internal mirror, say; loopback and link-local stay refused even then), and
caches nothing.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import urllib.parse
from dataclasses import dataclass, replace

from services.common.config.egress_rules import EgressRule
from services.common.errors import InvalidArgument
from services.sandbox.egress import bump as egress_bump
from services.sandbox.egress import judge as egress_judge

PROXY_PORT = 3128

_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_NAME_RE = re.compile(rf"^\.?{_LABEL}(?:\.{_LABEL})*$")
# An IPv4 literal in any spelling inet_aton accepts: dotted parts that are
# decimal, octal (leading 0) or hex (0x) numbers, 1 to 4 of them.
_NUMERIC_PART = r"(0x[0-9a-f]*|[0-9]+)"
_NUMERIC_RE = re.compile(rf"^{_NUMERIC_PART}(\.{_NUMERIC_PART})*$", re.IGNORECASE)

# Destinations squid must never connect to, whatever name resolves there.
BLOCKED_RANGES = (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
    "172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4",
    "240.0.0.0/4", "::/128", "::1/128", "::ffff:0:0/96", "fc00::/7", "fe80::/10", "ff00::/8",
    "64:ff9b::/96",
)


def check_egress_names(names: list[str] | tuple[str, ...]) -> list[str]:
    """Normalise and validate an allowlist; refuse IP literals and wildcards."""
    out: list[str] = []
    for raw in names:
        name = str(raw).strip().lower().rstrip(".") if str(raw) != "." else ""
        if not name or len(name) > 253 or not _NAME_RE.match(name):
            raise InvalidArgument(
                f"egress entry {raw!r} is not a host name: use an exact name (api.example.com) "
                "or a suffix (.example.com)")
        bare = name.lstrip(".")
        if _NUMERIC_RE.match(bare) or bare.rsplit(".", 1)[-1].isdigit():
            raise InvalidArgument(f"egress entry {raw!r} is an IP address: list host names only")
        out.append(name)
    # squid refuses overlapping dstdomain entries (a.b and .b): keep the suffix.
    suffixes = {n for n in out if n.startswith(".")}
    kept = []
    for n in dict.fromkeys(out):
        if not n.startswith(".") and any(n.endswith(s) or n == s[1:] for s in suffixes):
            continue
        if n.startswith(".") and any(n != s and n.endswith(s) for s in suffixes):
            continue
        kept.append(n)
    return kept


def check_cidrs(cidrs: list[str] | tuple[str, ...]) -> list[str]:
    out = []
    for c in cidrs:
        try:
            out.append(str(ipaddress.ip_network(c, strict=False)))
        except ValueError as exc:
            raise InvalidArgument(f"--allow-private {c!r} is not a CIDR subnet (e.g. 172.30.0.0/24)") from exc
    return out


# Never reachable, not even for an operator-allowed private entry: this
# host's and the proxy's loopback, link-local (cloud metadata), "this
# network", multicast and reserved ranges.
NEVER_RANGES = (
    "0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4",
    "::/128", "::1/128", "::ffff:0:0/96", "fe80::/10", "ff00::/8",
)


def _covered(name: str, egress: list[str]) -> bool:
    """Is host name `name` (exact or .suffix) allowed by the egress list?"""
    bare = name.lstrip(".")
    return any(e == name or (e.startswith(".") and (bare == e[1:] or bare.endswith(e))) for e in egress)


def check_private(entries: list[str] | tuple[str, ...], egress: list[str] | tuple[str, ...]
                  ) -> tuple[list[str], list[str]]:
    """Split a ticket's egress_private into (host names, CIDR subnets).

    A name must also be allowed by `egress` (the proxy allows nothing else); a
    subnet must not touch loopback, link-local, multicast or reserved space.
    """
    allowed = check_egress_names(list(egress))
    never = [ipaddress.ip_network(r) for r in NEVER_RANGES]
    names: list[str] = []
    cidrs: list[str] = []
    for raw in entries:
        text = str(raw).strip()
        try:
            net = ipaddress.ip_network(text, strict=False)
        except ValueError:
            net = None
        if net is not None:
            if any(net.version == n.version and net.overlaps(n) for n in never):
                raise InvalidArgument(f"egress_private entry {text!r} overlaps loopback, link-local, multicast "
                                      "or reserved addresses; list the private subnet of the service only")
            cidrs.append(str(net))
            continue
        (name,) = check_egress_names([text])
        if not _covered(name, allowed):
            raise InvalidArgument(f"egress_private entry {text!r} is not in the egress allowlist; add it to "
                                  "egress too (egress_private only lets an allowed name reach a private address)")
        names.append(name)
    return check_egress_names(names), list(dict.fromkeys(cidrs))


# The sandbox's own loopback is never proxied: the model relay's forwarder
# listens there (R32), and nothing else is on it (the sandbox's loopback is
# its own, in every runtime and transport).
SANDBOX_NO_PROXY = "localhost,127.0.0.1,::1"


def proxy_env(host: str, port: int = PROXY_PORT) -> dict[str, str]:
    """The environment that sends a sandbox's HTTP(S) through its proxy."""
    url = f"http://{host}:{port}"
    return {"HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url, "https_proxy": url,
            "NO_PROXY": SANDBOX_NO_PROXY, "no_proxy": SANDBOX_NO_PROXY}


# squid's own TLS to an upstream (a host with rules, R44; an absolute https:// URL) is verified
# against the system store read through its hashed folder (the same certificates as the bundle,
# one file each, read when a chain asks for it), not squid's default, which parses the whole
# bundle (some 140 certificates) before squid listens: 40-70 ms of the proxy's half CPU that
# every egress sandbox's first command waited for (make bench: bench/bench_egress_rules.py).
SYSTEM_CA_DIR = "/etc/ssl/certs"
TLS_OUTGOING = f"tls_outgoing_options default-ca=off capath={SYSTEM_CA_DIR}"
# squid's table of file types and their icons, for listings of ftp:// and gopher:// URLs: without
# it squid loads none of its ~50 icons before it listens (some 8 ms of CPU, 16 at half a CPU).
MIME_TABLE = "mime_table /dev/null"

# squid's native access log format, then the request's bytes, the SslBump
# decision, the TLS SNI and the judge's annotation (judge.py): the first
# ten fields read as before, the rest is what R44's record needs.
LOG_FORMAT = ("%ts.%03tu %6tr %>a %Ss/%03>Hs %<st %rm %ru %[un %Sh/%<a %mt "
              "%>st %ssl::bump_mode %ssl::>sni %ea")


def squid_conf(names: list[str], allow_private: list[str] | tuple[str, ...] = (),
               private: list[str] | tuple[str, ...] = (), loopback_only: bool = False,
               rules: tuple[EgressRule, ...] = (), upstream_ca: bool = False) -> str:
    """The proxy's configuration. `allow_private` is the broker's exemption
    (tests, doctor); `private` the ticket's operator-allowed private entries
    (host names and subnets, see `check_private`); `loopback_only`: squid
    listens on its container's loopback alone (over_socket.py: the socket
    is the only way in); `rules`: the methods and paths allowed on hosts that
    have rules (R44: squid decrypts those, bump.py), `upstream_ca`:
    the operator's CA file is there for verifying upstreams."""
    private_names, private_cidrs = check_private(list(private), names)
    names = check_egress_names(names)
    exempt = check_cidrs(allow_private)
    listen = f"127.0.0.1:{PROXY_PORT}" if loopback_only else f"{PROXY_PORT}"
    bump_setup: list[str] = []
    bump_first: list[str] = []
    bump_rules: list[str] = []
    if rules:
        bump_setup, bump_first, bump_rules = egress_bump.squid_lines(rules, listen=listen,
                                                                     upstream_ca=upstream_ca)
    lines = [
        *(bump_setup[:1] or [f"http_port {listen}"]),
        *bump_setup[1:],
        "icp_port 0",
        "htcp_port 0",
        "snmp_port 0",
        "pinger_enable off",
        "digest_generation off",
        "pid_filename none",
        "cache deny all",
        "cache_mem 0 MB",
        "cache_store_log none",
        f"logformat afe {LOG_FORMAT}",
        "access_log stdio:/dev/stdout afe",
        "cache_log /dev/stderr",
        "logfile_rotate 0",
        "coredump_dir /tmp",
        "shutdown_lifetime 1 seconds",
        "forwarded_for delete",
        "via off",
        "httpd_suppress_version_string on",
        TLS_OUTGOING,
        MIME_TABLE,
        "acl SSL_ports port 443",
        "acl Safe_ports port 80 443",
        "acl CONNECT method CONNECT",
        # IP literals in every spelling: dotted/decimal/octal/hex v4 and v6.
        f"acl ip_literal dstdom_regex -i ^{_NUMERIC_PART}(\\.{_NUMERIC_PART})*\\.?$ ^\\[.*\\]$ :",
        f"acl blocked_dst dst {' '.join(BLOCKED_RANGES)}",
    ]
    if exempt:
        lines.append(f"acl exempt_dst dst {' '.join(exempt)}")
    if names:
        lines.append(f"acl allowed_names dstdomain -n {' '.join(names)}")
    if private_names or private_cidrs:
        lines.append(f"acl never_dst dst {' '.join(NEVER_RANGES)}")
    if private_names:
        lines.append(f"acl private_names dstdomain -n {' '.join(private_names)}")
    if private_cidrs:
        lines.append(f"acl private_dst dst {' '.join(private_cidrs)}")
    lines += [
        *bump_first,
        "http_access deny CONNECT !SSL_ports",
        "http_access deny !Safe_ports",
        "http_access deny ip_literal",
    ]
    if private_names or private_cidrs:
        lines.append("http_access deny never_dst")
    unless = (" !exempt_dst" if exempt else "") + (" !private_names" if private_names else "") \
        + (" !private_dst" if private_cidrs else "")
    lines.append(f"http_access deny blocked_dst{unless}")
    lines += bump_rules
    if names:
        lines.append("http_access allow allowed_names")
    lines += ["http_access deny all", "http_reply_access allow all"]
    return "\n".join(line for line in lines if line) + "\n"


# ---- refused requests, from the proxy's access log ------------------------------

DENIED_HOSTS_MAX = 50            # distinct host names reported per ticket
DENIED_LOG_LINES = 20000         # the newest access log lines read
DENIED_LOG_BYTES = 8 << 20       # and at most this much of them
_LOG_HOST_MAX = 253


def _log_host(method: str, url: str) -> str:
    """The destination's host name of one logged request ("" if it is not a
    clean host name or IP address: the text came from the sandbox)."""
    if method == "CONNECT":
        host = url.rsplit(":", 1)[0] if url.count(":") == 1 or url.startswith("[") else url
    else:
        scheme, sep, rest = url.partition("://")
        if not sep or scheme.lower() not in ("http", "https", "ftp"):
            return ""
        host = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0].rsplit("@", 1)[-1]
        if not host.startswith("["):
            host = host.rsplit(":", 1)[0]
        elif "]" in host:
            host = host[:host.index("]") + 1]
    host = host.lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        try:
            return f"[{ipaddress.IPv6Address(host[1:-1])}]"
        except ValueError:
            return ""
    if not host or len(host) > _LOG_HOST_MAX or not _NAME_RE.fullmatch(host) or host.startswith("."):
        return ""
    return host


def denied_hosts(log_text: str, limit: int = DENIED_HOSTS_MAX) -> tuple[list[tuple[str, int]], bool]:
    """The host names of the requests the proxy refused (TCP_DENIED lines of
    squid's native access log), with how often each was tried, most tried
    first: ([(host, count)], truncated). Names only, never a path or query;
    anything that is not a host name or IP address is dropped, and at most
    `limit` distinct names are kept (the first ones seen)."""
    return logged_hosts(log_text, denied=True, limit=limit)


def allowed_hosts(log_text: str, limit: int = DENIED_HOSTS_MAX) -> tuple[list[tuple[str, int]], bool]:
    """The same for the requests the proxy let through (every other logged request)."""
    return logged_hosts(log_text, denied=False, limit=limit)


def logged_hosts(log_text: str, *, denied: bool, limit: int = DENIED_HOSTS_MAX) -> tuple[list[tuple[str, int]], bool]:
    counts: dict[str, int] = {}
    truncated = False
    for line in log_text.splitlines():
        entry = parse_log_line(line)
        if entry is None or entry.denied != denied or not entry.host:
            continue
        host = entry.host
        if host in counts:
            counts[host] += 1
        elif len(counts) < limit:
            counts[host] = 1
        else:
            truncated = True
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])), truncated


# ---- every request, for the run record and the egress.denied event (R44) ------

REQUESTS_MAX = 500               # distinct requests (method, host, path, status, verdict) reported per ticket
PATH_SHOWN_MAX = 512
_METHOD_RE = re.compile(r"^[A-Z][A-Z0-9_-]{0,19}$")
_PATH_RE = re.compile(r"^/[\x21-\x7e]*$")             # visible ASCII: squid logs a URL escaped
_NOTE_RE = re.compile(r"^(allow|deny):([a-z-]{1,20}):([A-Za-z0-9._\[\],-]{0,200})$")
_TUNNEL_SETUP = ("NONE", "NONE_NONE")    # the CONNECT line of a tunnel squid bumped or peeked into


@dataclass(frozen=True)
class LoggedRequest:
    """One request of the proxy's access log, checked (the log is sandbox-made text)."""
    method: str
    host: str
    path: str            # without the query; "" for a tunnel
    status: int
    denied: bool
    reason: str          # why it was refused ("" when allowed)
    rule: str            # the rules that judged it ("" without rules)
    bytes_out: int
    bytes_in: int


def _int(text: str) -> int:
    return int(text) if text.isdigit() and len(text) < 19 else 0


def parse_log_line(line: str) -> LoggedRequest | None:
    """One line of the `afe` log format (LOG_FORMAT; squid's native format is
    its first ten fields) as a request, or None: too few fields, no method,
    or the CONNECT line of a tunnel whose requests squid logs one by one
    (bumped) or as a TCP_TUNNEL line (spliced after a peek)."""
    fields = line.split()
    # time elapsed client CODE/status bytes METHOD URL user hierarchy type [bytes-out bump sni note]
    if len(fields) < 7 or "/" not in fields[3]:
        return None
    code, _, status_text = fields[3].partition("/")
    method, url = fields[5], fields[6]
    bump = fields[11] if len(fields) > 11 else "-"
    sni = fields[12] if len(fields) > 12 else "-"
    note = urllib.parse.unquote(fields[13]) if len(fields) > 13 else "-"
    if not _METHOD_RE.match(method):
        return None
    status = _int(status_text)
    terminated = bump == "terminate"
    if method == "CONNECT" and code in _TUNNEL_SETUP and not terminated:
        return None
    denied = code.startswith("TCP_DENIED") or terminated or (code in _TUNNEL_SETUP and status >= 400)
    host = _log_host(method, url)
    sni_host = _log_host("CONNECT", sni) if sni != "-" else ""
    if terminated and sni_host:
        host = sni_host                  # the host the ClientHello named (a host with rules)
    host = host or sni_host
    path = ""
    if method != "CONNECT":
        rest = url.partition("://")[2]
        raw = "/" + rest.split("/", 1)[1] if "/" in rest else ""
        raw = raw.split("?", 1)[0]
        path = raw[:PATH_SHOWN_MAX] if _PATH_RE.match(raw) else ""
    reason, rule = "", ""
    m = _NOTE_RE.match(note)
    if m:
        rule = m.group(3)
        if m.group(1) == "deny":
            reason = m.group(2)
    if denied and not reason:
        reason = ("sni" if terminated else "unparsed" if code in _TUNNEL_SETUP else "not-allowed")
    return LoggedRequest(method=method, host=host, path=path, status=status, denied=denied,
                         reason=reason if denied else "", rule=rule,
                         bytes_out=_int(fields[10]) if len(fields) > 10 else 0, bytes_in=_int(fields[4]))


@dataclass
class RequestCount:
    request: LoggedRequest
    count: int = 0
    bytes_out: int = 0
    bytes_in: int = 0


def logged_requests(log_text: str, limit: int = REQUESTS_MAX) -> tuple[list[RequestCount], bool]:
    """Every request the proxy logged, allowed or refused, grouped by (method,
    host, path, status, verdict, rule) with counts and summed bytes, in the
    order first seen; at most `limit` groups (truncated says more were seen)."""
    groups: dict[tuple[str, str, str, int, bool, str, str], RequestCount] = {}
    truncated = False
    for line in log_text.splitlines():
        r = parse_log_line(line)
        if r is None:
            continue
        key = (r.method, r.host, r.path, r.status, r.denied, r.reason, r.rule)
        g = groups.get(key)
        if g is None:
            if len(groups) >= limit:
                truncated = True
                continue
            g = groups[key] = RequestCount(replace(r, bytes_out=0, bytes_in=0))
        g.count += 1
        g.bytes_out += r.bytes_out
        g.bytes_in += r.bytes_in
    return list(groups.values()), truncated


def path_digest(path: str) -> str:
    """SHA-256 of a logged path's normal form (egress_judge.normal_path: the
    encoded spellings of one path share it); "" for a tunnel."""
    if not path:
        return ""
    normal = egress_judge.normal_path(path)
    return hashlib.sha256((normal if normal is not None else path).encode()).hexdigest()
