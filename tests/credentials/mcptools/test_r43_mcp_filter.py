"""R43, what the MCP relay lets through (services/credentials/mcptools/filter.py):
only granted `tools/call`s, whatever their spelling or batching; tool lists
cut to the grant; a body the server could read otherwise than the relay
(duplicated keys) refused, and what is sent is the relay's own
serialization. Each refusal has its positive control: the same message
with a granted tool passes, or the naive reading the check prevents."""

from __future__ import annotations

import json

import pytest

from services.credentials.mcptools.filter import (
    INVALID_PARAMS,
    METHOD_NOT_FOUND,
    PLAIN_TOOL,
    Malformed,
    SseReader,
    TooLarge,
    canonical_digest,
    check_request,
    filter_message,
    outcome,
    responses,
)

TOOLS = frozenset({"get_issue", "search_issues"})


def call(name, id_=1, args=None) -> dict:
    return {"jsonrpc": "2.0", "id": id_, "method": "tools/call",
            "params": {"name": name, "arguments": args if args is not None else {"number": 7}}}


def body(doc) -> bytes:
    return json.dumps(doc).encode()


def test_r43_a_granted_tool_call_passes_as_the_relays_own_serialization():
    c = check_request(body(call("get_issue", args={"number": 7, "b": [1, 2]})), TOOLS, "tracker")
    assert c.refusal is None and c.requests == ["1"]
    assert json.loads(c.forward) == call("get_issue", args={"number": 7, "b": [1, 2]})
    [noted] = c.calls
    assert noted.granted and noted.tool == "get_issue"
    # the digest is of the arguments as canonical JSON: the same arguments in another order, the same digest
    assert noted.arguments_sha256 == canonical_digest({"b": [1, 2], "number": 7})


@pytest.mark.parametrize("name", [
    "delete_issue", "Get_issue", "GET_ISSUE", "get_issue ", " get_issue", "get_issue\n", "get_issue\u0000",
    "tracker/get_issue", "tracker.get_issue", "mcp__tracker__get_issue", "mcp:tracker/get_issue",
    "\uff47et_issue", "get_i\u200bssue", "get_issue/../delete_issue", ["get_issue"], {"name": "get_issue"}, None, 7])
def test_r43_every_other_spelling_of_a_tool_is_refused(name):
    c = check_request(body(call(name)), TOOLS, "tracker")
    assert c.forward == b"" and c.requests == []
    assert c.refusal["id"] == 1 and c.refusal["error"]["code"] == INVALID_PARAMS
    assert "not granted" in c.refusal["error"]["message"]
    [noted] = c.calls
    assert not noted.granted
    # the name goes on the record only when it is a plain tool name; else only its digest does
    assert noted.tool == (name if isinstance(name, str) and PLAIN_TOOL.fullmatch(name) else "")
    # positive control: the granted name, spelled as the server spells it, passes
    assert check_request(body(call("get_issue")), TOOLS, "tracker").refusal is None


def test_r43_a_call_without_a_name_is_refused():
    c = check_request(body({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {}}), TOOLS, "tracker")
    assert c.refusal["error"]["code"] == INVALID_PARAMS


def test_r43_duplicated_keys_are_refused_so_the_server_cannot_read_another_tool():
    # A first-wins parser (the server's) reads delete_issue; Python's last-wins reads get_issue.
    raw = (b'{"jsonrpc":"2.0","id":1,"method":"tools/call",'
           b'"params":{"name":"delete_issue","name":"get_issue","arguments":{}}}')
    assert json.loads(raw)["params"]["name"] == "get_issue"      # the naive check would let it pass
    with pytest.raises(Malformed, match="twice"):
        check_request(raw, TOOLS, "tracker")
    raw2 = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","method":"tools/list","params":{}}'
    with pytest.raises(Malformed):
        check_request(raw2, TOOLS, "tracker")


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b"NaN", b'{"jsonrpc":"2.0","id":1,"method":"ping","x":NaN}',
                                 b'{"jsonrpc":"1.0","id":1,"method":"ping"}', b'"text"', b"\xff\xfe",
                                 b'{"jsonrpc":"2.0","id":true,"method":"ping"}', b"[" * 100_000 + b"]" * 100_000,
                                 b'{"jsonrpc":"2.0","id":1,"method":"ping","result":{}}'])
def test_r43_a_body_that_is_not_json_rpc_is_refused(raw):
    with pytest.raises(Malformed):
        check_request(raw, TOOLS, "tracker")


def test_r43_a_batch_with_one_refused_call_is_refused_whole():
    batch = [call("get_issue", 1), {"jsonrpc": "2.0", "method": "notifications/initialized"},
             call("delete_issue", "b"), {"jsonrpc": "2.0", "id": 9, "method": "tools/list"}]
    c = check_request(body(batch), TOOLS, "tracker")
    assert c.forward == b""                                         # nothing of it reaches the server
    answers = {json.dumps(a["id"]): a["error"] for a in c.refusal}
    assert set(answers) == {"1", '"b"', "9"}                         # every request answered, none dropped
    assert answers['"b"']["code"] == INVALID_PARAMS and "delete_issue" in answers['"b"']["message"]
    assert "send the others again" in answers["1"]["message"]
    assert [(n.tool, n.granted) for n in c.calls] == [("get_issue", False), ("delete_issue", False)]
    # positive control: the same batch without the refused call goes through
    ok = check_request(body([batch[0], batch[1], batch[3]]), TOOLS, "tracker")
    assert ok.refusal is None and ok.requests == ["1", "9"] and json.loads(ok.forward) == [batch[0], batch[1],
                                                                                           batch[3]]


@pytest.mark.parametrize("method", ["resources/read", "resources/list", "prompts/get", "completion/complete",
                                    "logging/setLevel", "sampling/createMessage", "TOOLS/CALL", "tools/call ",
                                    "tools/Call", "tools/list/../call", 5])
def test_r43_methods_other_than_tools_are_refused(method):
    c = check_request(body({"jsonrpc": "2.0", "id": 4, "method": method, "params": {"name": "delete_issue"}}),
                      TOOLS, "tracker")
    assert c.refusal["error"]["code"] == METHOD_NOT_FOUND and c.forward == b""
    assert c.calls == []      # not a tools/call: the server never sees it


def test_r43_an_unknown_notification_is_refused_and_a_known_one_passes():
    c = check_request(body({"jsonrpc": "2.0", "method": "notifications/tools/call"}), TOOLS, "tracker")
    assert c.status == 400 and c.refusal["id"] is None
    ok = check_request(body({"jsonrpc": "2.0", "method": "notifications/initialized"}), TOOLS, "tracker")
    assert ok.refusal is None and ok.requests == []


def test_r43_initialize_reaches_the_server_with_no_client_capability():
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "clientInfo": {"name": "agent", "version": "1"},
        "capabilities": {"sampling": {}, "roots": {"listChanged": True}, "elicitation": {}}}}
    c = check_request(body(init), TOOLS, "tracker")
    assert json.loads(c.forward)["params"]["capabilities"] == {}


def test_r43_tool_lists_keep_only_the_granted_tools_whatever_they_answer():
    listed = {"jsonrpc": "2.0", "id": 2, "result": {"tools": [
        {"name": "get_issue", "inputSchema": {}}, {"name": "delete_issue", "inputSchema": {}},
        {"name": "GET_ISSUE"}, {"name": ["get_issue"]}, "get_issue", {"name": "search_issues"}], "nextCursor": "c"}}
    out = filter_message(json.loads(json.dumps(listed)), TOOLS)
    assert [t["name"] for t in out["result"]["tools"]] == ["get_issue", "search_issues"]
    assert out["result"]["nextCursor"] == "c"
    # a tool list in any answer (a batch, a replayed stream with an id nobody asked) is cut the same
    assert filter_message([listed, {"jsonrpc": "2.0", "id": "x", "result": {"tools": listed["result"]["tools"]}}],
                          TOOLS)[1]["result"]["tools"] == [{"name": "get_issue", "inputSchema": {}},
                                                           {"name": "search_issues"}]
    init = {"jsonrpc": "2.0", "id": 0, "result": {"protocolVersion": "2025-06-18", "serverInfo": {"name": "t"},
                                                   "capabilities": {"tools": {"listChanged": True},
                                                                    "resources": {}, "prompts": {}, "logging": {}}}}
    assert filter_message(init, TOOLS)["result"]["capabilities"] == {"tools": {"listChanged": True}}


def test_outcome_of_answers():
    assert outcome({"id": 1, "result": {"content": []}}) == "ok"
    assert outcome({"id": 1, "result": {"content": [], "isError": True}}) == "tool_error"
    assert outcome({"id": 1, "error": {"code": -1, "message": "x"}}) == "error"
    assert [r["id"] for r in responses([{"id": 1, "result": {}}, {"id": 2, "method": "ping"}])] == [1]


def test_sse_reader_cuts_events_anywhere():
    stream = (b": comment\r\nid: 5\r\nevent: message\r\ndata: {\"a\":\r\ndata: 1}\r\n\r\n"
              b"data: {\"b\":2}\n\nretry: 300\rdata: {\"c\":3}\r\r")
    for cut in range(1, len(stream)):
        r = SseReader(1024)
        events = r.feed(stream[:cut]) + r.feed(stream[cut:]) + r.finish()
        assert [(e.id, e.event, e.data, e.retry) for e in events] == [
            ("5", "message", '{"a":\n1}', ""), (None, "", '{"b":2}', ""), (None, "", '{"c":3}', "300")], cut


def test_sse_reader_bounds_an_event():
    r = SseReader(100)
    with pytest.raises(TooLarge):
        r.feed(b"data: " + b"x" * 200)
    assert len(SseReader(100).feed(b"data: " + b"x" * 50 + b"\n\n")) == 1
