"""The scripted model servers of test_real_agents.py answer in the shapes
the providers document: every streamed event, and every JSON answer, is
validated against the official SDKs' typed API descriptions (the
`anthropic`, `openai` and `google-genai` Python packages:
`RawMessageStreamEvent`, `Message`, `MessageTokensCount`,
`ResponseStreamEvent`, `Response`, `GenerateContentResponse` (which
refuses unknown fields), `CountTokensResponse`).
The script itself: edit, then the tests, then a text answer, by the number
of tool results in the conversation; a request without the agent's tools
gets text; a wrong key gets the provider's 401."""

from __future__ import annotations

import json
import typing

import aiohttp
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from google.genai.types import CountTokensResponse, GenerateContentResponse
from openai.types.responses import Response, ResponseStreamEvent

from tests.agents.scripted_models import (
    BUGGY_SOURCE,
    FINAL_TEXT,
    FIXED_SOURCE,
    PATCH,
    TEST_COMMAND,
    ScriptedAnthropic,
    ScriptedGemini,
    ScriptedResponses,
)

KEY = "sk-test-scripted-key"


def _by_type(union) -> dict:
    """type literal -> model class, for a union of event models (validated one
    by one: the SDK's union carries no discriminator pydantic can use)."""
    while typing.get_origin(union) is typing.Annotated:
        union = typing.get_args(union)[0]
    return {typing.get_args(c.model_fields["type"].annotation)[0]: c for c in typing.get_args(union)}


ANTHROPIC_EVENTS = _by_type(RawMessageStreamEvent)
RESPONSES_EVENTS = _by_type(ResponseStreamEvent)


async def sse(resp: aiohttp.ClientResponse) -> list[tuple[str, dict]]:
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events, name = [], ""
    for line in (await resp.text()).splitlines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            doc = json.loads(line[len("data: "):])
            assert doc["type"] == name, (name, doc)
            events.append((name, doc))
    return events


def anthropic_body(results: int, tools=("mcp__acp__Edit", "mcp__acp__Bash"), stream: bool = True) -> dict:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Fix the failing test"}]}]
    for i in range(results):
        messages.append({"role": "assistant", "content": [
            {"type": "tool_use", "id": f"toolu_{i}", "name": tools[i % len(tools)], "input": {}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": [{"type": "text", "text": "ok"}]}]})
    return {"model": "claude-sonnet-4-5", "max_tokens": 1024, "stream": stream, "messages": messages,
            "tools": [{"name": t, "input_schema": {"type": "object"}} for t in tools]}


def anthropic_turn(events: list[tuple[str, dict]]) -> tuple[list[dict], str]:
    """The content blocks and stop reason a client assembles from the stream."""
    parsed = [ANTHROPIC_EVENTS[doc["type"]].model_validate(doc) for _, doc in events]
    assert parsed[0].type == "message_start" and parsed[-1].type == "message_stop"
    blocks: list[dict] = []
    stop = ""
    partial: dict[int, str] = {}
    for e in parsed:
        if e.type == "content_block_start":
            blocks.append(e.content_block.model_dump())
            partial[e.index] = ""
        elif e.type == "content_block_delta":
            if e.delta.type == "input_json_delta":
                partial[e.index] += e.delta.partial_json
            else:
                blocks[e.index]["text"] += e.delta.text
        elif e.type == "content_block_stop" and blocks[e.index]["type"] == "tool_use":
            blocks[e.index]["input"] = json.loads(partial[e.index])
        elif e.type == "message_delta":
            stop = e.delta.stop_reason
    return blocks, stop


async def test_anthropic_script_streams_documented_events():
    async with ScriptedAnthropic(KEY) as server, aiohttp.ClientSession() as http:
        headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
        turns = []
        for results in range(3):
            async with http.post(server.url + "/v1/messages?beta=true", json=anthropic_body(results),
                                 headers=headers) as resp:
                turns.append(anthropic_turn(await sse(resp)))
        (edit, stop0), (bash, stop1), (text, stop2) = turns
        assert (stop0, stop1, stop2) == ("tool_use", "tool_use", "end_turn")
        assert edit[0]["name"] == "mcp__acp__Edit" and edit[0]["input"] == {
            "file_path": "/workspace/calc.py", "old_string": BUGGY_SOURCE, "new_string": FIXED_SOURCE}
        assert bash[0]["name"] == "mcp__acp__Bash" and bash[0]["input"]["command"] == TEST_COMMAND
        assert text == [{"type": "text", "text": FINAL_TEXT, "citations": None}]
        assert server.steps == [0, 1, 2]

        # a side request (no agent tools: a title, a quota probe), streamed and not
        async with http.post(server.url + "/v1/messages", json=anthropic_body(0, tools=()), headers=headers) as resp:
            blocks, stop = anthropic_turn(await sse(resp))
            assert blocks[0]["type"] == "text" and stop == "end_turn"
        async with http.post(server.url + "/v1/messages", json=anthropic_body(0, tools=(), stream=False),
                             headers=headers) as resp:
            Message.model_validate(await resp.json())
        async with http.post(server.url + "/v1/messages/count_tokens", json=anthropic_body(0),
                             headers=headers) as resp:
            MessageTokensCount.model_validate(await resp.json())
        assert server.steps == [0, 1, 2]          # side requests are not steps

        async with http.post(server.url + "/v1/messages", json=anthropic_body(0),
                             headers={"x-api-key": "afe-relay-not-the-key"}) as resp:
            assert resp.status == 401 and (await resp.json())["error"]["type"] == "authentication_error"
        assert [server.authorized_seen(s) for s in server.seen] == [True] * 6 + [False]


async def test_anthropic_script_for_opencode_tools_reads_first():
    """opencode's own tools: read, then edit (it refuses an edit of a file not read), then bash."""
    async with ScriptedAnthropic(KEY) as server, aiohttp.ClientSession() as http:
        tools = ("bash", "edit", "read", "write", "glob")
        calls = []
        for results in range(4):
            async with http.post(server.url + "/v1/messages", json=anthropic_body(results, tools=tools),
                                 headers={"x-api-key": KEY}) as resp:
                blocks, stop = anthropic_turn(await sse(resp))
                calls.append((blocks[0].get("name"), blocks[0].get("input"), stop))
        assert calls == [
            ("read", {"filePath": "/workspace/calc.py"}, "tool_use"),
            ("edit", {"filePath": "/workspace/calc.py", "oldString": BUGGY_SOURCE, "newString": FIXED_SOURCE},
             "tool_use"),
            ("bash", {"command": TEST_COMMAND, "timeout": 60000, "description": "Run the unit tests"}, "tool_use"),
            (None, None, "end_turn")]
        assert (server.edit_step, server.shell_step) == (1, 2)


def responses_body(results: int, tools: list[dict] | None = None, stream: bool = True) -> dict:
    items: list[dict] = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix"}]}]
    for i in range(results):
        items.append({"type": "custom_tool_call_output" if i == 0 else "function_call_output",
                      "call_id": f"call_{i}", "output": "ok"})
    if tools is None:
        tools = [{"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
                 {"type": "custom", "name": "apply_patch",
                  "format": {"type": "grammar", "syntax": "lark", "definition": "start: /(.|\\n)+/"}}]
    return {"model": "gpt-5-codex", "instructions": "You are Codex", "input": items, "tools": tools,
            "stream": stream}


def responses_turn(events: list[tuple[str, dict]]) -> list[dict]:
    parsed = [RESPONSES_EVENTS[doc["type"]].model_validate(doc) for _, doc in events]
    assert parsed[0].type == "response.created" and parsed[-1].type == "response.completed"
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    done = [e.item.model_dump(exclude_none=True) for e in parsed if e.type == "response.output_item.done"]
    assert [o.model_dump(exclude_none=True) for o in parsed[-1].response.output] == done
    assert parsed[-1].response.usage.total_tokens > 0
    return done


async def test_responses_script_streams_documented_events():
    async with ScriptedResponses(KEY) as server, aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {KEY}"}
        turns = []
        for results in range(3):
            async with http.post(server.url + "/v1/responses", json=responses_body(results), headers=headers) as resp:
                turns.append(responses_turn(await sse(resp)))
        (patch,), (shell,), (text,) = turns
        assert patch["type"] == "custom_tool_call" and patch["name"] == "apply_patch" and patch["input"] == PATCH
        assert shell["type"] == "function_call" and shell["name"] == "exec_command"
        assert json.loads(shell["arguments"])["cmd"] == TEST_COMMAND
        assert text["type"] == "message" and text["content"][0]["text"] == FINAL_TEXT

        # older Codex tool sets: apply_patch as a function, `shell` with an argv
        old = [{"type": "function", "name": "shell", "parameters": {"type": "object"}},
               {"type": "function", "name": "apply_patch", "parameters": {"type": "object"}}]
        async with http.post(server.url + "/v1/responses", json=responses_body(0, old), headers=headers) as resp:
            (call,) = responses_turn(await sse(resp))
            assert call["name"] == "apply_patch" and json.loads(call["arguments"]) == {"input": PATCH}
        async with http.post(server.url + "/v1/responses", json=responses_body(1, old), headers=headers) as resp:
            (call,) = responses_turn(await sse(resp))
            assert call["name"] == "shell" and json.loads(call["arguments"])["command"][-1] == TEST_COMMAND

        async with http.post(server.url + "/v1/responses", json=responses_body(0, [], stream=False),
                             headers=headers) as resp:
            Response.model_validate(await resp.json())
        async with http.post(server.url + "/v1/responses", json=responses_body(0),
                             headers={"Authorization": "Bearer afe-relay-not-the-key"}) as resp:
            assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"


def gemini_body(results: int, tools=("replace", "run_shell_command", "read_file")) -> dict:
    contents = [{"role": "user", "parts": [{"text": "Fix the failing test"}]}]
    for i in range(results):
        contents.append({"role": "model", "parts": [{"functionCall": {"name": tools[i % 2], "args": {}}}]})
        contents.append({"role": "user", "parts": [{"functionResponse": {"name": tools[i % 2],
                                                                         "response": {"output": "ok"}}}]})
    return {"contents": contents, "tools": [{"functionDeclarations": [{"name": t} for t in tools]}]}


async def test_gemini_script_answers_documented_chunks():
    async with ScriptedGemini(KEY) as server, aiohttp.ClientSession() as http:
        headers = {"x-goog-api-key": KEY}
        url = server.url + "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse"
        parts = []
        for results in range(3):
            async with http.post(url, json=gemini_body(results), headers=headers) as resp:
                assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
                chunks = [GenerateContentResponse.model_validate(json.loads(line[len("data: "):]))
                          for line in (await resp.text()).splitlines() if line.startswith("data: ")]
                parts += [p for c in chunks for p in c.candidates[0].content.parts]
                assert chunks[-1].usage_metadata.total_token_count > 0
        edit, shell, text = parts
        assert edit.function_call.name == "replace" and edit.function_call.args["new_string"] == FIXED_SOURCE
        assert shell.function_call.name == "run_shell_command" and shell.function_call.args["command"] == TEST_COMMAND
        assert text.text == FINAL_TEXT
        assert server.steps == [0, 1, 2]

        # side requests: the model router and the next-speaker check get the JSON their schema asks for
        base = server.url + "/v1beta/models/gemini-2.5-pro:"
        for prop, want in (("complexity_score", 20), ("next_speaker", "user")):
            body = {"contents": [{"role": "user", "parts": [{"text": "?"}]}], "generationConfig": {
                "responseMimeType": "application/json",
                "responseJsonSchema": {"type": "OBJECT", "properties": {prop: {"type": "STRING"}}}}}
            async with http.post(base + "generateContent", json=body, headers=headers) as resp:
                answer = GenerateContentResponse.model_validate(await resp.json())
                assert json.loads(answer.candidates[0].content.parts[0].text)[prop] == want
        async with http.post(base + "countTokens", json=gemini_body(0), headers=headers) as resp:
            CountTokensResponse.model_validate(await resp.json())
        assert server.steps == [0, 1, 2]
        async with http.post(url, json=gemini_body(0), headers={"x-goog-api-key": "afe-relay-x"}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["status"] == "INVALID_ARGUMENT"


@pytest.mark.parametrize("cls", [ScriptedAnthropic, ScriptedResponses])
async def test_every_answer_is_recorded_with_its_step(cls):
    """`on_step` runs before each scripted answer (the test inspects the sandbox there)."""
    calls = []

    async def on_step(step: int) -> None:
        calls.append(step)

    async with cls(KEY) as server, aiohttp.ClientSession() as http:
        server.on_step = on_step
        if cls is ScriptedAnthropic:
            url, body, headers = "/v1/messages", anthropic_body(1), {"x-api-key": KEY}
        else:
            url, body, headers = "/v1/responses", responses_body(1), {"Authorization": f"Bearer {KEY}"}
        async with http.post(server.url + url, json=body, headers=headers) as resp:
            await resp.read()
        assert calls == [1] and server.steps == [1]
