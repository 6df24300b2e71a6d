"""The node kinds, one module each, behind one table: `NODE_KINDS[node.kind](ctx, node)`
returns the node's output or raises an `AfeError` saying why it failed."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from services.common.config.model import Node

from ..context import RunContext
from .agent import agent_node
from .builtins import builtin_node
from .model import model_node
from .run import run_node

NodeKind = Callable[[RunContext, Node], Awaitable[str]]

NODE_KINDS: dict[str, NodeKind] = {
    "run": run_node,
    "model": model_node,
    "agent": agent_node,
    "builtin": builtin_node,
}
