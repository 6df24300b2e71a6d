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

import ipaddress
import re

from services.common.errors import InvalidArgument

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
            if any(net.version == n.version and net.overlaps(n) for n in never):  # type: ignore[arg-type]
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


def squid_conf(names: list[str], allow_private: list[str] | tuple[str, ...] = (),
               private: list[str] | tuple[str, ...] = (), loopback_only: bool = False) -> str:
    """The proxy's configuration. `allow_private` is the broker's exemption
    (tests, doctor); `private` the ticket's operator-allowed private entries
    (host names and subnets, see `check_private`); `loopback_only`: squid
    listens on its container's loopback alone (egress_socket.py: the socket
    is the only way in)."""
    private_names, private_cidrs = check_private(list(private), names)
    names = check_egress_names(names)
    exempt = check_cidrs(allow_private)
    lines = [
        f"http_port 127.0.0.1:{PROXY_PORT}" if loopback_only else f"http_port {PROXY_PORT}",
        "icp_port 0",
        "htcp_port 0",
        "snmp_port 0",
        "pinger_enable off",
        "digest_generation off",
        "pid_filename none",
        "cache deny all",
        "cache_mem 0 MB",
        "cache_store_log none",
        "access_log stdio:/dev/stdout",
        "cache_log /dev/stderr",
        "logfile_rotate 0",
        "coredump_dir /tmp",
        "shutdown_lifetime 1 seconds",
        "forwarded_for delete",
        "via off",
        "httpd_suppress_version_string on",
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
        "http_access deny CONNECT !SSL_ports",
        "http_access deny !Safe_ports",
        "http_access deny ip_literal",
    ]
    if private_names or private_cidrs:
        lines.append("http_access deny never_dst")
    unless = (" !exempt_dst" if exempt else "") + (" !private_names" if private_names else "") \
        + (" !private_dst" if private_cidrs else "")
    lines.append(f"http_access deny blocked_dst{unless}")
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
        fields = line.split()
        # time elapsed client CODE/status bytes METHOD URL user hierarchy type
        if len(fields) < 7 or "/" not in fields[3] or fields[3].startswith("TCP_DENIED/") != denied:
            continue
        host = _log_host(fields[5], fields[6])
        if not host:
            continue
        if host in counts:
            counts[host] += 1
        elif len(counts) < limit:
            counts[host] = 1
        else:
            truncated = True
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])), truncated
