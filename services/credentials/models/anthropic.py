"""Anthropic Messages API with tool use. The key travels only in the
`x-api-key` header."""

from __future__ import annotations

import json

from services.common.config.model import Model
from services.common.errors import Unavailable

from .base import Completion, HttpModelProvider, JsonObject, Msg, Tool, ToolCallData, tool_schema

DEFAULT_BASE_URL = "https://api.anthropic.com"
API_VERSION = "2023-06-01"


class AnthropicProvider(HttpModelProvider):
    default_base_url = DEFAULT_BASE_URL
    path = "/v1/messages"

    def headers(self) -> dict[str, str]:
        return {"Content-Type": "application/json", "anthropic-version": API_VERSION}

    def auth_headers(self, key: str) -> dict[str, str]:
        return {"x-api-key": key}

    @staticmethod
    def body(model: Model, messages: list[Msg], tools: list[Tool], max_tokens: int) -> JsonObject:
        system = "\n\n".join(m.content for m in messages if m.role == "system" and m.content)
        out: list[JsonObject] = []
        for m in messages:
            if m.role == "system":
                continue
            if m.role == "tool":
                block = {"type": "tool_result", "tool_use_id": m.tool_call_id, "content": m.content}
                if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list) \
                        and all(b.get("type") == "tool_result" for b in out[-1]["content"]):
                    out[-1]["content"].append(block)
                else:
                    out.append({"role": "user", "content": [block]})
            elif m.role == "assistant":
                blocks: list[JsonObject] = []
                if m.content:
                    blocks.append({"type": "text", "text": m.content})
                for c in m.tool_calls:
                    try:
                        args = json.loads(c.arguments_json or "{}")
                    except ValueError:
                        args = {}
                    blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": args})
                out.append({"role": "assistant", "content": blocks or [{"type": "text", "text": ""}]})
            else:
                out.append({"role": "user", "content": m.content})
        body: JsonObject = {"model": model.model, "max_tokens": max_tokens, "messages": out}
        if system:
            body["system"] = system
        if tools:
            body["tools"] = [{"name": t.name, "description": t.description, "input_schema": tool_schema(t)}
                             for t in tools]
        return body

    async def complete(self, model: Model, messages: list[Msg], tools: list[Tool],
                       max_tokens: int) -> Completion:
        resp = await self.post(model, self.body(model, messages, tools, max_tokens))
        try:
            text = []
            calls = []
            for b in resp.body["content"]:
                if b.get("type") == "text":
                    text.append(b.get("text", ""))
                elif b.get("type") == "tool_use":
                    calls.append(ToolCallData(str(b.get("id", "")), str(b["name"]),
                                              json.dumps(b.get("input") or {})))
            usage = resp.body.get("usage") or {}
            return Completion(
                message=Msg(role="assistant", content="".join(text), tool_calls=tuple(calls)),
                input_tokens=int(usage.get("input_tokens") or 0),
                output_tokens=int(usage.get("output_tokens") or 0),
                stop_reason=str(resp.body.get("stop_reason") or ("tool_use" if calls else "end_turn")),
            )
        except (KeyError, TypeError, ValueError):
            raise Unavailable(f"model {model.name!r}: the server's answer is not a Messages API response") from None
