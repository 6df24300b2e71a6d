"""OpenAI- and Anthropic-compatible fakes. Each answers from a queue of
scripted replies (`reply_text`, `reply_tool_call`), checks the key header,
and records every request."""

from __future__ import annotations

import json

from aiohttp import web

from .base import FakeServer


class FakeOpenAI(FakeServer):
    """Serves POST /v1/chat/completions; base_url for the Model is `url + '/v1'`."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key
        self.replies: list[dict] = []

    def reply_text(self, text: str, prompt_tokens: int = 11, completion_tokens: int = 7) -> None:
        self.replies.append({"message": {"role": "assistant", "content": text}, "finish_reason": "stop",
                             "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}})

    def reply_tool_call(self, name: str, arguments: dict, call_id: str = "call_1", text: str = "") -> None:
        self.replies.append({"message": {"role": "assistant", "content": text or None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]},
            "finish_reason": "tool_calls", "usage": {"prompt_tokens": 20, "completion_tokens": 9}})

    def routes(self, app):
        app.router.add_post("/v1/chat/completions", self.complete)

    async def complete(self, request):
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"error": {"message": "Incorrect API key provided",
                                                "type": "invalid_request_error"}}, status=401)
        body = await request.json()
        if not self.replies:
            return web.json_response({"error": {"message": "no scripted reply"}}, status=500)
        r = self.replies.pop(0)
        return web.json_response({"id": "chatcmpl-1", "object": "chat.completion", "model": body.get("model"),
                                  "choices": [{"index": 0, "message": r["message"],
                                               "finish_reason": r["finish_reason"]}],
                                  "usage": r["usage"]})


class FakeAnthropic(FakeServer):
    """Serves POST /v1/messages; base_url for the Model is `url`."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key
        self.replies: list[dict] = []

    def reply_text(self, text: str, input_tokens: int = 13, output_tokens: int = 5) -> None:
        self.replies.append({"content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
                             "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}})

    def reply_tool_call(self, name: str, arguments: dict, call_id: str = "toolu_1", text: str = "") -> None:
        content = ([{"type": "text", "text": text}] if text else []) + [
            {"type": "tool_use", "id": call_id, "name": name, "input": arguments}]
        self.replies.append({"content": content, "stop_reason": "tool_use",
                             "usage": {"input_tokens": 30, "output_tokens": 12}})

    def routes(self, app):
        app.router.add_post("/v1/messages", self.complete)

    async def complete(self, request):
        if request.headers.get("x-api-key") != self.key:
            return web.json_response({"type": "error", "error": {"type": "authentication_error",
                                                                 "message": "invalid x-api-key"}}, status=401)
        if not request.headers.get("anthropic-version"):
            return web.json_response({"type": "error", "error": {"type": "invalid_request_error",
                                                                 "message": "anthropic-version required"}},
                                     status=400)
        body = await request.json()
        if not self.replies:
            return web.json_response({"type": "error", "error": {"message": "no scripted reply"}}, status=500)
        r = self.replies.pop(0)
        return web.json_response({"id": "msg_1", "type": "message", "role": "assistant", "model": body.get("model"),
                                  **r})
