"""OpenAI Chat Completions (any compatible base URL), with tools.
The key travels only in the `Authorization` header."""

from __future__ import annotations

from services.common.config.model import Model
from services.common.errors import Unavailable

from .base import Completion, HttpModelProvider, JsonObject, Msg, Tool, ToolCallData, tool_schema

DEFAULT_BASE_URL = "https://api.openai.com/v1"
_STOP = {"stop": "end_turn", "tool_calls": "tool_use", "function_call": "tool_use", "length": "max_tokens",
         "content_filter": "content_filter"}


class OpenAIProvider(HttpModelProvider):
    default_base_url = DEFAULT_BASE_URL
    path = "/chat/completions"

    def auth_headers(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    @staticmethod
    def body(model: Model, messages: list[Msg], tools: list[Tool], max_tokens: int) -> JsonObject:
        out: list[JsonObject] = []
        for m in messages:
            if m.role == "tool":
                out.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": m.content})
            elif m.role == "assistant" and m.tool_calls:
                out.append({"role": "assistant", "content": m.content or None,
                            "tool_calls": [{"id": c.id, "type": "function",
                                            "function": {"name": c.name, "arguments": c.arguments_json or "{}"}}
                                           for c in m.tool_calls]})
            else:
                out.append({"role": m.role, "content": m.content})
        body: JsonObject = {"model": model.model, "messages": out, "max_tokens": max_tokens}
        if tools:
            body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                               "parameters": tool_schema(t)}} for t in tools]
        return body

    async def complete(self, model: Model, messages: list[Msg], tools: list[Tool],
                       max_tokens: int) -> Completion:
        resp = await self.post(model, self.body(model, messages, tools, max_tokens))
        try:
            choice = resp.body["choices"][0]
            msg = choice["message"]
            calls = tuple(ToolCallData(str(c.get("id", "")), str(c["function"]["name"]),
                                       str(c["function"].get("arguments") or "{}"))
                          for c in (msg.get("tool_calls") or []))
            usage = resp.body.get("usage") or {}
            return Completion(
                message=Msg(role="assistant", content=msg.get("content") or "", tool_calls=calls),
                input_tokens=int(usage.get("prompt_tokens") or 0),
                output_tokens=int(usage.get("completion_tokens") or 0),
                stop_reason="tool_use" if calls else _STOP.get(choice.get("finish_reason") or "stop", "end_turn"),
            )
        except (KeyError, IndexError, TypeError, ValueError):
            raise Unavailable(f"model {model.name!r}: the server's answer is not a Chat Completions response") from None
