"""Provider-neutral chat types and the provider interface."""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.common.config.model import Model
from services.common.errors import FailedPrecondition
from services.common.secrecy.env_secrets import SecretValue

if TYPE_CHECKING:
    from ..httpclient import HttpClient, Response

# A JSON object as a provider takes or answers it (a request body, a message, a content block).
JsonObject = dict[str, Any]


@dataclass(frozen=True)
class ToolCallData:
    id: str
    name: str
    arguments_json: str


@dataclass(frozen=True)
class Msg:
    role: str                              # system | user | assistant | tool
    content: str = ""
    tool_calls: tuple[ToolCallData, ...] = ()
    tool_call_id: str = ""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters_json_schema: str


@dataclass(frozen=True)
class Completion:
    message: Msg
    input_tokens: int
    output_tokens: int
    stop_reason: str                       # end_turn | tool_use | max_tokens | ...
    extra: JsonObject = field(default_factory=dict)


class ModelProvider(abc.ABC):
    @abc.abstractmethod
    async def complete(self, model: Model, messages: list[Msg], tools: list[Tool],
                       max_tokens: int) -> Completion: ...

    async def close(self) -> None:
        return None


def key_for(model: Model, keys: dict[str, SecretValue]) -> str | None:
    """The API key of `model` (None when it names no apiKeyEnv)."""
    if not model.api_key_env:
        return None
    secret = keys.get(model.api_key_env)
    if secret is None:
        raise FailedPrecondition(f"model {model.name!r}: environment variable {model.api_key_env} (its apiKeyEnv) "
                                 "is not set in the credential broker's environment")
    return secret.reveal()


def tool_schema(t: Tool) -> JsonObject:
    try:
        schema = json.loads(t.parameters_json_schema) if t.parameters_json_schema else {}
    except ValueError:
        schema = {}
    return schema or {"type": "object", "properties": {}}


class HttpModelProvider(ModelProvider):
    """A provider speaking JSON over HTTPS. The key goes only into the
    header(s) that `auth_headers` builds (never a URL, a body or a log)."""

    default_base_url = ""
    path = ""

    def __init__(self, http: HttpClient, keys: dict[str, SecretValue]) -> None:
        self.http = http
        self.keys = keys

    def headers(self) -> dict[str, str]:
        return {"Content-Type": "application/json"}

    @abc.abstractmethod
    def auth_headers(self, key: str) -> dict[str, str]: ...

    async def post(self, model: Model, body: JsonObject) -> Response:
        headers = self.headers()
        key = key_for(model, self.keys)
        if key:
            headers.update(self.auth_headers(key))
        url = (model.base_url or self.default_base_url).rstrip("/") + self.path
        what = f"model {model.name!r}"
        resp = await self.http.request("POST", url, headers=headers, json_body=body,
                                       timeout_s=model.timeout_s, what=what)
        if not resp.ok:
            raise self.http.error(resp, what, hint_auth=f"check the key in {model.api_key_env}")
        return resp
