"""Model servers of the tests' own that speak the real streaming APIs the
real coding agents call, and script their tool use by reading the
conversation so far: first edit calc.py, then (after that tool's result)
run `python3 -m unittest` with the agent's shell tool, then answer in text.

- `ScriptedAnthropic`: the Anthropic Messages API (`POST /v1/messages`,
  SSE `message_start`, `content_block_start` tool_use + `input_json_delta`,
  `message_delta` stop_reason `tool_use`, `message_stop`), as Claude Code
  (through @zed-industries/claude-code-acp) and opencode call it. Under ACP
  the adapter gives Claude Code the client's fs and terminal as MCP tools
  (`mcp__acp__Edit`, `mcp__acp__Bash`, ...) and disallows its built-in
  Edit/Write/Bash; opencode offers its own `read`/`edit`/`bash`. Requests
  without those tools (title generation, a quota probe, a haiku call) get a
  short text answer.
- `ScriptedResponses`: the OpenAI Responses API (`POST /v1/responses`, SSE
  `response.created`, `response.output_item.added` / `.done` with a
  `function_call` or `custom_tool_call`, `response.completed` with usage),
  as Codex (through @zed-industries/codex-acp) calls it with its
  `apply_patch` and shell tools.

Each checks the provider's key header against the real key and records
every request (`seen`), so a test can show the real key arrived and the
relay's capability never did. `on_step(n)` (a coroutine) runs before the
answer to main-loop step n, while the agent is alive and waiting: the
test inspects the sandbox there.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import ClassVar

from aiohttp import web

from tests.support.fakes.base import FakeServer

FIXED_SOURCE = "return a + b"
BUGGY_SOURCE = "return a - b"
TEST_COMMAND = "python3 -m unittest"
FINAL_TEXT = "Fixed add() in calc.py; the tests pass."
IN_TOKENS = 120
OUT_TOKENS = 30

PATCH = f"""*** Begin Patch
*** Update File: calc.py
@@ def add(a, b):
-    {BUGGY_SOURCE}
+    {FIXED_SOURCE}
*** End Patch
"""


def _sse(name: str, doc: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(doc)}\n\n".encode()


class Scripted(FakeServer):
    header = ""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key
        self.steps: list[int] = []            # the main-loop step each scripted answer was for
        self.tool_results: list[str] = []     # what the agent sent back as each tool's result
        self.on_step: Callable[[int], Awaitable[None]] | None = None
        self.edit_step = 0                    # the step whose answer is the edit
        self.shell_step = 1                   # the step whose answer runs the tests

    def expected_header(self) -> str:
        raise NotImplementedError

    def authorized(self, request: web.Request) -> bool:
        return request.headers.get(self.header) == self.expected_header()

    def authorized_seen(self, seen) -> bool:
        """Whether a recorded request carried the real key in the provider's header."""
        return {k.lower(): v for k, v in seen.headers.items()}.get(self.header.lower()) == self.expected_header()

    async def stream(self, request: web.Request, events: list[tuple[str, dict]]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for name, doc in events:
            await resp.write(_sse(name, doc))
        await resp.write_eof()
        return resp

    async def _before(self, step: int) -> None:
        self.steps.append(step)
        if self.on_step is not None:
            await self.on_step(step)


class ScriptedAnthropic(Scripted):
    header = "x-api-key"
    # The tool calls per agent, by the tools its requests offer. Claude Code under
    # ACP: the adapter's MCP tools that route to ACP fs/terminal. opencode: its own
    # tools, whose edit refuses a file not read first in the session.
    SCRIPTS: ClassVar[dict[str, tuple]] = {
        "mcp__acp__Edit": (
            ("mcp__acp__Edit", {"file_path": "/workspace/calc.py", "old_string": BUGGY_SOURCE,
                                "new_string": FIXED_SOURCE}),
            ("mcp__acp__Bash", {"command": TEST_COMMAND, "timeout": 60000, "description": "Run the unit tests"}),
        ),
        "edit": (
            ("read", {"filePath": "/workspace/calc.py"}),
            ("edit", {"filePath": "/workspace/calc.py", "oldString": BUGGY_SOURCE, "newString": FIXED_SOURCE}),
            ("bash", {"command": TEST_COMMAND, "timeout": 60000, "description": "Run the unit tests"}),
        ),
    }

    def expected_header(self) -> str:
        return self.key

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)

    async def count_tokens(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return self.unauthorized()
        return web.json_response({"input_tokens": IN_TOKENS})

    def unauthorized(self) -> web.Response:
        return web.json_response({"type": "error", "error": {"type": "authentication_error",
                                                             "message": "invalid x-api-key"}}, status=401)

    def script_for(self, tools: set) -> tuple | None:
        for marker, script in self.SCRIPTS.items():
            if {name for name, _ in script} <= tools and marker in tools:
                return script
        return None

    async def messages(self, request: web.Request) -> web.StreamResponse:
        if not self.authorized(request):
            return self.unauthorized()
        body = await request.json()
        script = self.script_for({t.get("name") for t in body.get("tools") or []})
        if script is None:
            return await self.answer(request, body, [{"type": "text", "text": "Fix add() in calc.py"}], "end_turn")
        results = [b for m in body.get("messages", []) if m.get("role") == "user"
                   and isinstance(m.get("content"), list)
                   for b in m["content"] if b.get("type") == "tool_result"]
        step = len(results)
        self.tool_results = [json.dumps(r.get("content")) for r in results]
        self.edit_step = next(i for i, (name, _) in enumerate(script) if name.lower().endswith("edit"))
        self.shell_step = len(script) - 1
        await self._before(step)
        if step < len(script):
            name, args = script[step]
            return await self.answer(request, body, [self.tool_use(name, args)], "tool_use")
        return await self.answer(request, body, [{"type": "text", "text": FINAL_TEXT}], "end_turn")

    @staticmethod
    def tool_use(name: str, args: dict) -> dict:
        return {"type": "tool_use", "id": "toolu_" + secrets.token_hex(12), "name": name, "input": args}

    async def answer(self, request: web.Request, body: dict, blocks: list[dict], stop: str) -> web.StreamResponse:
        usage = {"input_tokens": IN_TOKENS, "output_tokens": OUT_TOKENS}
        msg = {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant",
               "model": body.get("model"), "stop_sequence": None}
        if not body.get("stream"):
            return web.json_response({**msg, "content": blocks, "stop_reason": stop, "usage": usage})
        events = [("message_start", {"type": "message_start", "message": {
            **msg, "content": [], "stop_reason": None,
            "usage": {"input_tokens": IN_TOKENS, "output_tokens": 1, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0}}})]
        for i, block in enumerate(blocks):
            if block["type"] == "tool_use":
                start = {**block, "input": {}}
                raw = json.dumps(block["input"])
                deltas = [{"type": "input_json_delta", "partial_json": raw[j:j + 20]} for j in range(0, len(raw), 20)]
            else:
                start = {"type": "text", "text": ""}
                deltas = [{"type": "text_delta", "text": block["text"]}]
            events.append(("content_block_start", {"type": "content_block_start", "index": i, "content_block": start}))
            events += [("content_block_delta", {"type": "content_block_delta", "index": i, "delta": d}) for d in deltas]
            events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
        events.append(("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": stop, "stop_sequence": None},
                                         "usage": {"output_tokens": OUT_TOKENS}}))
        events.append(("message_stop", {"type": "message_stop"}))
        return await self.stream(request, events)


class ScriptedResponses(Scripted):
    header = "Authorization"
    RESULT_TYPES = ("function_call_output", "custom_tool_call_output")

    def expected_header(self) -> str:
        return f"Bearer {self.key}"

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/models", self.models)

    async def models(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return self.unauthorized()
        return web.json_response({"object": "list", "data": [], "models": []})

    def unauthorized(self) -> web.Response:
        return web.json_response({"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                                            "code": "invalid_api_key"}}, status=401)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        if not self.authorized(request):
            return self.unauthorized()
        body = await request.json()
        items = body.get("input") if isinstance(body.get("input"), list) else []
        results = [it for it in items if it.get("type") in self.RESULT_TYPES]
        tools = {t.get("name"): t for t in body.get("tools") or [] if isinstance(t, dict)}
        if not tools:
            return await self.answer(request, body, [self.message("Fix add() in calc.py")])
        step = len(results)
        self.tool_results = [str(r.get("output")) for r in results]
        await self._before(step)
        if step == 0:
            item = self.patch_call(tools)
        elif step == 1:
            item = self.shell_call(tools)
        else:
            item = self.message(FINAL_TEXT)
        return await self.answer(request, body, [item])

    @staticmethod
    def message(text: str) -> dict:
        return {"type": "message", "id": "msg_" + secrets.token_hex(12), "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    def patch_call(self, tools: dict) -> dict:
        call_id = "call_" + secrets.token_hex(12)
        tool = tools.get("apply_patch")
        if tool is not None and tool.get("type") == "custom":
            return {"type": "custom_tool_call", "id": "ctc_" + secrets.token_hex(12), "status": "completed",
                    "call_id": call_id, "name": "apply_patch", "input": PATCH}
        if tool is not None:
            return self.function("apply_patch", {"input": PATCH}, call_id)
        raise web.HTTPBadRequest(text=f"no apply_patch tool among {sorted(tools)}")

    def shell_call(self, tools: dict) -> dict:
        call_id = "call_" + secrets.token_hex(12)
        if "shell_command" in tools:
            return self.function("shell_command", {"command": TEST_COMMAND, "workdir": "/workspace",
                                                   "timeout_ms": 60000}, call_id)
        if "exec_command" in tools:
            return self.function("exec_command", {"cmd": TEST_COMMAND, "workdir": "/workspace"}, call_id)
        if "shell" in tools:
            return self.function("shell", {"command": ["bash", "-lc", TEST_COMMAND], "workdir": "/workspace",
                                           "timeout_ms": 60000}, call_id)
        raise web.HTTPBadRequest(text=f"no shell tool among {sorted(tools)}")

    @staticmethod
    def function(name: str, args: dict, call_id: str) -> dict:
        return {"type": "function_call", "id": "fc_" + secrets.token_hex(12), "status": "completed",
                "call_id": call_id, "name": name, "arguments": json.dumps(args)}

    async def answer(self, request: web.Request, body: dict, items: list[dict]) -> web.StreamResponse:
        usage = {"input_tokens": IN_TOKENS, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                 "output_tokens": OUT_TOKENS, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": IN_TOKENS + OUT_TOKENS}
        response = {"id": "resp_" + secrets.token_hex(12), "object": "response", "created_at": int(time.time()),
                    "status": "in_progress", "model": body.get("model"), "output": [], "usage": None,
                    "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
                    "metadata": {}, "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
                    "temperature": None, "top_p": None, "tool_choice": body.get("tool_choice") or "auto",
                    "tools": body.get("tools") or []}
        if not body.get("stream"):
            return web.json_response({**response, "status": "completed", "output": items, "usage": usage})
        seq = iter(range(1000))
        events = [("response.created", {"type": "response.created", "sequence_number": next(seq),
                                        "response": response}),
                  ("response.in_progress", {"type": "response.in_progress", "sequence_number": next(seq),
                                            "response": response})]
        for i, item in enumerate(items):
            if item["type"] == "message":
                events.append(("response.output_item.added", {
                    "type": "response.output_item.added", "sequence_number": next(seq), "output_index": i,
                    "item": {**item, "status": "in_progress", "content": []}}))
                text = item["content"][0]["text"]
                events.append(("response.output_text.delta", {
                    "type": "response.output_text.delta", "sequence_number": next(seq), "item_id": item["id"],
                    "output_index": i, "content_index": 0, "delta": text, "logprobs": []}))
            elif item["type"] == "function_call":
                events.append(("response.output_item.added", {
                    "type": "response.output_item.added", "sequence_number": next(seq), "output_index": i,
                    "item": {**item, "status": "in_progress", "arguments": ""}}))
                events.append(("response.function_call_arguments.delta", {
                    "type": "response.function_call_arguments.delta", "sequence_number": next(seq),
                    "item_id": item["id"], "output_index": i, "delta": item["arguments"]}))
                events.append(("response.function_call_arguments.done", {
                    "type": "response.function_call_arguments.done", "sequence_number": next(seq),
                    "item_id": item["id"], "output_index": i, "arguments": item["arguments"]}))
            else:
                events.append(("response.output_item.added", {
                    "type": "response.output_item.added", "sequence_number": next(seq), "output_index": i,
                    "item": {**item, "status": "in_progress", "input": ""}}))
                events.append(("response.custom_tool_call_input.delta", {
                    "type": "response.custom_tool_call_input.delta", "sequence_number": next(seq),
                    "item_id": item["id"], "output_index": i, "delta": item["input"]}))
                events.append(("response.custom_tool_call_input.done", {
                    "type": "response.custom_tool_call_input.done", "sequence_number": next(seq),
                    "item_id": item["id"], "output_index": i, "input": item["input"]}))
            events.append(("response.output_item.done", {"type": "response.output_item.done",
                                                         "sequence_number": next(seq), "output_index": i,
                                                         "item": item}))
        events.append(("response.completed", {"type": "response.completed", "sequence_number": next(seq),
                                              "response": {**response, "status": "completed", "output": items,
                                                           "usage": usage}}))
        return await self.stream(request, events)


class ScriptedGemini(Scripted):
    """The Gemini API (`POST /v1beta/models/<model>:streamGenerateContent?alt=sse`
    and `:generateContent`), as Gemini CLI (`gemini --acp`) calls it: its
    `replace` and `run_shell_command` tools; side requests (its model router
    and next-speaker check ask for JSON; an answer that does not parse is
    retried with back-off) get the JSON they ask for."""

    header = "x-goog-api-key"
    SCRIPT: ClassVar[tuple] = (
        ("replace", {"file_path": "/workspace/calc.py", "old_string": BUGGY_SOURCE, "new_string": FIXED_SOURCE,
                     "instruction": "make add() add"}),
        ("run_shell_command", {"command": TEST_COMMAND, "description": "Run the unit tests"}),
    )

    def expected_header(self) -> str:
        return self.key

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1beta/models/{call}", self.call)

    def unauthorized(self) -> web.Response:
        return web.json_response({"error": {"code": 400, "message": "API key not valid. Please pass a valid API key.",
                                            "status": "INVALID_ARGUMENT"}}, status=400)

    async def call(self, request: web.Request) -> web.StreamResponse:
        if not self.authorized(request):
            return self.unauthorized()
        model, _, method = request.match_info["call"].partition(":")
        body = await request.json()
        if method == "countTokens":
            return web.json_response({"totalTokens": IN_TOKENS})
        names = {f.get("name") for t in body.get("tools") or [] for f in t.get("functionDeclarations") or []}
        if {name for name, _ in self.SCRIPT} <= names:
            results = [p for c in body.get("contents") or [] for p in c.get("parts") or [] if "functionResponse" in p]
            step = len(results)
            self.tool_results = [json.dumps(r["functionResponse"].get("response")) for r in results]
            await self._before(step)
            if step < len(self.SCRIPT):
                name, args = self.SCRIPT[step]
                parts = [{"functionCall": {"name": name, "args": args}}]
            else:
                parts = [{"text": FINAL_TEXT}]
        else:
            parts = [{"text": self.side_answer(body)}]
        chunk = {"candidates": [{"content": {"role": "model", "parts": parts}, "finishReason": "STOP", "index": 0}],
                 "usageMetadata": {"promptTokenCount": IN_TOKENS, "candidatesTokenCount": OUT_TOKENS,
                                   "totalTokenCount": IN_TOKENS + OUT_TOKENS},
                 "modelVersion": model}
        if method == "streamGenerateContent":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(f"data: {json.dumps(chunk)}\r\n\r\n".encode())
            await resp.write_eof()
            return resp
        return web.json_response(chunk)

    @staticmethod
    def side_answer(body: dict) -> str:
        config = body.get("generationConfig") or body.get("config") or {}
        schema = json.dumps(config.get("responseJsonSchema") or config.get("responseSchema") or {})
        if "complexity_score" in schema:      # its model router
            return json.dumps({"complexity_reasoning": "a one-line fix", "complexity_score": 20})
        if "model_choice" in schema:
            return json.dumps({"reasoning": "a small edit", "model_choice": "flash"})
        if "next_speaker" in schema:
            return json.dumps({"reasoning": "the task is done", "next_speaker": "user"})
        return "Fix add() in calc.py"
