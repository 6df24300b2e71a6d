"""The `replay` provider: scripted responses from Model.script (tests, demo).

Format (services/common/demo/demo-model.yaml):
    loop: false            # optional; true cycles through the responses forever
    responses:
      - content: "..."
        tool_calls: [{name: read_file, arguments: {path: x}}]
        usage: {input_tokens: 10, output_tokens: 5}    # optional
Response i answers the request that already holds i assistant messages, so a
script is stateless. Past the end (without loop) the answer is a final plain
message. Usage is estimated as len/4 when the script does not give it.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from services.common.config.model import Model
from services.common.errors import ConfigError, FailedPrecondition

from .base import Completion, JsonObject, ModelProvider, Msg, Tool, ToolCallData

FINAL = "The scripted conversation is over."


def _estimate(text: str) -> int:
    return max(1, len(text) // 4)


class ReplayProvider(ModelProvider):
    def __init__(self) -> None:
        self._cache: dict[Path, tuple[float, JsonObject]] = {}

    def _script(self, model: Model) -> JsonObject:
        if model.script is None:
            raise FailedPrecondition(f"model {model.name!r}: a replay model needs script: <file>")
        path = Path(model.script)
        try:
            mtime = path.stat().st_mtime
        except OSError:
            raise FailedPrecondition(f"model {model.name!r}: script {path} cannot be read") from None
        cached = self._cache.get(path)
        if cached and cached[0] == mtime:
            return cached[1]
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"model {model.name!r}: script {path} is not valid YAML ({exc})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("responses", []), list):
            raise ConfigError(f"model {model.name!r}: script {path} needs a 'responses' list")
        self._cache[path] = (mtime, doc)
        return doc

    async def complete(self, model: Model, messages: list[Msg], tools: list[Tool],
                       max_tokens: int) -> Completion:
        doc = self._script(model)
        responses = doc.get("responses") or []
        turn = sum(1 for m in messages if m.role == "assistant")
        if responses and doc.get("loop"):
            item = responses[turn % len(responses)]
        elif turn < len(responses):
            item = responses[turn]
        else:
            item = {"content": FINAL}
        if not isinstance(item, dict):
            item = {"content": str(item)}
        calls = []
        for i, c in enumerate(item.get("tool_calls") or []):
            args = c.get("arguments", {})
            calls.append(ToolCallData(f"call_{turn}_{i}", str(c.get("name", "")),
                                      args if isinstance(args, str) else json.dumps(args)))
        content = str(item.get("content") or "")
        usage = item.get("usage") or {}
        prompt = "".join(m.content for m in messages) + "".join(c.arguments_json for m in messages
                                                                for c in m.tool_calls)
        out_text = content + "".join(c.arguments_json for c in calls)
        return Completion(
            message=Msg(role="assistant", content=content, tool_calls=tuple(calls)),
            input_tokens=int(usage.get("input_tokens") or _estimate(prompt)),
            output_tokens=int(usage.get("output_tokens") or _estimate(out_text)),
            stop_reason="tool_use" if calls else "end_turn",
        )
