"""Provider-neutral chat types and the provider interface."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from services.common.config import Model


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
    extra: dict = field(default_factory=dict)


class ModelProvider(abc.ABC):
    @abc.abstractmethod
    async def complete(self, model: Model, messages: list[Msg], tools: list[Tool],
                       max_tokens: int) -> Completion: ...

    async def close(self) -> None:
        return None
