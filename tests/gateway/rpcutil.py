"""Small client helpers for gateway tests."""

from __future__ import annotations

import itertools
import json

import aiohttp

_ids = itertools.count(1)


async def open_rpc(session: aiohttp.ClientSession, gw, *, bearer: str | None = None,
                   cookie: str | None = None, origin: str | None = None, host: str | None = None,
                   query: str = ""):
    """Open /rpc; return (status, ws). status is 101 on success."""
    headers = {}
    if bearer is not None:
        headers["Authorization"] = f"Bearer {bearer}"
    if cookie is not None:
        headers["Cookie"] = f"afe_session={cookie}"
    if origin is not None:
        headers["Origin"] = origin
    if host is not None:
        headers["Host"] = host
    try:
        ws = await session.ws_connect(gw.ws_url + query, headers=headers)
    except aiohttp.WSServerHandshakeError as exc:
        return exc.status, None
    return 101, ws


async def call(ws, method: str, params=None, *, timeout: float = 30) -> dict:
    """Send one request; return the response object (skipping notifications)."""
    rid = next(_ids)
    msg = {"jsonrpc": "2.0", "id": rid, "method": method}
    if params is not None:
        msg["params"] = params
    await ws.send_str(json.dumps(msg))
    while True:
        m = await ws.receive(timeout=timeout)
        if m.type != aiohttp.WSMsgType.TEXT:
            raise AssertionError(f"socket ended: {m.type} {m.data} {m.extra}")
        doc = json.loads(m.data)
        if doc.get("id") == rid:
            return doc


async def result(ws, method: str, params=None) -> dict:
    doc = await call(ws, method, params)
    assert "error" not in doc, doc
    return doc["result"]


async def login(session: aiohttp.ClientSession, gw, token, *, origin: str | None = "default",
                host: str | None = None):
    headers = {"Content-Type": "application/json"}
    if origin == "default":
        origin = gw.origin
    if origin is not None:
        headers["Origin"] = origin
    if host is not None:
        headers["Host"] = host
    return await session.post(gw.url + "/auth/login", data=json.dumps({"token": token}), headers=headers)


def cookie_of(resp) -> str:
    header = resp.headers["Set-Cookie"]
    return header.split(";", 1)[0].split("=", 1)[1]
