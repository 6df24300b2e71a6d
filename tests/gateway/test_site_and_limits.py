"""The configured origin and Host set, and the failed-login window, as units."""

from __future__ import annotations

import pytest

from gateway.ratelimit import FailureLimiter
from gateway.site import Site, parse_listen
from services.common.errors import ConfigError


def test_origin_comes_from_the_public_url():
    s = Site.build("https://afe.example.org", "127.0.0.1", 8420)
    assert s.origin == "https://afe.example.org" and s.secure
    assert s.host_allowed("afe.example.org") and s.host_allowed("AFE.example.org:443")
    assert s.host_allowed("127.0.0.1:8420")  # the listen address (a local proxy, the CLI)
    assert not s.host_allowed("evil.example") and not s.host_allowed("") and not s.host_allowed(None)
    assert s.origin_is_ours("https://afe.example.org")
    for o in (None, "null", "http://afe.example.org", "https://afe.example.org:8443", "https://evil.example"):
        assert not s.origin_is_ours(o), o


def test_default_origin_is_the_listen_address():
    s = Site.build(None, "127.0.0.1", 8420)
    assert s.origin == "http://127.0.0.1:8420" and not s.secure
    assert s.allowed_hosts == {"127.0.0.1:8420"}
    v6 = Site.build(None, "::1", 8420)
    assert v6.origin == "http://[::1]:8420" and v6.host_allowed("[::1]:8420")


@pytest.mark.parametrize("url", ["ftp://afe.example", "https://user:pw@afe.example", "https://afe.example/ui",
                                 "https://afe.example?x=1", "afe.example", "https://"])
def test_bad_public_urls_are_config_errors(url):
    with pytest.raises(ConfigError):
        Site.build(url, "127.0.0.1", 8420)


@pytest.mark.parametrize("value", ["8420", "host", ":8420", "h:99999", "h:port"])
def test_bad_listen_values_are_config_errors(value):
    with pytest.raises(ConfigError):
        parse_listen(value)


def test_failure_window_slides():
    lim = FailureLimiter(max_failures=2, window=60)
    assert lim.retry_after("a", now=0) == 0
    lim.failed("a", now=0)
    lim.failed("a", now=10)
    assert lim.retry_after("a", now=11) == pytest.approx(49)
    assert lim.retry_after("b", now=11) == 0  # per client
    assert lim.retry_after("a", now=60.5) == 0  # the first failure left the window


def test_failure_memory_is_bounded():
    lim = FailureLimiter(max_failures=1, window=60, max_clients=3)
    for i in range(10):
        lim.failed(f"c{i}", now=i)
    assert len(lim._failures) == 3


def test_failed_answers_the_wait_only_past_the_budget_and_keeps_the_latest_failures():
    lim = FailureLimiter(max_failures=2, window=60)
    assert lim.failed("a", now=0) == 0 and lim.failed("a", now=1) == 0    # within the budget: 401
    assert lim.failed("a", now=2) == pytest.approx(59)                   # past it: 429, the window moved on
    for t in range(3, 50):
        lim.failed("a", now=t)
    assert len(lim._failures["a"]) == 2                                  # memory per source stays bounded
    assert lim.retry_after("a", now=50) == pytest.approx(58)             # the latest failures decide the wait
    assert lim.retry_after("a", now=109.5) == 0


def test_a_budget_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        FailureLimiter(max_failures=0)
