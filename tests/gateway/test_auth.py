"""R20-R22: login, the session cookie, the /rpc handshake, rotation, logs."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import aiohttp
import pytest

from gateway import cookies
from services.common.secrecy.tokenfile import write_token_file

from .conftest import start_gateway
from .rpcutil import cookie_of, login, open_rpc, result

pytestmark = pytest.mark.timeout(60)

# Every secret value the run handled; the log test at the end looks for them.
SEEN_SECRETS: set[str] = set()

COOKIE_RE = re.compile(r"^afe_session=[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+; HttpOnly; Max-Age=43200; Path=/; "
                       r"SameSite=Strict$")


async def _cookie(http, gateway) -> str:
    resp = await login(http, gateway, gateway.token)
    assert resp.status == 200
    value = cookie_of(resp)
    SEEN_SECRETS.update({value, gateway.token})
    return value


async def test_r21_login_sets_cookie_with_exact_attributes(http, gateway):
    resp = await login(http, gateway, gateway.token)
    assert resp.status == 200
    assert COOKIE_RE.match(resp.headers["Set-Cookie"]), resp.headers["Set-Cookie"]
    assert "Secure" not in resp.headers["Set-Cookie"]  # plain-http public URL
    SEEN_SECRETS.add(cookie_of(resp))
    who = await http.get(gateway.url + "/auth/session", headers={"Cookie": resp.headers["Set-Cookie"]
                                                                 .split(";")[0]})
    assert who.status == 200


def _bad_tokens(token: str) -> list[tuple[str, object]]:
    same_len = ("A" if token[0] != "A" else "B") + token[1:]
    return [
        ("wrong", "not-the-token"),
        ("same-length wrong", same_len),
        ("non-ASCII", "é" * len(token)),
        ("non-ASCII same bytes length", "é" * (len(token) // 2)),
        ("lone surrogate", "\ud800" + token[1:]),
        ("empty", ""),
        ("token with trailing space", token + " "),
        ("not a string", 12345),
        ("null", None),
    ]


async def test_r20_bad_tokens_are_401_never_500(http, gateway):
    token = gateway.token
    for name, bad in _bad_tokens(token):
        body = json.dumps({"token": bad})
        resp = await http.post(gateway.url + "/auth/login", data=body,
                               headers={"Content-Type": "application/json", "Origin": gateway.origin})
        assert resp.status == 401, name
        assert "Set-Cookie" not in resp.headers, name
    for name, raw, ctype in [("no body", b"", "application/json"),
                             ("broken JSON", b"{", "application/json"),
                             ("invalid UTF-8", b'{"token": "\xff\xfe"}', "application/json"),
                             ("JSON list", b"[]", "application/json"),
                             ("form, wrong", b"token=nope", "application/x-www-form-urlencoded"),
                             ("text/plain", token.encode(), "text/plain")]:
        resp = await http.post(gateway.url + "/auth/login", data=raw,
                               headers={"Content-Type": ctype, "Origin": gateway.origin})
        assert resp.status == 401, name
    # Positive control: the same request shape with the right token logs in.
    ok = await login(http, gateway, token)
    assert ok.status == 200
    form = await http.post(gateway.url + "/auth/login", data=f"token={token}".encode(),
                           headers={"Content-Type": "application/x-www-form-urlencoded",
                                    "Origin": gateway.origin})
    assert form.status == 200


async def test_r20_login_from_a_foreign_origin_is_refused(http, gateway):
    port = gateway.port
    for origin in [None, "null", "http://evil.example", f"http://evil.example:{port}",
                   f"http://127.0.0.1:{port + 1}", f"https://127.0.0.1:{port}", f"http://localhost:{port}"]:
        resp = await login(http, gateway, gateway.token, origin=origin)
        assert resp.status == 403, origin
        assert "Set-Cookie" not in resp.headers
    assert (await login(http, gateway, gateway.token)).status == 200  # control


async def test_r20_failed_logins_are_rate_limited_per_client(http, gw_layout, link_secret, scheduler):
    g = start_gateway(gw_layout, link_secret, extra=["--max-failed-logins", "3"])
    try:
        assert (await login(http, g, g.token)).status == 200  # control: allowed before the limit
        for _ in range(3):
            assert (await login(http, g, "wrong-token-xxxxxxxx")).status == 401
        limited = await login(http, g, "wrong-token-xxxxxxxx")
        assert limited.status == 429
        assert int(limited.headers["Retry-After"]) >= 1
        assert (await login(http, g, "wrong-token-yyyyyyyy")).status == 429
        # The right token still logs in from that address (R40: no lockout of the owner).
        assert (await login(http, g, g.token)).status == 200
    finally:
        g.stop()


async def test_r22_cookie_is_accepted_only_from_our_origin(http, gateway):
    value = await _cookie(http, gateway)
    status, ws = await open_rpc(http, gateway, cookie=value, origin=gateway.origin)
    assert status == 101  # control
    assert (await result(ws, "session.info"))["principal"] == "ui"
    await ws.close()
    port = gateway.port
    for origin in [None, "null", "http://evil.example", f"http://127.0.0.1:{port + 1}",
                   f"https://127.0.0.1:{port}", f"http://localhost:{port}", gateway.origin + "/",
                   gateway.origin.upper()]:
        status, ws = await open_rpc(http, gateway, cookie=value, origin=origin)
        assert status == 403, origin
        assert ws is None


async def test_r20_forged_and_stale_cookies_are_rejected(http, gateway):
    token = gateway.token
    key = cookies.derive_key(token)
    good = cookies.sign(key)
    # Control: a cookie this test signs under the right key is accepted, so
    # the rejections below are about the defects, not about forging at all.
    status, ws = await open_rpc(http, gateway, cookie=good, origin=gateway.origin)
    assert status == 101
    await ws.close()
    head, mac = good.split(".")
    payload = json.loads(cookies._unb64(head))
    longer = cookies._b64(json.dumps({**payload, "exp": payload["exp"] + 10**6}).encode())
    flipped = mac[:-2] + ("AA" if mac[-2:] != "AA" else "BB")
    cases = {
        "tampered payload": f"{longer}.{mac}",
        "tampered mac": f"{head}.{flipped}",
        "truncated": good[:-5],
        "payload only": head,
        "expired": cookies.sign(key, now=time.time() - 7200, ttl=3600),
        "issued in the future": cookies.sign(key, now=time.time() + 3600),
        "old key": cookies.sign(cookies.derive_key("an-older-token-value-0123456789")),
        "garbage": "x" * 40,
        "empty": "",
    }
    SEEN_SECRETS.update(v for v in cases.values() if len(v) > 20)
    for name, value in cases.items():
        status, ws = await open_rpc(http, gateway, cookie=value, origin=gateway.origin)
        assert status == 401, name
        who = await http.get(gateway.url + "/auth/session", headers={"Cookie": f"afe_session={value}"})
        assert who.status == 401, name


async def test_r22_cookie_is_not_a_bearer_and_the_token_is_not_a_cookie(http, gateway):
    value = await _cookie(http, gateway)
    status, _ = await open_rpc(http, gateway, bearer=value)
    assert status == 401
    status, _ = await open_rpc(http, gateway, cookie=gateway.token, origin=gateway.origin)
    assert status == 401
    # Controls: each credential works in its own place.
    status, ws = await open_rpc(http, gateway, bearer=gateway.token)
    assert status == 101
    assert (await result(ws, "session.info"))["principal"] == "cli"
    await ws.close()
    status, ws = await open_rpc(http, gateway, cookie=value, origin=gateway.origin)
    assert status == 101
    await ws.close()


async def test_r22_bearer_checks(http, gateway):
    for bad in ["", "wrong-token", gateway.token[:-1], gateway.token + "x", "é" * len(gateway.token)]:
        status, _ = await open_rpc(http, gateway, bearer=bad)
        assert status in (400, 401), bad
    # A bearer request that a page on another origin tries to make is refused.
    status, _ = await open_rpc(http, gateway, bearer=gateway.token, origin="http://evil.example")
    assert status == 403
    resp = await http.get(gateway.ws_url, headers={"Authorization": f"Basic {gateway.token}",
                                                   "Upgrade": "websocket", "Connection": "Upgrade"})
    assert resp.status == 401


async def test_r22_token_in_the_query_string_is_refused(http, gateway):
    for q in [f"?token={gateway.token}", f"?access_token={gateway.token}", "?x=1"]:
        status, _ = await open_rpc(http, gateway, query=q)
        assert status == 400, q
        status, _ = await open_rpc(http, gateway, bearer=gateway.token, query=q)
        assert status == 400, q
    status, ws = await open_rpc(http, gateway, bearer=gateway.token)  # control
    assert status == 101
    await ws.close()


async def test_r22_unknown_host_is_refused_dns_rebinding(http, gateway):
    value = await _cookie(http, gateway)
    port = gateway.port
    for host in [f"evil.example:{port}", "evil.example", f"localhost:{port}", f"127.0.0.1:{port + 1}", ""]:
        status, _ = await open_rpc(http, gateway, bearer=gateway.token, host=host)
        assert status in (400, 421), host
        status, _ = await open_rpc(http, gateway, cookie=value, origin=f"http://{host}", host=host)
        assert status in (400, 421), host
        page = await http.get(gateway.url + "/", headers={"Host": host})
        assert page.status in (400, 421), host
        assert (await login(http, gateway, gateway.token, origin=f"http://{host}", host=host)).status \
            in (400, 421)
    status, ws = await open_rpc(http, gateway, bearer=gateway.token, host=f"127.0.0.1:{port}")  # control
    assert status == 101
    await ws.close()


async def test_security_headers_on_every_response(http, gateway):
    for method, path in [("GET", "/"), ("GET", "/static/app.js"), ("GET", "/nope"), ("POST", "/auth/login"),
                         ("GET", "/rpc"), ("GET", "/static/../main.py")]:
        resp = await http.request(method, gateway.url + path, headers={"Origin": gateway.origin})
        csp = resp.headers.get("Content-Security-Policy", "")
        assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp, path
        assert "unsafe-inline" not in csp
        assert resp.headers.get("X-Content-Type-Options") == "nosniff", path
    leak = await http.get(gateway.url + "/static/../main.py")
    assert leak.status == 404 or "take_secret_env" not in await leak.text()


async def test_r21_https_public_url_adds_secure(http, gw_layout, link_secret, scheduler):
    g = start_gateway(gw_layout, link_secret, public_url="https://afe.test")
    try:
        resp = await login(http, g, g.token, origin="https://afe.test", host="afe.test")
        assert resp.status == 200
        assert resp.headers["Set-Cookie"].endswith("; SameSite=Strict; Secure")
        SEEN_SECRETS.add(cookie_of(resp))
    finally:
        g.stop()


async def test_r21_logout_clears_the_cookie(http, gateway):
    resp = await http.post(gateway.url + "/auth/logout", headers={"Origin": gateway.origin})
    assert resp.status == 200
    assert resp.headers["Set-Cookie"] == "afe_session=; HttpOnly; Max-Age=0; Path=/; SameSite=Strict"
    assert (await http.post(gateway.url + "/auth/logout", headers={"Origin": "http://evil.example"})).status \
        == 403


async def test_r21_rotation_ends_every_session_and_closes_sockets(http, gateway):
    old_token = gateway.token
    value = await _cookie(http, gateway)
    _, ws_cookie = await open_rpc(http, gateway, cookie=value, origin=gateway.origin)
    _, ws_bearer = await open_rpc(http, gateway, bearer=old_token)
    assert (await result(ws_cookie, "session.info"))["principal"] == "ui"
    assert (await result(ws_bearer, "session.info"))["principal"] == "cli"

    new_token = write_token_file(gateway.token_file)
    SEEN_SECRETS.add(new_token)

    for ws in (ws_cookie, ws_bearer):
        msg = await ws.receive(timeout=20)
        # The server's close frame carries 4401 (the client's own reply may
        # race the server closing the transport, so check the frame itself).
        assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 4401, msg
    status, _ = await open_rpc(http, gateway, cookie=value, origin=gateway.origin)
    assert status == 401
    assert (await http.get(gateway.url + "/auth/session", headers={"Cookie": f"afe_session={value}"})).status \
        == 401
    status, _ = await open_rpc(http, gateway, bearer=old_token)
    assert status == 401
    assert (await login(http, gateway, old_token)).status == 401
    # The new token works at once, for both kinds of session.
    new_cookie = await _cookie(http, gateway)
    status, ws = await open_rpc(http, gateway, cookie=new_cookie, origin=gateway.origin)
    assert status == 101
    await ws.close()
    status, ws = await open_rpc(http, gateway, bearer=new_token)
    assert status == 101
    await ws.close()


def test_r21_no_cookie_or_token_in_any_log_line(gateway):
    """Runs last in this module: every value handled above must be absent."""
    logs = gateway.logs()
    # Control: the log really was captured, at DEBUG, with the auth paths in it.
    assert "failed login from" in logs and "login from" in logs and "rpc handshake refused" in logs
    assert len(SEEN_SECRETS) >= 5
    for secret in SEEN_SECRETS:
        assert secret not in logs
        head = secret.split(".")[0]
        assert len(head) < 16 or head not in logs
    assert "afe_session=" not in logs and not re.search(r"Bearer [A-Za-z0-9_-]{8}", logs)


async def test_r28_token_from_the_environment_is_used_and_scrubbed(http, gw_layout, link_secret, scheduler):
    env_token = "env-token-" + "k" * 30
    g = start_gateway(gw_layout, link_secret, env={"AFE_UI_TOKEN": env_token})
    try:
        assert (await login(http, g, env_token)).status == 200
        assert (await login(http, g, g.token)).status == 401  # the file is not used when the env is set
        environ = Path(f"/proc/{g.proc.pid}/environ").read_bytes()
        assert env_token.encode() not in environ
    finally:
        g.stop()
    assert env_token not in g.logs()
