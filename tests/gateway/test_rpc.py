"""/rpc JSON-RPC: envelope and params validation, stable error codes, the
principal recorded per credential, watch subscriptions."""

from __future__ import annotations

import json

import aiohttp
import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb

from .conftest import start_gateway
from .rpcutil import call, cookie_of, login, open_rpc, result

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def ws(http, gateway):
    status, ws = await open_rpc(http, gateway, bearer=gateway.token)
    assert status == 101
    yield ws
    await ws.close()


async def _raw(ws, text: str) -> dict:
    await ws.send_str(text)
    m = await ws.receive(timeout=30)
    return json.loads(m.data)


async def test_envelope_errors_have_stable_codes(ws):
    cases = [
        ("{", -32700, "parse_error"),
        ("[]", -32600, "invalid_request"),
        ('"x"', -32600, "invalid_request"),
        ('{"id": 1, "method": "workflows.list"}', -32600, "invalid_request"),
        ('{"jsonrpc": "1.0", "id": 1, "method": "workflows.list"}', -32600, "invalid_request"),
        ('{"jsonrpc": "2.0", "method": "workflows.list"}', -32600, "invalid_request"),
        ('{"jsonrpc": "2.0", "id": true, "method": "workflows.list"}', -32600, "invalid_request"),
        ('{"jsonrpc": "2.0", "id": 1, "method": 5}', -32600, "invalid_request"),
        ('{"jsonrpc": "2.0", "id": 1, "method": "workflows.list", "extra": 1}', -32600, "invalid_request"),
        ('{"jsonrpc": "2.0", "id": 1, "method": "os.system"}', -32601, "method_not_found"),
        ('{"jsonrpc": "2.0", "id": 1, "method": "__init__"}', -32601, "method_not_found"),
    ]
    for text, code, name in cases:
        doc = await _raw(ws, text)
        assert doc["error"]["code"] == code, text
        assert doc["error"]["data"]["code"] == name, text
        assert "Traceback" not in doc["error"]["message"]


async def test_params_are_validated_with_messages_naming_the_field(ws):
    cases = [
        ("tickets.get", {}, "'id' is required"),
        ("tickets.get", {"id": "../etc"}, "'id' must be a ticket id"),
        ("tickets.get", {"id": 5}, "'id' must be a string"),
        ("tickets.get", {"id": "t1", "sql": "x"}, "unknown field(s) 'sql'"),
        ("tickets.get", ["t1"], "params must be an object"),
        ("tickets.create", {"workflow": "demo-fix"}, "'title' is required"),
        ("tickets.create", {"workflow": "demo-fix", "title": ""}, "'title' must not be empty"),
        ("tickets.create", {"workflow": "demo-fix", "title": "x" * 201}, "at most 200"),
        ("tickets.create", {"workflow": "demo-fix", "title": "t", "inputs": {"k": 1}}, "'inputs.k' must be"),
        ("tickets.create", {"workflow": "demo-fix", "title": "t", "inputs": []}, "'inputs' must be an object"),
        ("tickets.list", {"states": ["done"]}, "must be one of"),
        ("tickets.list", {"page_size": 0}, "at least 1"),
        ("tickets.list", {"page_size": True}, "must be an integer"),
        ("tickets.approve", {"id": "t1", "sha": "not-hex"}, "'sha' must be a hex commit SHA"),
        ("tickets.watch", {"id": "t1", "from_seq": -1}, "at least 0"),
        ("tickets.watch", {"id": "t1", "follow": "yes"}, "true or false"),
    ]
    for method, params, fragment in cases:
        doc = await call(ws, method, params)
        assert doc["error"]["code"] == -32602, (method, params, doc)
        assert doc["error"]["data"]["code"] == "invalid_params"
        assert fragment in doc["error"]["message"], (fragment, doc["error"]["message"])


async def test_scheduler_errors_map_to_stable_codes(ws):
    doc = await call(ws, "tickets.get", {"id": "no-such-ticket"})
    assert doc["error"]["code"] == -32001 and doc["error"]["data"]["code"] == "not_found"
    assert "no-such-ticket" in doc["error"]["message"]
    doc = await call(ws, "tickets.create", {"workflow": "nope", "title": "t"})
    assert doc["error"]["data"]["code"] == "not_found" and "known: demo-fix" in doc["error"]["message"]


async def test_methods_mirror_the_scheduler_and_record_the_principal(http, gateway, scheduler, ws):
    assert [w["name"] for w in (await result(ws, "workflows.list"))["workflows"]] == ["demo-fix"]
    spaces = (await result(ws, "workspaces.list"))["workspaces"]
    assert spaces[0]["name"] == "demo"
    # a github workspace names its repository (owner/name): `afe verify <PR URL>` finds it by that
    assert spaces[1]["forge_repo"] == "Octo/Calc" and spaces[0]["forge_repo"] == ""
    t = await result(ws, "tickets.create", {"workflow": "demo-fix", "title": "from cli", "inputs": {"k": "v"}})
    assert t["state"] == "queued" and t["inputs"] == {"k": "v"} and [n["id"] for n in t["nodes"]] == ["fix", "merge"]
    created = [c for n, c in scheduler.fake.calls if n == "CreateTicket"]
    assert created[-1].principal == "cli"

    resp = await login(http, gateway, gateway.token)
    _, uiws = await open_rpc(http, gateway, cookie=cookie_of(resp), origin=gateway.origin)
    t2 = await result(uiws, "tickets.create", {"workflow": "demo-fix", "title": "from ui"})
    scheduler.run(scheduler.fake.set_state, t2["id"], pb.TICKET_STATE_WAITING_APPROVAL)
    approved = await result(uiws, "tickets.approve", {"id": t2["id"], "sha": "abc1234"})
    assert approved["approval"]["principal"] == "ui" and approved["state"] == "succeeded"
    await uiws.close()
    assert [c for n, c in scheduler.fake.calls if n == "CreateTicket"][-1].principal == "ui"

    doc = await call(ws, "tickets.approve", {"id": t["id"]})
    assert doc["error"]["data"]["code"] == "failed_precondition"
    rejected = await result(ws, "tickets.reject", {"id": t["id"], "reason": "no"})
    assert rejected["approval"]["principal"] == "cli" and rejected["approval"]["reason"] == "no"
    listed = await result(ws, "tickets.list", {"states": ["failed"]})
    assert [x["id"] for x in listed["tickets"]] == [t["id"]]
    diff = await result(ws, "tickets.diff", {"id": t["id"]})
    assert diff["diff"].startswith("--- a/calc.py")


async def test_watch_streams_history_then_live_events_then_ends(scheduler, ws):
    t = await result(ws, "tickets.create", {"workflow": "demo-fix", "title": "watch me"})
    sub = (await result(ws, "tickets.watch", {"id": t["id"]}))["subscription"]
    first = json.loads((await ws.receive(timeout=30)).data)
    assert first["method"] == "tickets.event" and first["params"]["subscription"] == sub
    assert first["params"]["event"]["type"] == "ticket.created" and first["params"]["event"]["seq"] == 1
    scheduler.run(scheduler.fake.set_state, t["id"], pb.TICKET_STATE_CANCELLED)
    seen = []
    while True:
        doc = json.loads((await ws.receive(timeout=30)).data)
        if doc["method"] == "tickets.watch_end":
            assert doc["params"] == {"subscription": sub, "error": None}
            break
        seen.append(doc["params"]["event"]["type"])
    assert seen == ["ticket.state"]
    doc = await call(ws, "tickets.watch", {"id": "missing"})
    assert doc["error"]["data"]["code"] == "not_found"
    doc = await call(ws, "tickets.unwatch", {"subscription": "w99"})
    assert doc["error"]["data"]["code"] == "not_found"


async def test_scheduler_down_is_unavailable_not_a_traceback(http, tmp_path):
    from services.common.layout import Layout
    from services.common.secrecy.tokenfile import write_token_file

    lay = Layout(tmp_path / "data", tmp_path / "run")
    lay.ensure()
    write_token_file(lay.token_file)
    g = start_gateway(lay, b"\x00" * 32)
    try:
        _, ws = await open_rpc(http, g, bearer=g.token)
        doc = await call(ws, "workflows.list")
        assert doc["error"]["data"]["code"] == "unavailable"
        assert "not reachable" in doc["error"]["message"]
        await ws.close()
        ready = await http.get(f"http://127.0.0.1:{g.ops_port}/readyz")
        assert ready.status == 503 and (await ready.json())["failing"] == ["scheduler"]
    finally:
        g.stop()


async def test_binary_frames_are_refused(ws):
    await ws.send_bytes(b"\x00\x01")
    doc = json.loads((await ws.receive(timeout=30)).data)
    assert doc["error"]["data"]["code"] == "invalid_request"
    assert (await result(ws, "session.info"))["principal"] == "cli"


async def test_r25_metrics_have_bounded_labels_only(http, gateway, ws):
    await call(ws, "tickets.get", {"id": "metric-probe-ticket"})
    await call(ws, "no.such.method-xyz")
    text = await (await http.get(f"http://127.0.0.1:{gateway.ops_port}/metrics")).text()
    # Control: the counters exist and counted what this test did.
    assert 'afe_gateway_rpc_requests_total{method="tickets.get",outcome="not_found"}' in text
    assert 'afe_gateway_rpc_requests_total{method="invalid",outcome="method_not_found"}' in text
    assert 'afe_gateway_rpc_connections{principal="cli"}' in text
    assert "metric-probe-ticket" not in text and "no.such.method-xyz" not in text
    assert gateway.token not in text and "127.0.0.1" not in text


async def test_oversized_messages_close_the_socket_and_plain_get_is_refused(http, gateway):
    status, ws = await open_rpc(http, gateway, bearer=gateway.token)
    assert status == 101
    assert (await result(ws, "session.info"))["principal"] == "cli"  # control: a normal message works
    await ws.send_str(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tickets.create",
                                  "params": {"workflow": "demo-fix", "title": "t", "body": "x" * 400_000}}))
    msg = await ws.receive(timeout=30)
    assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    resp = await http.get(gateway.ws_url.replace("ws", "http", 1),
                          headers={"Authorization": f"Bearer {gateway.token}"})
    assert resp.status == 400
