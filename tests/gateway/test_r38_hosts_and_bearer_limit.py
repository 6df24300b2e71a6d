"""R38 at the gateway: every route (pages, static files, login/logout,
session, /rpc, unknown paths) and its ops port refuse a Host that is not
theirs (DNS rebinding); failed bearer tokens on /rpc are rate limited by the
same per-address limiter as failed logins (429 + Retry-After). Other
addresses are not affected, and the right token always passes (R40,
test_r40_no_lockout.py). A refused Host still learns where afe is: a browser
gets a page naming the URL to open, an API client JSON with it.
"""

from __future__ import annotations

import pytest

from .conftest import start_gateway
from .rpcutil import login, open_rpc

pytestmark = pytest.mark.timeout(120)

EVIL = ["evil.example", "evil.example:{port}", "EVIL.example:{port}", "127.0.0.1.evil.example:{port}",
        "localhost.:{port}x", "[::1]:{port}"]

# (method, path) of every route the gateway serves, plus one it does not.
ROUTES = [("GET", "/"), ("GET", "/static/app.js"), ("GET", "/static/style.css"), ("GET", "/static/favicon.svg"),
          ("POST", "/auth/login"), ("POST", "/auth/logout"), ("GET", "/auth/session"), ("GET", "/rpc"),
          ("GET", "/no-such-page"), ("HEAD", "/"), ("OPTIONS", "/rpc")]


async def _status(http, url: str, method: str, host: str, origin: str | None = None) -> int:
    headers = {"Host": host}
    if origin is not None:
        headers["Origin"] = origin
    async with http.request(method, url, headers=headers, allow_redirects=False) as r:
        await r.read()
        return r.status


async def test_r38_every_gateway_route_refuses_a_rebinding_host(http, gateway):
    good = f"127.0.0.1:{gateway.port}"
    for method, path in ROUTES:
        # Positive control: the same request with the gateway's own Host is answered by the route.
        assert await _status(http, gateway.url + path, method, good, gateway.origin) != 421, (method, path)
        for host in EVIL:
            h = host.format(port=gateway.port)
            status = await _status(http, gateway.url + path, method, h, f"http://{h}")
            assert status in (400, 421), (method, path, h, status)
    status, ws = await open_rpc(http, gateway, bearer=gateway.token, host="evil.example")
    assert status == 421 and ws is None
    status, ws = await open_rpc(http, gateway, bearer=gateway.token, host=good)     # control
    assert status == 101
    await ws.close()


async def test_r38_gateway_ops_endpoints_refuse_a_rebinding_host(http, gateway):
    base = f"http://127.0.0.1:{gateway.ops_port}"
    for path in ("/livez", "/readyz", "/metrics"):
        for good in (f"127.0.0.1:{gateway.ops_port}", "localhost", "127.0.0.1"):
            assert await _status(http, base + path, "GET", good) in (200, 503), (path, good)   # control
        for host in EVIL:
            assert await _status(http, base + path, "GET", host.format(port=gateway.ops_port)) == 421, (path, host)


@pytest.fixture
def strict_gateway(gw_layout, link_secret, scheduler):
    g = start_gateway(gw_layout, link_secret, extra=["--max-failed-logins", "3"])
    yield g
    g.stop()


async def test_r38_failed_bearer_tokens_are_rate_limited(http, strict_gateway):
    gw = strict_gateway
    status, ws = await open_rpc(http, gw, bearer=gw.token)         # control: the token works
    assert status == 101
    await ws.close()
    for i in range(3):
        status, _ = await open_rpc(http, gw, bearer=f"wrong-token-{i}")
        assert status == 401, i
    async with http.get(gw.ws_url.replace("ws", "http", 1), headers={
            "Authorization": "Bearer wrong-again", "Connection": "Upgrade", "Upgrade": "websocket",
            "Sec-WebSocket-Version": "13", "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}) as r:
        assert r.status == 429
        assert 1 <= int(r.headers["Retry-After"]) <= 61
        assert "wait" in (await r.json())["error"]
    # The limit holds for wrong logins from that address too (one limiter for the UI and CLI).
    assert (await login(http, gw, "wrong-login")).status == 429


async def test_r38_failed_logins_and_bearer_tokens_share_one_limiter(http, strict_gateway):
    gw = strict_gateway
    for _ in range(2):
        assert (await login(http, gw, "wrong")).status == 401
    assert (await open_rpc(http, gw, bearer="wrong"))[0] == 401
    status, ws = await open_rpc(http, gw, bearer="wrong-again")
    assert status == 429 and ws is None


@pytest.mark.browser
async def test_r38_wrong_host_gets_a_page_naming_the_url_to_open(gateway, http):
    """`localhost` is not the Host the gateway serves (R38: still 421, nothing of afe's), but a
    browser gets a page naming the URL, and an API client JSON with it."""
    from playwright.async_api import async_playwright

    from .test_browser import ARGS, CHROMIUM

    url = f"http://localhost:{gateway.port}/"
    async with http.get(gateway.url + "/", headers={"Host": f"localhost:{gateway.port}",
                                                     "Accept": "application/json"}) as r:
        assert r.status == 421 and r.content_type == "application/json"
        doc = await r.json()
        assert doc["url"] == gateway.url + "/" and gateway.url in doc["error"]
    async with http.get(gateway.url + "/static/app.js", headers={"Host": f"localhost:{gateway.port}",
                                                                  "Accept": "text/html,*/*"}) as r:
        body = await r.text()
        assert r.status == 421 and r.content_type == "text/html" and "import" not in body   # no file of afe's
    async with http.get(gateway.url + "/", headers={"Host": f"127.0.0.1:{gateway.port}"}) as r:
        assert r.status == 200 and "/static/app.js" in await r.text()                    # control: the right Host
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = await browser.new_page()
            resp = await page.goto(url)
            assert resp.status == 421
            assert await page.text_content("h1") == "afe is not served at this address"
            assert await page.get_attribute("a", "href") == gateway.url + "/"
            assert await page.text_content("a") == gateway.url + "/"
            await page.click("a")
            await page.wait_for_selector("#login-form")                  # the URL it names is afe's
        finally:
            await browser.close()
