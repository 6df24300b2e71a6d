"""What the manifest loader has collected so far, as the per-kind modules
(agent.py, mcp.py, model.py, trigger.py, workflow.py, workspace.py) see it: the
folder being read and the documents loaded, by kind and name.

`Loader` (loader.py) is one; the kind modules type their `load(loader, ...)`
against this class, so they need not import loader.py, which imports them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.config.model import Agent, McpServer, Model, Trigger, Workflow, Workspace


@dataclass
class Collected:
    directory: Path
    workspaces: dict[str, Workspace] = field(default_factory=dict)
    models: dict[str, Model] = field(default_factory=dict)
    agents: dict[str, Agent] = field(default_factory=dict)
    workflows: dict[str, Workflow] = field(default_factory=dict)
    triggers: dict[str, Trigger] = field(default_factory=dict)
    mcp_servers: dict[str, McpServer] = field(default_factory=dict)
    # the raw `nodes:` list of each workflow, for the checks made once every document is read
    _raw_nodes: dict[str, list[Any]] = field(default_factory=dict)
