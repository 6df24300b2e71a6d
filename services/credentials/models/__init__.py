"""Model providers the broker calls for afe's own model nodes: OpenAI, Anthropic, and a replay of recorded answers."""

from .base import Completion, ModelProvider, Msg, Tool, ToolCallData

__all__ = ["Completion", "ModelProvider", "Msg", "Tool", "ToolCallData"]
