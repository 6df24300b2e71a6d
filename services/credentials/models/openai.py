"""OpenAI Chat Completions (any compatible base URL), with tools.
The key travels only in the `Authorization` header."""

from __future__ import annotations

import json

from services.common.config import Model
from services.common.errors import FailedPrecondition, Unavailable
from services.common.secrets import SecretValue

from ..httpclient import HttpClient
from .base import Completion, ModelProvider, Msg, Tool, ToolCallData

DEFAULT_BASE_URL = "https://api.openai.com/v1"
_STOP = {"stop": "end_turn", "tool_calls": "tool_use", "function_call": "tool_use", "length": "max_tokens",
         "content_filter": "content_filter"}


def key_for(model: Model, keys: dict[str, SecretValue]) -> str | None:
    if not model.api_key_env:
        return None
    secret = keys.get(model.api_key_env)
    if secret is None:
        raise FailedPrecondition(f"model {model.name!r}: environment variable {model.api_key_env} (its apiKeyEnv) "
                                 "is not set in the credential broker's environment")
    return secret.reveal()


def _schema(t: Tool) -> dict:
    try:
        schema = json.loads(t.parameters_json_schema) if t.parameters_json_schema else {}
    except ValueError:
        schema = {}
    return schema or {"type": "object", "properties": {}}


class OpenAIProvider(ModelProvider):
    def __init__(self, http: HttpClient, keys: dict[str, SecretValue]) -> None:
        self.http = http
        self.keys = keys

    @staticmethod
    def body(model: Model, messages: list[Msg], tools: list[Tool], max_tokens: int) -> dict:
        out: list[dict] = []
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
        body: dict = {"model": model.model, "messages": out, "max_tokens": max_tokens}
        if tools:
            body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                               "parameters": _schema(t)}} for t in tools]
        return body

    async def complete(self, model, messages, tools, max_tokens):
        headers = {"Content-Type": "application/json"}
        key = key_for(model, self.keys)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        url = (model.base_url or DEFAULT_BASE_URL).rstrip("/") + "/chat/completions"
        what = f"model {model.name!r}"
        resp = await self.http.request("POST", url, headers=headers,
                                       json_body=self.body(model, messages, tools, max_tokens),
                                       timeout_s=model.timeout_s, what=what)
        if not resp.ok:
            raise self.http.error(resp, what, hint_auth=f"check the key in {model.api_key_env}")
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
            raise Unavailable(f"{what}: the server's answer is not a Chat Completions response") from None
