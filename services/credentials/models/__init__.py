"""Model providers: openai, anthropic, replay."""

from .base import Completion, ModelProvider, Msg, Tool, ToolCallData

__all__ = ["Completion", "ModelProvider", "Msg", "Tool", "ToolCallData"]
