"""Every egress request read back from the proxy's access log (R44), without
Docker: the lines below are the `afe` log format as squid writes it (taken
from a real proxy with rules); the log is sandbox-made text, so what comes
out is checked and bounded, and never carries a query."""

from __future__ import annotations

from services.sandbox.egress.allowlist import (
    allowed_hosts,
    denied_hosts,
    logged_requests,
    parse_log_line,
    path_digest,
)


def line(code: str, method: str, url: str, *, out: int = 40, inb: int = 228, bump: str = "bump",
         sni: str = "registry.test", note: str = "-") -> str:
    return (f"1796647184.432     79 172.27.0.4 {code} {inb} {method} {url} - HIER_DIRECT/172.27.0.2 - "
            f"{out} {bump} {sni} {note}")


LOG = "\n".join([
    line("NONE_NONE/200", "CONNECT", "registry.test:443", inb=0, note="-"),          # the bumped tunnel itself
    line("TCP_MISS/200", "GET", "https://registry.test/demo-pkg?", note="allow:allow:read-only"),
    line("TCP_MISS/200", "GET", "https://registry.test/demo-pkg?", inb=300, note="allow:allow:read-only"),
    line("TCP_MISS/200", "GET", "https://registry.test/demo%2Dpkg", note="allow:allow:read-only"),
    line("TCP_DENIED/403", "PUT", "https://registry.test/demo-pkg", out=5000, note="deny:method:read-only"),
    line("TCP_DENIED/403", "POST", "https://git.test/o/r.git/git-receive-pack", sni="git.test",
         note="deny:path:git-fetch"),
    line("TCP_DENIED/403", "PUT", "https://registry.test/upload/public/%2e%2e/private?token=s3cret",
         note="deny:unclear-path:sandbox.egress%5B2%5D"),
    line("NONE_NONE/200", "CONNECT", "plain.test:443", inb=0, bump="peek", sni="plain.test"),
    line("TCP_TUNNEL/200", "CONNECT", "plain.test:443", inb=5000, out=700, bump="splice", sni="plain.test"),
    line("NONE_NONE/200", "CONNECT", "plain.test:443", inb=0, bump="terminate", sni="registry.test"),
    line("NONE_NONE/400", "PRI", "*", inb=3507, note="-"),
    "1796647184.500      0 172.27.0.4 NONE_NONE/000 0 - error:transaction-end-before-headers - HIER_NONE/- - 8 - - -",
    line("TCP_DENIED/403", "CONNECT", "evil.test:443", bump="-", sni="-"),
])


def test_r44_every_request_with_verdict_rule_and_bytes():
    got, truncated = logged_requests(LOG)
    assert not truncated
    rows = [(g.request.method, g.request.host, g.request.path, g.request.status, g.request.denied,
             g.request.reason, g.request.rule, g.count, g.bytes_out, g.bytes_in) for g in got]
    assert rows == [
        ("GET", "registry.test", "/demo-pkg", 200, False, "", "read-only", 2, 80, 528),
        ("GET", "registry.test", "/demo%2Dpkg", 200, False, "", "read-only", 1, 40, 228),
        ("PUT", "registry.test", "/demo-pkg", 403, True, "method", "read-only", 1, 5000, 228),
        ("POST", "git.test", "/o/r.git/git-receive-pack", 403, True, "path", "git-fetch", 1, 40, 228),
        ("PUT", "registry.test", "/upload/public/%2e%2e/private", 403, True, "unclear-path", "sandbox.egress[2]",
         1, 40, 228),
        ("CONNECT", "plain.test", "", 200, False, "", "", 1, 700, 5000),          # pass-through: one tunnel
        ("CONNECT", "registry.test", "", 200, True, "sni", "", 1, 40, 0),         # ClientHello named a ruled host
        ("PRI", "registry.test", "", 400, True, "unparsed", "", 1, 40, 3507),     # HTTP/2 the proxy cannot read
        ("CONNECT", "evil.test", "", 403, True, "not-allowed", "", 1, 40, 228),
    ]
    assert "s3cret" not in repr(got) and "token" not in repr(got)


def test_r44_tunnel_setup_lines_are_not_counted_twice():
    # the CONNECT lines of bumped and peeked tunnels are not requests of their own
    assert allowed_hosts(LOG) == ([("registry.test", 3), ("plain.test", 1)], False)
    assert denied_hosts(LOG) == ([("registry.test", 4), ("evil.test", 1), ("git.test", 1)], False)


def test_r44_path_digest_is_of_the_normal_form():
    assert path_digest("/demo-pkg") == path_digest("/demo%2Dpkg") == path_digest("//demo-pkg")
    assert path_digest("/demo-pkg") != path_digest("/demo-pkg2")
    assert path_digest("/a/%2e%2e/b") != path_digest("/b")          # refused spellings keep their own digest
    assert path_digest("") == ""
    assert len(path_digest("/x")) == 64


def test_r44_hostile_lines_yield_clean_fields():
    hostile = [
        line("TCP_DENIED/403", "PUT", "https://registry.test/a\x1b[31mred"),
        line("TCP_DENIED/403", "P\u00dcT", "https://registry.test/x"),                     # not a method
        line("TCP_DENIED/403", "PUT", "https://registry.test/" + "a" * 5000),
        line("TCP_DENIED/403", "PUT", "https://evil`**x**`.test/x"),
        line("TCP_DENIED/403", "PUT", "https://registry.test/x", note="deny:path:<script>"),
        "TCP_DENIED/403 PUT",
    ]
    got, _ = logged_requests("\n".join(hostile))
    for g in got:
        r = g.request
        assert r.method == "PUT"
        assert all(0x21 <= ord(ch) <= 0x7E for ch in r.path) and len(r.path) <= 512
        assert r.host in ("registry.test", "")
        assert "<" not in r.rule


def test_r44_distinct_requests_are_bounded():
    log = "\n".join(line("TCP_MISS/200", "GET", f"https://registry.test/p{i}") for i in range(30))
    got, truncated = logged_requests(log, limit=10)
    assert len(got) == 10 and truncated


def test_r44_native_lines_without_the_added_fields_still_read():
    native = "1764650000.123      0 172.30.0.3 TCP_DENIED/403 3912 CONNECT evil.example:443 - HIER_NONE/- text/html"
    r = parse_log_line(native)
    assert r is not None and (r.method, r.host, r.denied, r.reason, r.bytes_out) == (
        "CONNECT", "evil.example", True, "not-allowed", 0)
