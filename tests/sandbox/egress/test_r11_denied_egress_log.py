"""Refused egress read back from the proxy's access log (R11), without
Docker: the log is sandbox-made text, so only clean host names come out."""

from __future__ import annotations

import re

from services.sandbox.egress.allowlist import allowed_hosts, denied_hosts

CLEAN = re.compile(r"^(\[[0-9a-f:.]+\]|[a-z0-9.-]{1,253})$")


def line(code: str, method: str, url: str) -> str:
    return f"1764650000.123      0 172.30.0.3 {code} 3912 {method} {url} - HIER_NONE/- text/html"


def test_r11_denied_hosts_from_connect_and_plain_http():
    log = "\n".join([
        line("TCP_DENIED/403", "CONNECT", "evil.example:443"),
        line("TCP_DENIED/403", "GET", "http://Other.Example/secret/path?token=abc#frag"),
        line("TCP_DENIED/403", "CONNECT", "evil.example:443"),
        line("TCP_TUNNEL/200", "CONNECT", "allowed.example:443"),          # allowed: not listed
        line("TCP_MISS/200", "GET", "http://allowed.example/x"),
        line("TCP_DENIED/403", "POST", "http://user:pw@creds.example:8080/p"),
        line("TCP_DENIED/403", "CONNECT", "[::1]:443"),
        line("TCP_DENIED/403", "GET", "http://10.0.0.1/"),
    ])
    hosts, truncated = denied_hosts(log)
    assert hosts == [("evil.example", 2), ("10.0.0.1", 1), ("[::1]", 1), ("creds.example", 1),
                     ("other.example", 1)]
    assert not truncated
    text = repr(hosts)
    for leak in ("secret", "token", "abc", "frag", "pw", "user", "/p", "allowed"):
        assert leak not in text
    # the same log's requests let through, for the run record (R42): counted, names only
    assert allowed_hosts(log) == ([("allowed.example", 2)], False)


def test_r11_hostile_log_lines_yield_no_markup():
    hostile = [
        "`](https://phish.example)",
        "evil.example`**bold**",
        "a.example/../[x](y)",
        "x" * 300 + ".example",                        # one label too long
        ".".join(["a" * 60] * 5),                      # name over 253 characters
        "<img src=x>",
        "-bad.example",
        "ex\u0430mple.com",                            # a Cyrillic letter
        "[not-an-ip]",
        "[::1]<b>",
        "exa%60mple.com",
        "1.2.3.4:443:5",
    ]
    log = "\n".join(line("TCP_DENIED/403", "CONNECT", f"{h}:443") for h in hostile)
    log += "\n" + "\n".join(line("TCP_DENIED/403", "GET", f"http://{h}/") for h in hostile)
    log += "\nTCP_DENIED/403 CONNECT short.example:443"                       # too few fields
    log += "\n" + line("TCP_DENIED/403", "GET", "javascript:alert(1)")        # no scheme://
    log += "\n" + line("TCP_DENIED/403", "GET", "http://ok.example/\r\n`injected`")
    hosts, _ = denied_hosts(log)
    # only the clean host part of a URL survives (its path, with the markup, is dropped)
    assert hosts == [("[::1]", 1), ("a.example", 1), ("ok.example", 1)]
    assert all(CLEAN.match(h) for h, _ in hosts)
    # positive control: the same shapes with clean names do come through
    assert denied_hosts(line("TCP_DENIED/403", "CONNECT", "phish.example:443"))[0] == [("phish.example", 1)]


def test_r11_denied_hosts_are_bounded():
    log = "\n".join(line("TCP_DENIED/403", "CONNECT", f"h{i}.example:443") for i in range(80))
    log += "\n" + line("TCP_DENIED/403", "CONNECT", "h0.example:443")
    hosts, truncated = denied_hosts(log)
    assert len(hosts) == 50 and truncated
    assert hosts[0] == ("h0.example", 2)
    assert all(CLEAN.match(h) for h, _ in hosts)
