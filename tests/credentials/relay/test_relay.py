"""The model relay's key-holding half (R32), on the host: the real RelayHub
serving a real Unix socket, a real fake model server speaking the four APIs
streamed and not. What the sandbox adds (mount, forwarder, no key in the
container) is tested in tests/sandbox/relays/test_r32_model_relay.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from services.common.config.model import Config, Model
from services.common.layout import Layout
from services.common.relayenv import RELAY_SOCKET
from services.common.secrecy.env_secrets import SecretValue
from services.common.secrecy.redact import Redactor
from services.credentials.relay.server import RelayHub, UsageMeter, usage_of
from tests.support.fakes.streaming import IN_TOKENS, OUT_TOKENS, FakeModelAPI

KEY = "sk-realkey-" + "R" * 32
KEY_ENV = "RELAY_TEST_KEY"


def _config(tmp: Path, url: str) -> Config:
    models = {
        "claude": Model("claude", "anthropic", model="claude-pinned", base_url=url, api_key_env=KEY_ENV),
        "gpt": Model("gpt", "openai", model="gpt-pinned", base_url=url + "/v1", api_key_env=KEY_ENV),
        "gem": Model("gem", "gemini", model="gemini-pinned", base_url=url, api_key_env=KEY_ENV),
        "other": Model("other", "anthropic", model="x", base_url=url, api_key_env=KEY_ENV),
    }
    return Config(directory=tmp, models=models)


@pytest.fixture
async def upstream():
    async with FakeModelAPI(KEY) as f:
        yield f


@pytest.fixture
async def hub(tmp_path, upstream):
    layout = Layout(tmp_path / "data", tmp_path / "run")
    layout.ensure()
    redactor = Redactor([KEY])
    h = RelayHub(_config(tmp_path, upstream.url), layout, {KEY_ENV: SecretValue(KEY_ENV, KEY)}, redactor,
                 state_dir=tmp_path / "data" / "credentials" / "relay", max_body=64 * 1024)
    yield h
    await h.aclose()


def _client(hub: RelayHub, ticket: str) -> aiohttp.ClientSession:
    sock = hub.layout.relay_dir(ticket) / RELAY_SOCKET
    return aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock)))


def _upstream_saw_capability(upstream: FakeModelAPI, cap: str) -> bool:
    return any(cap in repr(s.headers) or cap in s.path or cap in s.query or cap.encode() in s.body
               for s in upstream.seen)


ANTHROPIC = ("claude", "v1/messages", {"x-api-key": "{cap}", "anthropic-version": "2023-06-01"},
             {"model": "claude-other", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]})


async def test_anthropic_stream_passes_through_with_the_real_key_only(hub, upstream):
    cap = await hub.open("t1", ["claude"], 0)
    upstream.hold = asyncio.Event()
    async with _client(hub, "t1") as s, s.post("http://relay/m/claude/v1/messages",
                      headers={"x-api-key": cap, "anthropic-version": "2023-06-01",
                               "Cookie": f"c={cap}", "Authorization": f"Bearer {cap}"},
                      json={**ANTHROPIC[3], "stream": True}) as r:
        assert r.status == 200
        # The first event arrives while the server is parked after it: nothing buffers the answer.
        first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
        assert b"message_start" in first and upstream.parked.is_set()
        upstream.hold.set()
        rest = await r.read()
    assert rest.count(b"content_block_delta") == 8   # event: line + type field, 4 pieces
    seen = upstream.seen[-1]
    assert seen.headers.get("x-api-key") == KEY
    assert "Authorization" not in seen.headers and "Cookie" not in seen.headers
    assert json.loads(seen.body)["model"] == "claude-pinned"       # the Model fixes the model id
    assert not _upstream_saw_capability(upstream, cap)
    usage, _, is_open = hub.usage("t1")
    assert is_open and (usage["claude"].input_tokens, usage["claude"].output_tokens) == (IN_TOKENS, OUT_TOKENS)


@pytest.mark.parametrize("path,body,streamed", [
    ("v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}, True),
    ("v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, False),
    ("v1/responses", {"input": "hi", "stream": True}, True),
    ("v1/responses", {"input": "hi"}, False),
])
async def test_openai_chat_and_responses_count_usage(hub, upstream, path, body, streamed):
    cap = await hub.open("t2", ["gpt"], 0)
    async with _client(hub, "t2") as s, s.post(f"http://relay/m/gpt/{path}",
                                               headers={"Authorization": f"Bearer {cap}"}, json=body) as r:
        assert r.status == 200, await r.text()
        text = await r.text()
    assert ("data:" in text) == streamed
    sent = json.loads(upstream.seen[-1].body)
    assert sent["model"] == "gpt-pinned" and upstream.seen[-1].headers["Authorization"] == f"Bearer {KEY}"
    if streamed and path == "v1/chat/completions":
        assert sent["stream_options"] == {"include_usage": True}   # so the stream carries its usage
    usage, _, _ = hub.usage("t2")
    assert (usage["gpt"].input_tokens, usage["gpt"].output_tokens) == (IN_TOKENS, OUT_TOKENS)


@pytest.mark.parametrize("call,query", [("streamGenerateContent", "alt=sse&key={cap}"),
                                        ("streamGenerateContent", ""), ("generateContent", "")])
async def test_gemini_key_in_query_is_replaced_by_the_header(hub, upstream, call, query):
    cap = await hub.open("t3", ["gem"], 0)
    q = query.format(cap=cap)
    async with _client(hub, "t3") as s, s.post(
            f"http://relay/m/gem/v1beta/models/gemini-other:{call}" + (f"?{q}" if q else ""),
            headers={} if "key=" in q else {"x-goog-api-key": cap},
            json={"contents": [{"parts": [{"text": "hi"}]}]}) as r:
        assert r.status == 200, await r.text()
        await r.read()
    seen = upstream.seen[-1]
    assert seen.path == f"/v1beta/models/gemini-pinned:{call}"
    assert seen.headers["x-goog-api-key"] == KEY and "key=" not in seen.query
    assert not _upstream_saw_capability(upstream, cap)
    usage, _, _ = hub.usage("t3")
    assert (usage["gem"].input_tokens, usage["gem"].output_tokens) == (IN_TOKENS, OUT_TOKENS)


async def _post_anthropic(hub, ticket, cap, model="claude", path="v1/messages", body=None):
    async with _client(hub, ticket) as s:
        headers = {"anthropic-version": "2023-06-01"}
        if cap is not None:
            headers["x-api-key"] = cap
        async with s.post(f"http://relay/m/{model}/{path}", headers=headers,
                          data=json.dumps(body or ANTHROPIC[3])) as r:
            return r.status, await r.json()


async def test_r32_refusals_never_reach_the_upstream(hub, upstream):
    cap_a = await hub.open("ta", ["claude"], 0)
    cap_b = await hub.open("tb", ["claude"], 0)
    cases = [  # (what, ticket, capability, model, path, status)
        ("no capability", "ta", None, "claude", "v1/messages", 401),
        ("another ticket's capability", "ta", cap_b, "claude", "v1/messages", 401),
        ("a model the workflow did not declare", "ta", cap_a, "other", "v1/messages", 403),
        ("a model no manifest names", "ta", cap_a, "nope", "v1/messages", 403),
        ("an account endpoint, not inference", "ta", cap_a, "claude", "v1/files", 404),
    ]
    for what, ticket, cap, model, path, status in cases:
        got, body = await _post_anthropic(hub, ticket, cap, model, path)
        assert got == status, what
        assert body["error"]["message"].startswith("afe relay: "), what
        assert body.get("type") == ("error" if model != "nope" else None), what   # the provider's shape
    assert upstream.seen == []
    usage, _, _ = hub.usage("ta")
    assert usage["claude"].refused == 3          # refusals naming a declared model are counted for it
    # positive control: the same request with the ticket's own capability gets through
    assert (await _post_anthropic(hub, "ta", cap_a))[0] == 200
    assert len(upstream.seen) == 1


async def test_r32_body_over_the_limit_is_refused(hub, upstream):
    cap = await hub.open("tl", ["claude"], 0)
    big = {**ANTHROPIC[3], "messages": [{"role": "user", "content": "x" * (65 * 1024)}]}
    status, body = await _post_anthropic(hub, "tl", cap, body=big)
    assert status == 413 and "limit" in body["error"]["message"]
    assert upstream.seen == []


async def test_r32_budget_spent_is_refused_with_a_clear_error(hub, upstream):
    cap = await hub.open("tbud", ["claude"], IN_TOKENS + OUT_TOKENS + 1)
    assert (await _post_anthropic(hub, "tbud", cap))[0] == 200     # under budget: allowed
    assert (await _post_anthropic(hub, "tbud", cap))[0] == 200     # 29 of 30 used: still allowed
    status, body = await _post_anthropic(hub, "tbud", cap)
    assert status == 400 and "budget of 30 is spent" in body["error"]["message"]
    assert len(upstream.seen) == 2
    # raising the budget (OpenRelay again, as the scheduler does per node) lets it go on
    assert await hub.open("tbud", ["claude"], 1000) == cap
    assert (await _post_anthropic(hub, "tbud", cap))[0] == 200


@pytest.mark.slow
async def test_r32_ended_ticket_capability_is_refused(hub, upstream):
    cap = await hub.open("tend", ["claude"], 0)
    sock = hub.layout.relay_dir("tend") / RELAY_SOCKET
    # a connection opened while the ticket ran, kept alive across its end
    reader, writer = await asyncio.open_unix_connection(str(sock))
    t = hub.tickets["tend"]
    await hub.close("tend")
    assert not sock.exists() and not hub.layout.relay_dir("tend").exists()
    req = (f"POST /m/claude/v1/messages HTTP/1.1\r\nHost: r\r\nx-api-key: {cap}\r\n"
           f"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}").encode()
    with pytest.raises((ConnectionError, OSError, asyncio.IncompleteReadError)):
        writer.write(req)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 401"), head   # answered at all: refused
        raise ConnectionError("refused")
    writer.close()
    assert t.closed
    # the same ticket opened again gets a new capability; the old one is refused
    cap2 = await hub.open("tend", ["claude"], 0)
    assert cap2 != cap
    status, _body = await _post_anthropic(hub, "tend", cap)
    assert status == 401
    assert upstream.seen == []
    assert (await _post_anthropic(hub, "tend", cap2))[0] == 200      # positive control


async def test_r32_capability_and_usage_survive_a_broker_restart(tmp_path, hub, upstream):
    cap = await hub.open("trs", ["claude"], 500)
    assert (await _post_anthropic(hub, "trs", cap))[0] == 200
    await hub.aclose()                                  # the broker stops
    again = RelayHub(hub.config, hub.layout, hub.keys, hub.redactor, state_dir=hub.state_dir)
    try:
        assert await again.resume() == 1
        usage, budget, is_open = again.usage("trs")
        assert is_open and budget == 500 and usage["claude"].total == IN_TOKENS + OUT_TOKENS
        assert (await _post_anthropic(again, "trs", cap))[0] == 200
    finally:
        await again.aclose()


async def test_upstream_errors_pass_through_redacted(hub, upstream):
    cap = await hub.open("terr", ["claude"], 0)
    upstream.fail_next(429, json.dumps({"type": "error", "error": {"type": "rate_limit_error",
                                                                   "message": f"slow down {KEY}"}}),
                       headers={"retry-after": "3"})
    async with _client(hub, "terr") as s, s.post("http://relay/m/claude/v1/messages",
                                                 headers={"x-api-key": cap}, json=ANTHROPIC[3]) as r:
        assert r.status == 429 and r.headers["retry-after"] == "3"
        text = await r.text()
    assert KEY not in text and "slow down" in text


async def test_unreachable_upstream_is_a_clear_error(tmp_path):
    layout = Layout(tmp_path / "data", tmp_path / "run")
    layout.ensure()
    cfg = _config(tmp_path, "http://127.0.0.1:9")      # discard port: nothing listens
    h = RelayHub(cfg, layout, {KEY_ENV: SecretValue(KEY_ENV, KEY)}, Redactor([KEY]), state_dir=tmp_path / "st")
    try:
        cap = await h.open("tu", ["claude"], 0)
        status, body = await _post_anthropic(h, "tu", cap)
        assert status == 502 and "could not reach model 'claude'" in body["error"]["message"]
    finally:
        await h.aclose()


def test_usage_meter_reads_every_shape_split_anywhere():
    events = [(b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":5,'
              b'"cache_read_input_tokens":2,"output_tokens":1}}}\n\n'),
              b'data: {"type":"message_delta","usage":{"output_tokens":9}}\n\n']
    stream = b"".join(events)
    for cut in range(len(stream)):
        m = UsageMeter(sse=True)
        m.feed(stream[:cut])
        m.feed(stream[cut:])
        assert m.finish() == (7, 9)
    assert usage_of({"usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 4, "thoughtsTokenCount": 1}}) == (3, 5)
    assert usage_of({"type": "response.completed", "response": {"usage": {"input_tokens": 1, "output_tokens": 2}}}) == (1, 2)
    assert usage_of({"usage": {"prompt_tokens": 1, "completion_tokens": 2}}) == (1, 2)
    assert usage_of({"choices": []}) is None
