"""The allowlist and the squid configuration, without Docker."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.sandbox.egress.allowlist import check_cidrs, check_egress_names, squid_conf


@pytest.mark.parametrize("name", ["10.0.0.1", "2130706433", "0x7f000001", "[::1]", "::1", "*.example.com",
                                  "http://example.com", "exa mple.com", "", ".", "a..b", "-bad.com",
                                  "example.com/path", "user@example.com", "example.com:443"])
def test_r10_allowlist_refuses_non_names(name):
    with pytest.raises(InvalidArgument):
        check_egress_names([name])


def test_r10_allowlist_normalises_and_dedups():
    assert check_egress_names(["API.Example.com.", ".example.com", "pypi.org", "pypi.org"]) == \
        [".example.com", "pypi.org"]


def test_r11_squid_conf_denies_before_allowing():
    conf = squid_conf(["pypi.org"]).splitlines()
    access = [line for line in conf if line.startswith("http_access")]
    assert access == ["http_access deny CONNECT !SSL_ports", "http_access deny !Safe_ports",
                      "http_access deny ip_literal", "http_access deny blocked_dst",
                      "http_access allow allowed_names", "http_access deny all"]
    assert "cache deny all" in conf and "http_port 3128" in conf
    assert "acl allowed_names dstdomain -n pypi.org" in conf


def test_r11_empty_allowlist_allows_nothing():
    conf = squid_conf([])
    assert "allow allowed_names" not in conf and "http_access deny all" in conf


def test_allow_private_is_a_cidr():
    assert check_cidrs(["172.30.0.5/24"]) == ["172.30.0.0/24"]
    with pytest.raises(InvalidArgument):
        check_cidrs(["not-a-net"])
    assert "http_access deny blocked_dst !exempt_dst" in squid_conf(["a.b"], ["172.30.0.0/24"])
